"""The closable gloo group, on one process: forwarding, release, the stand-in backend.

A one-member gloo group needs no peer, so these run without a world; the
kept-handle figures in a real world are in ``tests/world/test_heal.py``.
"""

from __future__ import annotations

import os
from datetime import timedelta

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
