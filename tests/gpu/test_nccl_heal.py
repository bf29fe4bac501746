"""Healing on NCCL (issue 33): kills from the launcher, the watchdog, memory, kept handles.

Every test is bounded by its world's timeout. The kills and the timings come
from ``benchmarks/heal_nccl.py`` (its ``launch`` SIGKILLs a random rank at a
random moment from the launcher's process); sums, counts and bytes are
asserted, never a time. Skipped without a GPU (tests/gpu/conftest.py).
"""

from __future__ import annotations

import random

import gpu_workers as workers
import pytest

from benchmarks import heal_nccl
from scopedmesh.testing import run_world

KILLS = 4
TIMEOUT = workers.TIMEOUT
MiB = 1 << 20


def _plan(**extra: object) -> dict[str, object]:
    plan = {"world": heal_nccl.world_size(), "steps": 40, "warm": 5, "window": 0.05}
    plan.update(extra)
    return plan


@pytest.mark.parametrize("bound", [False, True], ids=["gloo_world", "world_bound_device_id"])
def test_sigkill_at_random_moments_survivors_heal_and_train_on(bound: bool) -> None:
    """The launcher SIGKILLs a random rank at a random moment, KILLS times (a fresh world
    each). Every survivor's watch aborts its NCCL communicators, it agrees on the victim,
    re-forms (with WORLD bound: by its own init, not split from WORLD's communicator) and
    trains on; every step's sum is its members' (heal_nccl.check)."""
    rng = random.Random(33 + bound)
    for _ in range(KILLS):
        kill = heal_nccl.launch(_plan(bound=bound), rng, timeout=120)
        heal_nccl.check(kill)
        survivors = [r for r in kill["reports"] if r != kill["victim"]]
        assert len(survivors) == heal_nccl.world_size() - 1, kill["reports"].keys()
        print("phases (s):", [round(t, 3) for t in heal_nccl.phases(kill)])


def test_standby_groups_formed_before_the_kill_serve_the_heal() -> None:
    """Issue 45 item 3: each rank forms the survivors' dp groups before the kill
    (``prepare_standby``, warmed by a one-element all_reduce). The launcher SIGKILLs a
    random rank, KILLS times; every survivor takes its healed group from the standby
    (heal_nccl.check counts it), trains on with the right sums, and the standby
    communicators' device memory is counted (bytes per communicator, printed)."""
    rng = random.Random(45)
    for _ in range(KILLS):
        kill = heal_nccl.launch(_plan(standby=True), rng, timeout=120)
        heal_nccl.check(kill)
        for rank, report in kill["reports"].items():
            assert report["standby"]["formed"] == heal_nccl.world_size() - 1, (rank, report)
            assert report["standby"]["bytes_per_group"] is not None, (rank, report)
        per_group = [r["standby"]["bytes_per_group"] for r in kill["reports"].values()]
        print(
            "phases (s):",
            [round(t, 3) for t in heal_nccl.phases(kill)],
            "standby MiB per communicator:",
            [round(b / MiB, 1) for b in per_group],
        )


@pytest.mark.slow
def test_a_healed_survivor_outlives_torchs_watchdog() -> None:
    """torch's watchdog ends a process about 60 s after it saw an NCCL error, unless
    TORCH_NCCL_ASYNC_ERROR_HANDLING is 0 or 2 (the launcher sets 2). A healed survivor
    trains on for 75 s after the death, and reports."""
    kill = heal_nccl.launch(_plan(seconds=75.0), random.Random(60), timeout=240)
    heal_nccl.check(kill)
    for rank, report in kill["reports"].items():
        if rank != kill["victim"]:
            assert report["healed_for"] >= 75.0, report["healed_for"]


def test_twelve_scoped_blocks_leave_no_communicator_and_kept_groups_grow() -> None:
    """12 blocks, each a scoped NCCL group and a 4 MiB all_reduce: no group left and GPU
    memory flat. The same 12 groups kept (new_group): 12 groups and at least 4 MiB each
    (about 35 MiB per group of two ranks measured on an H100: 426 MB for 12). The baseline
    follows one scoped block, NCCL's one-time load (gpu_workers.memory_world)."""
    n = heal_nccl.world_size()
    for out in run_world(workers.memory_world, n, args=(12,), timeout=180):
        assert out["scoped_groups"] == 0, out
        assert out["kept_groups"] == 12, out
        grown = out["kept_bytes"] - out["scoped_bytes"]
        assert grown >= 12 * 4 * MiB, out
        assert out["scoped_bytes"] < grown / 4, out  # flat: under three communicators' worth
        print(
            "GPU bytes after each scoped block:",
            out["scoped_after_each"],
            "kept:",
            out["kept_bytes"],
        )


def test_a_step_whose_kept_handle_an_abort_cut_short_fails_on_every_rank() -> None:
    """Rank 0 keeps the handle of an all_reduce rank 1 never joins: rank 1's step raises,
    its stop aborts rank 0's communicator. Whatever the kept handle answers (NCCL's
    cut-short kernel looks done), the step fails on both ranks, the mesh re-forms with
    nobody lost, and rank 1's exception is raised after both know."""
    results = run_world(workers.kept_handle_world, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["committed"] is False and out["healed"] is True, (rank, out)
        assert out["lost"] == [] and out["shape"] == [2], (rank, out)
    assert results[1]["raised"] == "rank 1's step failed before its all_reduce", results[1]
    assert "raised" not in results[0], results[0]
    assert results[0]["seconds"] < TIMEOUT / 2, results[0]  # the stop, not a timeout
    print("kept handle:", results[0])
