"""Deaths while groups form: the survivors are released at once and heal onto one mesh.

Issue 32, item 2 and deliver 4. A world of 8 (or 4) forked gloo ranks trains on
a mesh guarded by a liveness watch, its groups' timeout 60 s, and heals after
every failure (``_workers_formation.trainer``). The test process, which hosts
the store, SIGKILLs ranks from outside: two 50 ms apart at a random moment
(a node's failure), one while the first groups form, one at its formation
barrier, one while a heal re-forms, and one of the mesh while a peer's group
waits for a rank busy in user code (the abort must reach that formation).

The bounds are "released within about a second" with generous margins for a
loaded machine (:data:`RELEASED`): before the fix a survivor stuck in a
formation waited for the 60 s group timeout, and the survivors could end on
different meshes.
"""

from __future__ import annotations

import random
from typing import Any

import _workers_formation as workers
import pytest

RELEASED = 6.0  # seconds from the last death to a survivor's last failure: "about a second"
TIMEOUT = 60.0  # the mesh's group timeout, which a stuck formation used to wait out
SHAPE = (4, 2)


def _plan(shape: tuple[int, ...] = SHAPE, **extra: Any) -> dict[str, Any]:
    return {
        "shape": list(shape),
        "names": ["dp", "tp"],
        "interval": 0.02,
        "timeout": TIMEOUT,
        "after": 3,
        "max_steps": 100_000,
        **extra,
    }


def _survivors_mesh(shape: tuple[int, ...], dead: list[int]) -> list[int]:
    """The ranks left once every dp slice (row) holding a dead rank is dropped."""
    tp = shape[1]
    rows = {rank // tp for rank in dead}
    return [rank for rank in range(shape[0] * tp) if rank // tp not in rows]


def _check(
    result: dict[str, Any],
    dead: list[int],
    shape: tuple[int, ...] = SHAPE,
    busy: tuple[int, ...] = (),
) -> dict[int, dict[str, Any]]:
    """Every survivor healed onto the one right mesh, each released within :data:`RELEASED`
    of the last death (``busy`` ranks, in user code then, excepted); the survivors' reports."""
    reports = result["reports"]
    for rank, report in sorted(reports.items()):
        assert "unexpected" not in report, f"rank {rank}:\n{report['unexpected']}"
    assert sorted(set(range(len(result["exitcodes"]))) - set(reports)) == sorted(dead), result
    last = result["kills"][-1]
    mesh = _survivors_mesh(shape, dead)
    survivors = {rank: report for rank, report in reports.items() if rank not in dead}
    released = {
        rank: round(report["events"][-1]["error_at"] - last, 3)
        for rank, report in survivors.items()
        if rank not in busy
    }
    assert max(released.values()) < RELEASED, (released, _events(survivors, last))
    for rank, report in survivors.items():
        if rank in mesh:
            assert report["ranks"] == mesh, (rank, _events(survivors, last))
            assert report["counts"] == [len(mesh) // shape[1], shape[1]]  # members per axis
        else:  # shared a dropped dp slice with a dead rank: sat out
            assert "sat_out" in report, (rank, report)
    return survivors


def _events(reports: dict[int, dict[str, Any]], last: float) -> dict[int, list[Any]]:
    """Each rank's events, times from the last death, for a failing assertion's message."""
    return {
        rank: [
            {k: round(v - last, 3) if k.endswith("_at") else v for k, v in event.items()}
            for event in report["events"]
        ]
        for rank, report in reports.items()
    }


def _two_rows(rng: random.Random) -> list[int]:
    """Two ranks in different dp slices of the 4 x 2 mesh: the survivors' mesh is 2 x 2."""
    first, second = rng.sample(range(SHAPE[0]), 2)
    return [first * 2 + rng.randrange(2), second * 2 + rng.randrange(2)]


@pytest.mark.fault  # a slow lane: .ci/run runs it (three worlds of 8 ranks)
def test_two_deaths_50_ms_apart_release_the_survivors_onto_one_mesh() -> None:
    """A node's failure: two ranks SIGKILLed 50 ms apart at a random moment, three times."""
    rng = random.Random()
    for _ in range(3):
        dead = _two_rows(rng)
        kills = [("step", dead[0], 0.0, 0.3), ("now", dead[1], 0.05, 0.05)]
        _check(workers.launch(_plan(), kills, rng=rng), dead)


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_death_at_the_formation_barrier_releases_the_others() -> None:
    """A rank connected (gloo) but slow to arrive at the barrier after it is SIGKILLed
    there: its group's members wait in the barrier and are told it died, at once."""
    rng = random.Random()
    victim = rng.randrange(8)
    kills = [("barrier", victim, 0.0, 0.1)]
    survivors = _check(workers.launch(_plan(slow_barrier=victim), kills, rng=rng), [victim])
    peers = [rank for rank in survivors if rank // 2 != victim // 2 and rank % 2 == victim % 2]
    for rank in peers:  # its dp group's members: they were in the barrier with it
        assert f"rank {victim} has died" in survivors[rank]["events"][0]["error"], survivors[rank]


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_kill_while_a_guarded_mesh_forms_its_first_group() -> None:
    rng = random.Random()
    victim = rng.randrange(8)
    kills = [("forming", victim, 0.0, 0.3)]
    _check(workers.launch(_plan(), kills, rng=rng), [victim])


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_kill_while_a_heal_re_forms() -> None:
    """One rank dies at a random step; a second, of another dp slice, while the survivors
    re-form their groups."""
    rng = random.Random()
    dead = _two_rows(rng)
    kills = [("step", dead[0], 0.0, 0.3), ("re-forming", dead[1], 0.0, 0.1)]
    # The survivors train on long enough for the second kill to land (up to 0.1 s after
    # its victim re-forms): with 3 steps after the heal they could finish first, and
    # did in 2 of 5 runs, never meeting the second death.
    _check(workers.launch(_plan(after=300), kills, rng=rng), dead)


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_an_abort_reaches_a_formation_that_waits_for_a_live_peer() -> None:
    """2 x 2: rank 2 is busy in user code for 8 s before it asks for its groups, so rank 0
    waits for it in dp [0, 2]; rank 1 dies meanwhile. The watch aborts the mesh, and the
    abort reaches rank 0's formation (the group is not registered yet): it stops at once."""
    rng = random.Random()
    result = workers.launch(
        _plan((2, 2), idle={"2": 8.0}), [("forming", 1, 0.3, 0.5)], rng=rng, timeout=180
    )
    survivors = _check(result, [1], (2, 2), busy=(2,))
    first = survivors[0]["events"][0]["error"]
    assert first.startswith("MeshClosedError: stopped forming the gloo group along axis 'dp'"), (
        _events(survivors, result["kills"][-1])
    )
