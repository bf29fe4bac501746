"""Healing, zero store residue and kept handles, in gloo worlds whose store lives in this process.

One 8-rank world (``workers.heal_world``) runs the CI checks: 20 open/use/close
cycles with the store's key count read after each, kept-handle file descriptors,
then a 4 x 2 (dp x tp) training loop in which rank 5 dies; the survivors agree on
the lost ranks in the store, re-form a 3 x 2 mesh and train on. Their losses must
match plain data parallelism computed in this process. The long forms are slow.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _workers_heal as workers
import pytest

SHAPE = (4, 2)
WORLD = 8
VICTIM = 5  # dp 2, tp 1: its tp partner, rank 4, loses its row and sits out
DEATH_STEP, STEPS = 4, 10
BOUND = 60.0  # seconds: a generous "never hang" bound, not a performance assertion


def _figure(name: str, **values: object) -> None:
    print(f"\nRELIABILITY {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


@pytest.fixture(scope="module")
def healed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    outdir = tmp_path_factory.mktemp("heal_world")
    args = (SHAPE, VICTIM, DEATH_STEP, STEPS, 20, 10)
    return workers.launch(workers.heal_world, WORLD, str(outdir), args, timeout=600)


def _reports(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    reports = result["reports"]
    assert set(reports) == set(range(WORLD)), result["exitcodes"]
    for rank, report in reports.items():
        assert "unexpected" not in report, f"rank {rank}:\n{report['unexpected']}"
    return reports  # type: ignore[no-any-return]


def test_store_keys_stay_flat_across_cycles(healed: dict[str, Any]) -> None:
    """After the first cycle (which makes the generation counters and process records) no cycle
    adds a key."""
    for rank, report in _reports(healed).items():
        keys = report["residue"]["keys"]
        assert report["residue"]["bad_sums"] == 0
        assert keys[1:] == [keys[1]] * (len(keys) - 1), (rank, keys)
        # None: this torch's store cannot list its keys; the flat count above still holds.
        assert report["residue"]["leftover_keys"] in ([], None), report["residue"]["leftover_keys"]
    keys = healed["reports"][0]["residue"]["keys"]
    _figure("store keys over 20 cycles (8 ranks)", first=keys[0], last=keys[-1])


def test_kept_handles_hold_nothing_after_close_and_fail_at_once(healed: dict[str, Any]) -> None:
    """A tp handle kept past its scope holds no fd or thread; using it raises at once.

    torch's gloo backend has no shutdown, so before closable groups each kept
    2-rank handle held 5 fds and 3 threads and a collective on it still summed.
    """
    for rank, report in _reports(healed).items():
        fds = report["fds"]
        assert (fds["dropped"], fds["threads_dropped"]) == (0, 0), (rank, fds)
        if not fds["closable"]:  # a torch without the stand-in backend: groups are torch's own
            assert fds["kept"] > 0 and fds["all_reduce_after_close"] == {"sum": 2}, fds
            continue
        assert (fds["kept"], fds["threads_kept"]) == (0, 0), (rank, fds)
        torch_call = fds["all_reduce_after_close"]  # torch 2.13's dist.all_reduce checks first
        assert torch_call["type"] in ("ValueError", "MeshClosedError"), (rank, torch_call)
        assert "shut down when its mesh closed" in torch_call["message"], torch_call
        method = fds["allreduce_method_after_close"]  # the group itself, as C++ callers reach it
        assert method["type"] == "MeshClosedError", (rank, method)
        assert "kept past its mesh's scope" in method["message"], method
        # A never-hang bound, not a speed claim: the groups' timeout is 60 s, failing takes µs.
        assert max(torch_call["seconds"], method["seconds"]) < 10.0


def test_survivors_heal_and_match_reference(healed: dict[str, Any]) -> None:
    reports = _reports(healed)
    assert healed["exitcodes"][VICTIM] == 17
    died = reports[VICTIM]["died_at"]
    expected = workers.reference(STEPS, lambda step: 4 if step < DEATH_STEP else 3)
    survivors = [r for r in range(WORLD) if r not in (VICTIM, VICTIM - 1)]
    latency = []
    for rank in range(WORLD):
        if rank == VICTIM:
            continue
        report = reports[rank]
        assert report["error"]["step"] == DEATH_STEP, report["error"]  # noticed, not hung
        assert report["error_at"] - died < BOUND
        assert report["old_mesh_closed"] is True
        if rank == VICTIM - 1:  # shared the dropped dp slice: sits out, told why
            assert report["lost"] == [VICTIM] and "healed_shape" not in report
            assert "shares a dropped slice" in report["sat_out"]
            continue
        assert report["lost"] == [VICTIM]
        assert report["healed_shape"] == [3, 2]
        assert report["live_after"] == 1  # only WORLD: the healed mesh's groups are gone too
        steps = [s for s, _ in report["losses"]]
        assert steps == list(range(STEPS)), steps
        for step, loss in report["losses"]:
            assert math.isclose(loss, expected[step], rel_tol=1e-9), (rank, step, loss)
        latency.append(report["first_healed_step_at"] - died)
    assert len(latency) == len(survivors)
    _figure(
        "ranks lost and healed (8 ranks, 4x2 dp x tp, rank 5 killed at step 4)",
        lost=1,
        sat_out=1,
        healed=len(survivors),
        losses_before=[round(x, 5) for x in expected[:DEATH_STEP]],
        losses_after=[round(x, 5) for x in expected[DEATH_STEP:]],
        death_to_error_s=round(max(reports[r]["error_at"] - died for r in survivors), 2),
        death_to_first_healed_step_s=round(max(latency), 2),
        store_keys=healed["store_keys"],
    )


@pytest.mark.slow
def test_residue_and_kept_handles_long(tmp_path: Path) -> None:
    """1,000 cycles in a 4-rank 2 x 2 world: store keys and store-host RSS; fds and threads
    over 1,000 scopes with every handle dropped, then 1,000 with every handle kept."""
    from scopedmesh.c10d import closable as _closable

    if not _closable.supported():  # 1,000 kept handles of torch's own gloo: > 1,024 fds
        pytest.skip("this torch has no stand-in backend: its gloo groups are not closable")
    result = workers.launch(
        workers.heal_world, 4, str(tmp_path), ((2, 2), -1, 0, 0, 1000, 1000, 1000), timeout=3600
    )
    reports = _reports_n(result, 4)
    keys = reports[0]["residue"]["keys"]
    for report in reports.values():
        assert report["residue"]["keys"][1:] == [keys[1]] * (len(keys) - 1)
        assert report["fds"]["dropped"] == report["fds"]["kept"] == 0
        assert report["fds"]["threads_dropped"] == report["fds"]["threads_kept"] == 0
    (rss0, rss1) = result["store_rss_kib"]
    _figure(
        "residue 1000 cycles (4 ranks)",
        keys_first=keys[0],
        keys_last=keys[-1],
        keys_per_cycle=(keys[-1] - keys[1]) / (len(keys) - 2),
        store_host_rss_growth_kib=rss1 - rss0,
        store_host_bytes_per_cycle=round((rss1 - rss0) * 1024 / 1000),
        fds_kept={r: rep["fds"]["kept"] for r, rep in reports.items()},
        fds_dropped={r: rep["fds"]["dropped"] for r, rep in reports.items()},
        threads_kept={r: rep["fds"]["threads_kept"] for r, rep in reports.items()},
    )


def _reports_n(result: dict[str, Any], world: int) -> dict[int, dict[str, Any]]:
    reports = result["reports"]
    assert set(reports) == set(range(world)), result["exitcodes"]
    for rank, report in reports.items():
        assert "unexpected" not in report, f"rank {rank}:\n{report['unexpected']}"
    return reports  # type: ignore[no-any-return]


def test_bad_input_is_rejected_before_any_store_request() -> None:
    from scopedmesh.fault.heal import agree_on_lost, reform

    with pytest.raises(ValueError, match=r"rank must be one of ranks \[0, 1, 2, 3\], got 9"):
        agree_on_lost(range(4), 9, tag="t", timeout=1)
    with pytest.raises(ValueError, match="timeout must be positive, got 0"):
        agree_on_lost(range(4), 0, tag="t", timeout=0)
    with pytest.raises(TypeError, match="ranks must hold int ranks, got True"):
        agree_on_lost([0, True], 0, tag="t", timeout=1)
    with pytest.raises(ValueError, match=r"ranks must be ranks of WORLD \(>= 0\), got -1"):
        agree_on_lost([0, -1], 0, tag="t", timeout=1)
    # The tag becomes part of store keys: bounded and printable before anything is sent.
    for tag in ("a/b", "", "x" * 201, "bad\x00tag", "\udcff"):
        with pytest.raises(ValueError, match="tag must be 1 to 200 printable characters"):
            agree_on_lost(range(4), 0, tag=tag, timeout=1)
    with pytest.raises(TypeError, match="tag must be a str, got b't'"):
        agree_on_lost(range(4), 0, tag=b"t", timeout=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mesh must be a ProcessGroupMesh, got 3"):
        reform(3, [1], "dp")  # type: ignore[arg-type]
