"""The closable gloo group, on one process: forwarding, release, the stand-in backend.

A one-member gloo group needs no peer, so these run without a world; the
kept-handle figures in a real world are in ``tests/world/test_heal.py``.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from scopedmesh import MeshClosedError
from scopedmesh.c10d import closable as _closable

RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _one_member_group() -> _closable.ClosableGroup:
    store = dist.HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    inner = dist.ProcessGroup(store, 0, 1)
    inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group = _closable.ClosableGroup(inner)
    group.setGroupName("g-1")
    return group


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_torch_gloo_shutdown_and_abort_leave_a_kept_group_working() -> None:
    """The hazard, through public torch: shutting a gloo group down closes nothing.

    ``destroy_process_group(group)`` calls ``shutdown()``; on every release
    claimed (2.9 to 2.15) gloo's ``shutdown`` and ``abort`` do nothing, so a kept
    handle keeps its sockets and still communicates. When a release implements
    them, this fails, and the closable wrapper may no longer be needed there.
    """
    store = dist.HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    group = dist.ProcessGroup(store, 0, 1)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    x = torch.ones(1)
    group.allreduce([x]).wait()
    before = _open_fds()
    for stop in (group, backend):  # whichever of these this release has
        for name in ("shutdown", "abort"):
            if hasattr(stop, name):
                getattr(stop, name)()
    group.allreduce([x]).wait()  # still works
    assert _open_fds() == before  # nothing closed
    del group, backend, stop  # the loop variable holds the backend too
    assert _open_fds() < before  # only dropping the last handle closes its sockets


def test_the_stand_in_backend_exists_from_torch_2_12() -> None:
    """Seen in 2.12.1, 2.13.0, 2.14.1 and 2.15.0, not in 2.9.1 (whose gloo groups stay torch's own)."""
    if RELEASE >= (2, 12):
        assert _closable.supported()


def test_every_collective_of_this_torch_is_forwarded() -> None:
    """A collective torch adds to ProcessGroup must be forwarded too, or it would bypass release."""
    bookkeeping = {
        "abort", "bound_device_id", "boxed", "get_group_store", "group_desc", "group_name",
        "merge_remote_group", "name", "rank", "shutdown", "size", "split_group", "unbox",
        "use_pg_for_symm_mem_rendezvous",
    }  # fmt: skip
    public = {n for n in vars(dist.ProcessGroup) if not n.startswith("_") and n[0].islower()}
    data = {"_allgather_base", "_reduce_scatter_base"} & set(vars(dist.ProcessGroup))
    missing = (public - bookkeeping | data) - set(_closable.FORWARDED)
    assert not missing, f"ProcessGroup operations not forwarded: {sorted(missing)}"


def test_forwards_then_releases_its_connections_and_raises() -> None:
    group = _one_member_group()
    assert group.group_name == "g-1" and "gloo" in repr(group)
    x = torch.tensor([3.0])
    group.allreduce([x]).wait()
    out = torch.empty(1)
    group._allgather_base(out, x).wait()
    assert (x.item(), out.item()) == (3.0, 3.0)
    before = _open_fds()
    group.release()
    group.release()  # idempotent
    assert group.released and _open_fds() < before  # gloo's device and pair sockets closed
    for call in (lambda: group.allreduce([x]), lambda: group.barrier(), lambda: group.inner()):
        with pytest.raises(MeshClosedError, match="kept past its mesh's scope"):
            call()
    assert "shut down when its mesh closed" in repr(group)


def test_splitting_is_refused_with_a_pointer_to_the_mesh() -> None:
    group = _one_member_group()
    with pytest.raises(NotImplementedError, match="ask its mesh"):
        group.split_group([0])
    group.release()


def test_the_stand_in_raises_rather_than_doing_nothing() -> None:
    """If a C++ path ever sent a collective to the stand-in, it must fail, not silently pass."""
    stand_in = _closable._stand_in(0, 2)
    if stand_in is None:
        pytest.skip("this torch has no stand-in backend")
    with pytest.raises(RuntimeError):
        stand_in.allreduce([torch.ones(1)]).wait()


class _FailedWork(dist.Work):
    """A double of gloo's work for a collective a closing peer cut short: in flight until
    :meth:`fail`, then completed with gloo's error. On any thread but its maker's, ``wait``
    first stops at a gate the test opens (``entered`` set, then waiting for ``go``), so the
    test holds a group's settle in the middle of letting go of it."""

    def __init__(self) -> None:
        super().__init__()
        self.maker = threading.get_ident()
        self.failed = threading.Event()
        self.entered = threading.Event()
        self.go = threading.Event()

    def fail(self) -> None:
        self.failed.set()

    def is_completed(self) -> bool:
        return self.failed.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if threading.get_ident() != self.maker:
            self.entered.set()
            if not self.go.wait(timeout=30):
                raise TimeoutError("the test did not open the gate within 30 s")
        if not self.failed.is_set():
            raise TimeoutError("wait on a double whose collective never ended")
        raise RuntimeError("[../gloo/transport/tcp/pair.cc] Connection closed by peer")


def _said(call: Any) -> str:
    try:
        return f"returned {call()!r}"
    except Exception as error:  # the answer is the point
        return f"{type(error).__name__}: {error}"


def test_a_handle_read_while_its_group_settles_never_reports_the_cut_collective_done() -> None:
    """Issue 32, items 1 and 9: a collective in flight when its group was interrupted, then
    failed (the peer's side closed), is settled by the watch's thread. A caller polling its
    handle meanwhile (``is_completed`` then ``wait``, as ``_workers_abort.torch_made_groups``
    does) must see the failure at every moment of the settle; it used to see ``wait()``
    return True and ``is_success()`` True while the settle had dropped gloo's work but not
    yet recorded how it ended (the flake of test_abort's torch-made-groups test)."""
    group = _one_member_group()
    work = _FailedWork()
    group._enter()  # what a forwarded collective does around gloo's call
    handle = group._leave(work)
    assert not group.interrupt("when the test interrupted it")  # in flight: held
    work.fail()  # the peer closed its side: gloo's collective ends with an error
    settle = threading.Thread(target=group.settle, name="settle", daemon=True)
    settle.start()
    if not work.entered.wait(timeout=30):
        raise TimeoutError("the settle never reached gloo's work within 30 s")
    during = [_said(handle.is_completed), _said(handle.wait), _said(handle.is_success)]
    work.go.set()
    settle.join(timeout=30)
    if settle.is_alive():
        raise TimeoutError("the settle did not end within 30 s of opening the gate")
    after = [_said(handle.wait), _said(handle.is_success)]
    print("during the settle:", during, "after it:", after)
    assert during[0] == "returned True", during  # it has ended: a poller goes on to wait
    for said in (during[1], after[0]):  # raises, never "returned True"
        assert said.startswith(("RuntimeError", "MeshClosedError")), (during, after)
    assert "Connection closed by peer" in during[1], during  # gloo's own error, as it was
    assert during[2] == after[1] == "returned False", (during, after)
    assert group.released


def test_a_group_found_settled_has_decided_every_handle() -> None:
    """The same settle seen from a second thread: ``tests/world/_workers_abort.kept_handles``
    calls ``settle()`` until it returns True, then reads its handles, while the watch's
    thread settles the same group. A True from ``settle()`` must mean every handle says
    how its collective ended: it used to come at once from the second thread (the group
    was no longer held) while the first was still letting go, so ``wait()`` returned True."""
    group = _one_member_group()
    work = _FailedWork()
    group._enter()
    handle = group._leave(work)
    assert not group.interrupt("when the test interrupted it")
    work.fail()
    first = threading.Thread(target=group.settle, name="watch's settle", daemon=True)
    first.start()
    if not work.entered.wait(timeout=30):
        raise TimeoutError("the first settle never reached gloo's work within 30 s")
    seen: list[str] = []
    done = threading.Event()

    def second() -> None:
        seen.append(_said(group.settle))
        seen.append(_said(handle.wait))
        done.set()

    threading.Thread(target=second, name="caller's settle", daemon=True).start()
    done.wait(timeout=2.0)  # old code: done at once; now: held until the first settle ends
    work.go.set()
    first.join(timeout=30)
    if not done.wait(timeout=30):
        raise TimeoutError("the second settle did not end within 30 s of the first")
    print("the second thread saw:", seen)
    assert seen[0] == "returned True", seen
    assert seen[1].startswith("MeshClosedError: this collective did not complete"), seen
    assert "when the test interrupted it" in seen[1], seen


def _made_as_a_mesh_makes_it() -> _closable.ClosableGroup:
    """A one-member closable group from torch's custom-backend creator, stand-in and all."""
    options = SimpleNamespace(
        store=dist.HashStore(), group_rank=0, group_size=1, timeout=timedelta(seconds=10),
        global_ranks_in_group=[0], group_id="g-2",
    )  # fmt: skip
    group = _closable.make_closable_gloo(options)
    group.setGroupName("g-2")
    return group


def _c10d_ops(x: torch.Tensor) -> dict[str, Any]:
    """Every op torch registers under ``c10d::`` that takes a group, as a call on ``(group)``."""
    ops, op = torch.ops.c10d, torch.classes.c10d.ReduceOp()
    return {
        "send": lambda g: ops.send([x], g, 0, 0),
        "recv_": lambda g: ops.recv_([x], g, 0, 0),
        "recv_any_source_": lambda g: ops.recv_any_source_([x], g, 0),
        "allreduce_": lambda g: ops.allreduce_([x], g, op, None, True, -1),
        "allreduce_coalesced_": lambda g: ops.allreduce_coalesced_([x], g, op, True, -1),
        "broadcast_": lambda g: ops.broadcast_([x], g, 0, 0, True, -1),
        "reduce_": lambda g: ops.reduce_([x], g, op, 0, 0, True, -1),
        "allgather_": lambda g: ops.allgather_([[x]], [x], g, True, -1),
        "_allgather_base_": lambda g: ops._allgather_base_(x, x, g, True, -1),
        "allgather_coalesced_": lambda g: ops.allgather_coalesced_([[x]], [x], g, True),
        "allgather_into_tensor_coalesced_": lambda g: ops.allgather_into_tensor_coalesced_(
            [x], [x], g, True
        ),
        "reduce_scatter_": lambda g: ops.reduce_scatter_([x], [[x]], g, op, True, -1),
        "_reduce_scatter_base_": lambda g: ops._reduce_scatter_base_(x, x, g, op, True, -1),
        "reduce_scatter_tensor_coalesced_": lambda g: ops.reduce_scatter_tensor_coalesced_(
            [x], [x], g, op, True, -1
        ),
        "gather_": lambda g: ops.gather_([[x]], [x], g, 0, True, -1),
        "scatter_": lambda g: ops.scatter_([x], [[x]], g, 0, True, -1),
        "alltoall_": lambda g: ops.alltoall_([x], [x], g, True, -1),
        "alltoall_base_": lambda g: ops.alltoall_base_(x, x, g, [], [], True, -1),
        "barrier": lambda g: ops.barrier(x, g, [], True, -1),
        "monitored_barrier_": lambda g: ops.monitored_barrier_(x, g, [], 1000, False),
    }


def _outcome(call: Any, group: Any, x: torch.Tensor) -> str:
    """What an op on ``group`` said: its error's type, or what its work reported and the
    buffer after it."""
    try:
        result = call(group)
    except RuntimeError as error:
        return f"raised {type(error).__name__}"
    work = result[-1] if isinstance(result, tuple) else result
    if work is None:
        return f"returned None, buffer {x.item()}"
    try:
        waited = f"wait() -> {work.wait()!r}"
    except RuntimeError as error:
        return f"wait() raised {type(error).__name__}"
    return f"{waited}, buffer {x.item()}"


@pytest.mark.parametrize("state", ["open", "released", "interrupted"])
def test_no_c10d_op_sent_to_the_stand_in_reports_success(state: str) -> None:
    """Issue 37, item 1: ``torch.ops.c10d.recv_`` on a shut-down group returned at once, its
    work done and the buffer untouched: torch's fake backend, the stand-in C++ reaches,
    checks ``error_on_collective`` in its collectives but not in ``send``, ``recv`` and
    ``recvAnysource``. Every ``c10d::`` op a C++ path sends to a mesh's gloo group must
    fail (raise, or a work whose wait raises), whatever state the group is in."""
    if not _closable.supported():
        pytest.skip("this torch has no stand-in backend")
    group = _made_as_a_mesh_makes_it()
    if state == "released":
        group.release()
    elif state == "interrupted":
        assert group.interrupt("when the test aborted its mesh")
    x = torch.full((1,), 7.0)
    boxed = group.boxed()  # the form torch.ops.c10d takes a group in
    said = {name: _outcome(call, boxed, x) for name, call in _c10d_ops(x).items()}
    lied = {name: outcome for name, outcome in said.items() if "raised" not in outcome}
    print(state, "ops that did not fail:", lied)
    assert not lied, f"{state}: c10d ops reported done on the stand-in: {lied}"
    del boxed
    group.release()


@pytest.mark.parametrize("state", ["released", "interrupted"])
def test_point_to_point_on_a_shut_down_group_raises_mesh_closed_error(state: str) -> None:
    """The rest of item 1's audit: the group's own ``send``, ``recv`` and
    ``recv_anysource``, the C++ ``recvAnysource`` (torch's trampoline does not override
    it: it goes through ``c10d::recv_any_source_``), the coalescing calls and a backend
    taken before the shutdown are refused once the group is shut down."""
    if not _closable.supported():
        pytest.skip("this torch has no stand-in backend")
    group = _made_as_a_mesh_makes_it()
    backend = group._get_backend(torch.device("cpu"))
    if state == "released":
        group.release()
    else:
        assert group.interrupt("when the test aborted its mesh")
    x = torch.full((1,), 7.0)
    calls = {
        "send": lambda: group.send([x], 0, 0),
        "recv": lambda: group.recv([x], 0, 0),
        "recv_anysource": lambda: group.recv_anysource([x], 0),
        "start_coalescing": lambda: group._start_coalescing(torch.device("cpu")),
        "backend.send": lambda: backend.send([x], 0, 0),
        "backend.recv": lambda: backend.recv([x], 0, 0),
    }
    said = {name: _said(call) for name, call in calls.items()}
    said["ProcessGroup.recv_anysource"] = _said(
        lambda: dist.ProcessGroup.recv_anysource(group, [x], 0).wait()
    )
    print(state, said)
    for name, outcome in said.items():
        expected = "RuntimeError" if name.startswith("ProcessGroup.") else "MeshClosedError"
        assert outcome.startswith(expected), (name, outcome)
    assert x.item() == 7.0
