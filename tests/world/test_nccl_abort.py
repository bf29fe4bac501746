"""NCCL's side of healing, dry-run on the CPU (issue 33): no GPU needed.

A registered Python backend stands in for NCCL (tests/world/_nccl_double.py):
it records every ``abort()`` and NCCL group call, and its collectives stay in
flight until their group is aborted. What runs is the library's own code: the
group table's abort from a liveness watch's thread, and the construction path
of a healed mesh. The GPU suite (tests/gpu, ``bash .ci/gpu``) runs the same
paths on NCCL.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import _workers_nccl as workers

from benchmarks import heal_nccl, nccl_reform
from scopedmesh.testing import run_world


def test_the_watch_aborts_every_non_gloo_group_of_the_mesh_in_one_nccl_group_call() -> None:
    """Rank 3 of a guarded 2 x 2 mesh is SIGKILLed by rank 0. On each survivor a thread the
    watch's abort started (GroupTable.abort) aborts every group the mesh holds that is
    not gloo (its own, a view's, a sub-mesh's, the group torch flattened for its
    DeviceMesh), all between one _group_start and _group_end, and interrupts its gloo group. No handle kept from before
    the abort reports success."""
    results = run_world(workers.aborted_from_the_watch, 4, allow_exit=[workers.VICTIM], timeout=240)
    assert results[workers.VICTIM] is None
    for rank in (0, 1, 2):
        out = results[rank]
        assert out["lost"] == [workers.VICTIM], out
        assert out["aborted"] == out["held"], out  # every group, each once
        assert len(out["held"]) == 5, out  # tp, dp, the view's, the sub-mesh's, the flattened
        n = len(out["held"])
        assert out["events"] == ["group_start"] + ["abort"] * n + ["group_end"], out
        assert out["abort_threads"] == ["scopedmesh-nccl-abort"], out  # off the watch's thread
        assert out["gloo_released"] is True, out
        for what, (completed, success, waited) in out["kept"].items():
            assert completed is True and success is False, (rank, what)
            assert waited.startswith("raised"), (rank, what, waited)


def test_a_healed_meshs_groups_never_split_from_a_bound_world() -> None:
    """With WORLD bound to a device, torch's helper splits a new NCCL group from WORLD's
    communicator, which holds the lost rank. A mesh's groups keep that fast path; a healed
    mesh's (its sub-meshes' too) reach the helper with WORLD unbound, still bound to the
    device themselves (an NCCL group then connects by its own init over the store)."""
    for out in run_world(workers.formation_arguments, 2, timeout=240):
        assert out["before"] == [["cuda:0", "cuda:0"]], out
        assert out["after"] == [[None, "cuda:0"], [None, "cuda:0"]], out
        assert out["bound_after"] == "cuda:0", out


@pytest.mark.fault  # a world of 4 twice: about 20 s on 2 cores
@pytest.mark.parametrize("group_call", [True, False], ids=["nccl", "nccl2"])
def test_a_heal_takes_the_standby_group_and_forms_no_communicator(group_call: bool) -> None:
    """Issue 45 item 3, on the double. A guarded mesh of 4 along dp; every rank prepares the
    standby groups for the loss of any one rank (``prepare_standby``: 3 groups of 3 on each
    rank, one communicator init each). Rank 3 is SIGKILLed: the watch aborts the mesh's
    group but none of the standby ones, and the survivors' heal takes their group from
    the standby: no communicator is made between the death and the healed dp group. Then,
    off the critical path, the healed mesh prepares its own standby: the groups left (each
    holds rank 3) are released, and the new ones go when the healed mesh closes. ``nccl2``: the double
    without NCCL's group call, as torch 2.14+'s ``nccl2``: the same, aborted group by group."""
    results = run_world(
        workers.healed_from_standby, 4, args=(group_call,), allow_exit=[workers.VICTIM], timeout=240
    )
    assert results[workers.VICTIM] is None
    for rank in (0, 1, 2):
        out = results[rank]
        assert out["prepared"] == {"made": 1 + 3, "groups": 3, "formed": 3}, out  # dp + standby
        assert out["made_in_heal"] == 0, out
        assert out["is_standby"] is True and out["healed_ranks"] == [0, 1, 2], out
        assert (out["taken"], out["left"], out["left_after_close"]) == (1, 2, 0), out
        assert out["standby_aborted"] == [], out  # the abort left the standby groups alone
        assert out["group_calls"] == (1 if group_call else 0), out
        # prepared again on the healed mesh: 2 groups of 2, the 2 left from before released
        assert out["again"] == [2, 2, 2, 0] and out["released"] is True, out


@pytest.mark.fault  # a world of 4: about 10 s on 2 cores
def test_a_heal_never_waits_for_an_nccl_abort_and_never_destroys_during_one() -> None:
    """Issue 45 item 3. On an H200 ``ProcessGroup.abort()`` took 0.51-0.53 s per communicator
    (the whole of the NCCL heal) while the kernels in flight exited within 6 ms. Here every
    abort of the double tears down until the survivors' heal has returned: the heal must
    not wait for it, and the old group is destroyed only after its abort ended, by the
    time the healed mesh's close returns."""
    results = run_world(
        workers.heal_during_a_slow_abort, 4, allow_exit=[workers.VICTIM], timeout=240
    )
    assert results[workers.VICTIM] is None
    for rank in (0, 1, 2):
        out = results[rank]
        assert out["healed"] == [0, 1, 2], out
        assert out["during_heal"] == ["abort"], out  # neither finished nor destroyed yet
        assert out["after_close"] == ["abort", "abort_done", "shutdown"], out
        assert out["old_left"] is False, out


@pytest.mark.fault
def test_the_nccl_heal_benchmark_dry_run_on_gloo_heals_with_the_right_sums() -> None:
    """benchmarks/heal_nccl.py's rank code and launcher on the CPU (gloo): the launcher
    SIGKILLs a random rank of 2 at a random moment; the survivor heals, trains on, and
    every step sums its members (heal_nccl.check). Its NCCL parts run on a GPU host only.
    The second kill's world forms its standby groups first: its survivor takes its healed
    group from them (heal_nccl.check counts it)."""
    rng = random.Random(33)
    plan = {"world": 2, "backend": "gloo", "steps": 40, "warm": 5, "window": 0.05}
    for standby in (False, True):
        kill = heal_nccl.launch({**plan, "standby": standby}, rng, timeout=240)
        heal_nccl.check(kill)
        assert len(heal_nccl.phases(kill)) == len(heal_nccl.PHASES)


@pytest.mark.fault  # two worlds of 2 ranks: about 10 s on 2 cores
def test_the_reform_paths_benchmark_dry_run_takes_the_standby_group() -> None:
    """benchmarks/nccl_reform.py on the CPU (gloo): the survivor of a 2-rank mesh re-forms
    it without the last rank, by a fresh group (none taken) and from the standby (its one
    group taken); each world gives a time. Its NCCL paths run on a GPU host only."""
    fresh = nccl_reform.one_world("fresh", 2, "gloo")
    ready = nccl_reform.one_world("standby", 2, "gloo")
    assert "problem" not in fresh and "problem" not in ready, (fresh, ready)
    assert (fresh["taken"], ready["taken"]) == ([0], [1]), (fresh, ready)
    assert fresh["seconds"] > 0 and ready["seconds"] > 0
