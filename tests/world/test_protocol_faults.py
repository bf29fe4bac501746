"""The fault protocol's findings of issue 43, each on a real gloo world of 4 ranks.

Each was first a counterexample of the simulation (``tests/unit/test_protocol_simulation.py``)
or a run from outside; here the library's own loop shows the fix.
"""

from __future__ import annotations

import _workers_protocol as workers
import pytest

from scopedmesh.testing import run_world

pytestmark = pytest.mark.fault  # a marked lane: .ci/run runs it after the README's command


def test_two_meshes_under_one_watch_each_read_their_own_agreement() -> None:
    results = run_world(workers.two_meshes_one_watch, 4, timeout=120)
    for rank, out in enumerate(results):
        assert out["committed"] == workers.STEPS, (rank, out)
        assert out["w"] == [float(sum(2 * (s + 1) for s in range(workers.STEPS)))], (rank, out)
    assert results[2]["vote"] == 0, results[2]  # its vote completed: the peer committed


def test_an_exception_that_leaves_the_loop_on_one_rank_fails_the_others_within_a_second() -> None:
    results = run_world(workers.an_error_leaves_the_loop, 4, args=([1],), timeout=120)
    assert results[1]["error"] == ["ValueError", "the shape bug of rank 1"], results[1]
    for rank in (0, 2, 3):
        out = results[rank]
        kind, message = out["error"]
        assert kind == "StepError", (rank, out)
        assert "rank 1 left the job after ValueError: the shape bug of rank 1" in message, out
        assert out["after"] < 1.0, (rank, out)


def test_the_same_exception_on_every_rank_is_raised_on_every_rank_in_seconds() -> None:
    results = run_world(workers.an_error_leaves_the_loop, 4, args=([0, 1, 2, 3],), timeout=120)
    for rank, out in enumerate(results):
        kind, message = out["error"]
        assert "the shape bug of rank" in message, (rank, out)
        # As itself where it stopped the step first, twice; elsewhere a StepError that
        # names it (the rank that raised it left the job).
        assert kind in ("RuntimeError", "StepError"), (rank, out)
        assert out["attempts"] <= 3 and out["after"] < 5.0, (rank, out)
    assert "RuntimeError" in [out["error"][0] for out in results], results


def test_a_member_in_doubt_never_waits_for_a_peers_compute() -> None:
    results = run_world(workers.compute_longer_than_the_timeout, 4, args=(4.5,), timeout=120)
    for rank, out in enumerate(results):
        assert out["committed"] == workers.STEPS, (rank, out)
        assert out["w"] == results[0]["w"], (rank, out)
    assert results[3]["computed"] == 4.5


def test_a_slow_member_answers_for_the_mesh_a_heal_that_drops_a_slice_re_formed() -> None:
    """Two heals of a 4 x 2 mesh while rank 4 computes past the watch's timeout: rank 1 and
    then rank 2 sit out (each shared a dp slice with a dead rank), ranks 4 to 7 train on,
    and nobody times out (before, the survivors' agreement on the re-formed 3 x 2 mesh
    waited for rank 4's compute and raised ``TimeoutError`` after the watch's 8 s)."""
    results = run_world(
        workers.a_slow_member_across_two_heals, 8, args=(10.0,), allow_exit=[0, 3], timeout=120
    )
    assert results[0] is None and results[3] is None
    for rank in (1, 2):
        assert results[rank]["sat_out"] is not None, (rank, results[rank])
    for rank in (4, 5, 6, 7):
        out = results[rank]
        assert out["sat_out"] is None and out["committed"] == workers.STEPS, (rank, out)
        assert out["w"] == results[4]["w"], (rank, out)
        assert out["verdicts"][-1][3] == [4, 5, 6, 7], (rank, out)
    assert results[4]["computed"] == 10.0
