"""A mesh aborted by its liveness watch: nothing it made reports a failed collective as done.

4-rank gloo worlds over a guarded 2 x 2 (dp, tp) mesh. Rank 3 is SIGKILLed by
this process (from outside, at a random moment after rank 1 has started its
collectives). Every group's timeout is 60 s.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scopedmesh.c10d import closable  # noqa: E402

needs_interrupt = pytest.mark.skipif(
    not closable.supported(),
    reason="this torch cannot make closable gloo groups: a collective in flight is not aborted",
)


def _kill_when(folder: Path, signal_file: str, seed: int) -> threading.Thread:
    """A thread of this process that SIGKILLs rank 3 (its pid in ``folder/pid.3``) once
    ``folder/signal_file`` exists, after a random delay of up to 50 ms."""

    def kill() -> None:
        deadline = time.monotonic() + 120.0
        while not (folder / "pid.3").exists() or not (folder / signal_file).exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        time.sleep(random.Random(seed).uniform(0.0, 0.05))
        os.kill(int((folder / "pid.3").read_text()), signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _run(worker: Any, folder: Path, signal_file: str, seed: int) -> list[Any]:
    from scopedmesh.testing import run_world

    killer = _kill_when(folder, signal_file, seed)
    results = run_world(worker, 4, args=(str(folder),), allow_exit=[3], timeout=240)
    killer.join(timeout=5)
    assert results[3] is None  # the victim reported nothing: it was killed
    return results


@needs_interrupt
@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_kept_handle_of_a_collective_the_abort_cut_short_never_reports_success(
    tmp_path: Path,
) -> None:
    """Issue 32, item 1. Rank 1's collectives on groups with rank 3 (the mesh's own,
    a sub-mesh's, a view's, and torch's functional all_reduce through the DeviceMesh)
    are in flight when rank 3 is killed. Once the watch knows and the groups have
    settled, each handle's ``wait()`` raises ``MeshClosedError`` naming the death,
    ``is_success()`` is False and its future holds the error. A handle whose
    collective completed before the abort still reports success, with its result."""
    import _workers_abort

    results = _run(_workers_abort.kept_handles, tmp_path, "started", seed=32)
    for rank in (0, 1, 2):
        assert results[rank]["lost"] == [3], results[rank]
    reports = results[1]["reports"]
    for name in ("dp all_reduce", "dp all_gather", "sub-mesh", "view"):
        report = reports[name]
        assert report["wait"].startswith("MeshClosedError"), (name, report)
        assert "rank(s) [3] died" in report["wait"], (name, report)
        assert report["is_success"] == "returned False", (name, report)
        assert report["is_completed"] == "returned True", (name, report)
        assert report["future"].startswith("MeshClosedError"), (name, report)
    # the functional collective's work is one of our handles too: its wait raises
    assert "rank(s) [3] died" in results[1]["torch"], results[1]["torch"]
    kept = reports["completed before"]
    assert kept["wait"] == "returned True", kept
    assert kept["is_success"] == "returned True", kept
    assert kept["future"] == "returned [[2.0, 2.0]]" and kept["buffer"] == [2.0, 2.0], kept


# Under load it once saw rank 1's cut-short all_reduce report done: the watch's settle
# dropped gloo's work before recording how it ended, and rank 1 polled in between
# (Handle.let_go; pinned by tests/unit/test_closable.py's
# test_a_handle_read_while_its_group_settles_never_reports_the_cut_collective_done).
@needs_interrupt
@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_groups_torch_made_and_a_backend_handed_out_are_shut_down_by_the_abort(
    tmp_path: Path,
) -> None:
    """Issue 32, item 9. Groups torch made for a scoped DeviceMesh's ``_flatten`` and
    ``_unflatten`` before the abort are closable and shut down with the mesh's own: a
    collective blocked on one raises once the abort closes the peer's side, and later
    ones raise ``MeshClosedError``. A gloo backend from ``_get_backend`` taken before
    the abort is refused after it (it used to go on communicating)."""
    import _workers_abort

    results = _run(_workers_abort.torch_made_groups, tmp_path, "started", seed=9)
    for rank in (0, 1, 2):
        out = results[rank]
        assert out["lost"] == [3], out
        assert out["before"] == 8.0 and out["flat_type"] == "ClosableGroup", out
    blocked = results[1]["blocked"]
    assert "rank(s) [3] died" in blocked or "Connection closed" in blocked, blocked
    for rank in (0, 1):
        for what in ("unflatten later", "backend later"):
            answer = results[rank][what]
            assert answer.startswith("MeshClosedError"), (rank, what, answer)
            assert "rank(s) [3] died" in answer, (rank, what, answer)
    answer = results[2]["flatten later"]
    assert answer.startswith("MeshClosedError") and "rank(s) [3] died" in answer, answer


@needs_interrupt
def test_torch_made_groups_are_closable_and_a_handed_out_backend_closes_with_its_mesh() -> None:
    """Pins what item 9's fix relies on, in the default lane: torch makes a scoped
    DeviceMesh's ``_flatten``/``_unflatten`` groups on the closable backend we pass as
    ``backend_override``; the backend ``_get_backend`` hands out works while its group
    is open (its works are handles), is refused once the mesh has closed, and a
    collective that completed before still reports success."""
    import _workers_abort

    from scopedmesh.testing import run_world

    for out in run_world(_workers_abort.closable_flatten_and_backend, 2, timeout=120):
        assert out["types"] == ["ClosableGroup", "ClosableGroup"], out
        assert out["work"] == "Handle" and out["total"] == 8.0, out
        assert out["timeout"] > 0, out
        assert out["no cuda"].startswith("RuntimeError"), out  # torch's, for a missing device
        assert out["backend after"].startswith("MeshClosedError"), out
        assert out["flat after"].startswith(("MeshClosedError", "ValueError")), out
        assert out["work after"] == ["returned True", "returned True"], out


@needs_interrupt
def test_a_collective_cut_short_by_an_interrupt_never_reports_success() -> None:
    """Item 1's mechanism in the default lane: a handle whose collective was in flight
    when its group was interrupted, and failed, reports that failure for good once the
    group has settled (it used to say True); its future, taken while in flight, holds
    gloo's error; a handle of a collective that completed before still reports success."""
    import _workers_abort

    from scopedmesh.testing import run_world

    out = run_world(_workers_abort.interrupted_in_flight, 2, timeout=120)[1]
    assert out["held"], out  # busy when interrupted: held until it ended
    cut = out["cut"]
    assert cut["wait"].startswith("MeshClosedError"), out
    assert "when the test interrupted it" in cut["wait"], out
    # the future, taken while in flight, failed before the group let go of the work:
    # it holds gloo's error, as torch's future would
    assert cut["future"] == out["cut future taken before"], out
    assert out["cut future taken before"].startswith("RuntimeError"), out
    assert "[from " in cut["wait"], out  # chained to gloo's error
    assert cut["is_success"] == "returned False", out
    kept = out["kept"]
    assert kept["wait"] == kept["is_success"] == "returned True", out
    assert kept["future"] == "returned [[2.0]]", out


