"""One verdict per step (``LivenessWatch.step``): a step counts on every member or on none.

Worlds of 4 gloo ranks whose store lives here; the NCCL double (tests/world/_nccl_double.py)
stands in for a communicator whose cut-short collectives look done. Every group's timeout is
60 s and every world's 120 s or less: a member that waited for a timeout fails the test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workers_step as workers

from scopedmesh import LivenessWatch, ProcessGroupMesh
from scopedmesh.fault.liveness.deaths import CLOSED
from scopedmesh.testing import run_world


@pytest.fixture
def one_rank() -> Any:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_steps_commit_on_every_member_in_blocks_in_a_row() -> None:
    for out in run_world(workers.every_step_commits, 4, args=(2,), timeout=120):
        assert out["verdicts"] == [True] * 6, out
        assert out["committed"] == 6, out
        assert out["lines"] == ["m4.0-3"], out  # blocks one after another: one line


def test_an_exception_in_one_ranks_step_fails_the_step_everywhere_without_a_timeout() -> None:
    """Rank 1 raises ValueError in step 2 after its tp all_reduce, while its dp peer (rank
    3) waits for it in the dp all_reduce. Every rank's step 2 fails (none counts it), the
    mesh re-forms with nobody lost, rank 1 gets its ValueError after the others know, and
    every rank redoes step 2 and ends with the same weights as a run without the error."""
    results = run_world(workers.a_step_raises, 4, args=(1, 2), timeout=120)
    expected = [float(sum(4 * (s + 1) for s in range(workers.STEPS)))] * 2  # tp, then dp sums
    for rank, out in enumerate(results):
        failed = [v for v in out["verdicts"] if v[1] is False]
        healed = [v for v in out["verdicts"] if v[2]]
        if failed or rank not in (2, 3):
            assert failed == healed == [[2, False, True, [2, 2]]], (rank, out["verdicts"])
        else:
            # Ranks 2 and 3 share no collective of step 2 with rank 1 before it raises: one
            # may still be reading step 1's vote when rank 1's stop aborts its mesh. Its vote
            # cut short, it asks, commits step 1 (the others did) and heals in the same
            # agreement as the others' failed step 2 (seen under a CPU burner, 2 runs in 40).
            assert healed == [[1, True, True, [2, 2]]], (rank, out["verdicts"])
        assert out["committed"] == workers.STEPS, out
        assert out["w"] == expected, (rank, out["w"])
        assert out["seconds"] < 50, out  # far below the groups' 60 s: nobody timed out
        if rank == 1:
            assert out["raised"] == [2, "a bug in this rank's step", False, True], out
        else:
            assert out["raised"] is None, out


def test_a_runtime_error_of_a_ranks_own_is_raised_on_the_second_attempt() -> None:
    """A RuntimeError is what a collective raises when a peer fails: the first time rank 1's
    step raises one, it is the step's failure everywhere, not raised. Raised again by the
    same rank in the redo, first and with nobody lost, it is a bug of its own: raised there."""
    results = run_world(workers.a_step_raises, 4, args=(1, 2, "RuntimeError"), timeout=120)
    for rank, out in enumerate(results):
        failed = [v for v in out["verdicts"] if v[1] is False]
        healed = [v for v in out["verdicts"] if v[2]]
        if rank in (2, 3) and healed[0] == [1, True, True, [2, 2]]:  # step 1's vote cut short
            assert failed == healed[1:] == [[2, False, True, [2, 2]]], (rank, out["verdicts"])
        else:
            assert failed == healed == [[2, False, True, [2, 2]]] * 2, (rank, out["verdicts"])
        assert out["committed"] == workers.STEPS, out
        assert out["raised"] == (
            [2, "a bug in this rank's step", False, True] if rank == 1 else None
        )


@pytest.mark.parametrize("looks_done", [True, False], ids=["looks-done", "raises"])
def test_a_collective_cut_short_by_the_abort_never_counts(looks_done: bool) -> None:
    """On the NCCL double whose aborted collectives look done (``wait()`` True,
    ``is_success()`` True, the buffer untouched), as an NCCL kernel an abort ends early:
    a step whose kept handle was cut short by rank 3's SIGKILL is failed on every
    survivor, and the mesh re-forms without rank 3's dp slice (rank 2 sits out)."""
    results = run_world(
        workers.killed_in_a_step, 4, args=(looks_done,), allow_exit=[3], timeout=120
    )
    assert results[3] is None
    for rank in (0, 1, 2):
        out = results[rank]
        if looks_done:  # the double lies as NCCL does: only the verdict tells
            assert out["waited"] is True and out["success"] is True, out
            assert out["buffer"] == [1.0], out
        assert out["committed"] is False, out
        assert out["lost"] == [3], out
        assert out["sat_out"] is (rank == 2), out
        if rank != 2:
            assert out["healed"] is True and out["shape"] == [1, 2], out


@pytest.mark.usefixtures("one_rank")
def test_a_death_learned_while_a_mesh_is_being_guarded_aborts_it() -> None:
    """The death is learned after ``guard`` began and before the mesh is registered (here,
    inside the guard's one-time check): the mesh is aborted all the same."""
    with LivenessWatch(interval=0.02, timeout=10) as watch:
        learn = watch._guard._warn_if_not_closable

        def learn_a_death_meanwhile() -> None:
            learn()
            watch._record.learn({0: CLOSED})

        watch._guard._warn_if_not_closable = learn_a_death_meanwhile  # type: ignore[method-assign]
        with watch.guard(ProcessGroupMesh(1, names=("dp",))) as mesh:
            assert watch._record.lost == frozenset({0})
            assert mesh.aborted, "a death learned while guarding went unseen"


@pytest.mark.usefixtures("one_rank")
def test_an_agreement_tag_is_never_reused() -> None:
    with LivenessWatch(interval=0.02, timeout=10) as watch:
        assert watch.agree(tag="step3") == frozenset()
        with pytest.raises(ValueError, match="tag 'step3' was used by an earlier agreement"):
            watch.agree(tag="step3")
        assert watch.agree() == frozenset()  # the watch's own count gives a new tag


@pytest.mark.usefixtures("one_rank")
def test_a_survived_thread_failure_is_raised_after_the_agreement_not_in_it() -> None:
    """The watch's thread reports a failure it survives just after this rank checked in:
    the agreement completes, and the next query raises the failure."""
    from scopedmesh.fault.protocol import agreement

    with LivenessWatch(interval=0.02, timeout=10) as watch:
        check_in = agreement.check_in

        def check_in_then_fail(*args: Any) -> Any:
            count = yield from check_in(*args)
            watch._report("failed while watching (it goes on)", OSError("injected"))
            return count

        agreement.check_in = check_in_then_fail  # type: ignore[assignment]
        try:
            assert watch.agree(tag="t") == frozenset()
        finally:
            agreement.check_in = check_in  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="injected"):
            watch.lost()


def test_a_rank_that_committed_in_doubt_heals_by_hand_with_its_peers() -> None:
    """``watch.heal`` after the loop's own collective failed, on the rank whose step 2 was
    committed in doubt: it takes the agreement held then, as its peers read it."""
    results = run_world(workers.doubt_on_one_rank, 4, args=(2, True), timeout=120)
    for rank, out in enumerate(results):
        assert out["committed"] == workers.STEPS, (rank, out)
        assert out["w"] == results[0]["w"], (rank, out["w"], results[0]["w"])
    doubter = results[1]
    assert [2, True, False] in doubter["verdicts"], doubter
    # Its own collective failed on the mesh it kept: healed by hand once, after step 2, in
    # the shape its peers' heal made (nobody lost), never after the agreement's 30 s timeout.
    assert [[s, shape] for s, shape, _ in doubter["healed"]] == [[3, [2, 2]]], doubter
    assert doubter["healed"][0][2] < 10.0, doubter


@pytest.mark.parametrize("at", [2, workers.STEPS - 1], ids=["a-middle-step", "the-last-step"])
def test_a_rank_in_doubt_commits_the_step_its_peers_committed(at: int) -> None:
    results = run_world(workers.doubt_on_one_rank, 4, args=(at,), timeout=120)
    assert results[1]["vote"] == 0, results[1]  # every flag was 0: the peers committed
    # Committed in doubt: the mesh is kept, as the peers keep theirs, and every member
    # re-forms it after the next step, which fails (so meshes re-form at one step
    # everywhere, and under one watch request their groups in one order).
    assert [at, True, False] in results[1]["verdicts"], results[1]
    if at < workers.STEPS - 1:
        for rank, out in enumerate(results):
            assert [at + 1, False, True] in out["verdicts"], (rank, out["verdicts"])
    for rank, out in enumerate(results):
        assert out["committed"] == workers.STEPS, (rank, out)
        assert out["w"] == results[0]["w"], (rank, out["w"], results[0]["w"])
        assert [v[0] for v in out["verdicts"] if v[1]] == list(range(workers.STEPS)), out