@needs_interrupt
def test_closing_an_aborted_mesh_never_waits_for_a_collective_in_flight() -> None:
    """Closing an aborted mesh whose gloo group has a collective in flight returns without
    waiting for it (gloo's destructor would: a heal's re-form waited so for the vote a
    death left behind); the group goes, sockets and all, once the collective ends."""
    import _workers_abort

    from scopedmesh.testing import run_world

    peer, closer = run_world(_workers_abort.closed_with_a_collective_in_flight, 2, timeout=120)
    assert peer["joined"] == "returned None", peer  # completed: rank 1's gloo was still in it
    assert closer["cut"].startswith("MeshClosedError"), closer  # its handle: shut down
    assert "shut down when the test aborted it" in closer["later"], closer  # torch: not live


@needs_interrupt
def test_point_to_point_through_c10d_on_an_aborted_or_closed_group_fails() -> None:
    """Issue 37, item 1: ``torch.ops.c10d.recv_`` on a shut-down mesh group returned at
    once, its work done and its buffer untouched (the stand-in backend's ``send``,
    ``recv`` and ``recvAnysource`` do nothing). Aborted or closed, each must fail."""
    import _workers_abort

    from scopedmesh.testing import run_world

    results = run_world(_workers_abort.point_to_point_through_c10d, 2, timeout=120)
    print(results)
    assert results[1]["received"] == 0.0, results  # the group worked through dist.recv
    for out in results:
        for state in ("aborted", "closed"):
            for op, said in out[state].items():
                assert said.startswith("raised"), (state, op, said)


@needs_interrupt
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="found through /proc (Linux)")
def test_an_interrupt_shuts_an_idle_groups_connections_at_once() -> None:
    """Issue 45: an abort shuts an idle gloo group's sockets itself, so its peers learn at
    once, not when gloo's destructor gets to each pair (a tick of its event loop each). Rank
    0 keeps gloo's group alive past the interrupt: only the shut can end its peers'
    all_reduces. Before the change they waited for the group's 60 s timeout."""
    import _workers_abort

    from scopedmesh.testing import run_world

    results = run_world(_workers_abort.shut_while_the_group_lives, 4, timeout=120)
    shutter, peers = results[0], results[1:]
    assert shutter["connections"] == 3, shutter  # one per peer: not the listener, not gloo's pipe
    assert shutter["idle"] is True, shutter
    assert shutter["peers failed while gloo's group lived"] is True, results
    for out in peers:
        assert out["wait"].startswith(("RuntimeError", "MeshClosedError")), results


@needs_interrupt
def test_gloo_destructors_run_together_and_a_heal_hands_them_to_the_healed_mesh() -> None:
    """Issue 45: gloo's destructor of an idle group waits for its event loop's 10 ms tick.
    A close starts every group's destructor before it waits for one (not one tick per group
    in turn), and a heal's re-form does not wait for them at all: the healed mesh inherits
    them, and its own close waits for them, so closed still means destroyed. A re-form
    whose new mesh cannot be made waits for them before it raises."""
    import _workers_abort

    from scopedmesh.testing import run_world

    results = run_world(_workers_abort.gloo_destructors_on_threads, 4, timeout=180)
    for out in results:
        assert out["close started all 3 before any ended"] is True, results
        assert out["close waited"] is True, results
        assert out["closed"] is True, results
        assert out["re-form returned, destructors running"] == 3, results
        assert out["inherited"] == 3, results
        assert out["healed close waited"] is True, results
        assert out["all ended"] is True, results
        assert out["failed re-form waited"] is True, results  # nobody took them over
        assert out["failed re-form raised"] == ["no new mesh (the test)"], results
        assert out["failed re-form left none"] is True, results
