"""Faults (tests/world/test_reliability.py, section 2).

Members that never ask, an eager constructor that fails, groups destroyed behind
the mesh's back, and a global ``dist.destroy_process_group()`` inside a scope.
"""

from __future__ import annotations

import gc
import time
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from _workers_common import NAMES, error_of, live, summed

from scopedmesh.c10d import groups as _c10d
from scopedmesh.errors import GroupFormationError
from scopedmesh.mesh import ProcessGroupMesh

# The timeout of the meshes a member never asks on: the others only need it to fire. The
# groups that do form under it (tp [0, 1] while rank 2 or 3 stays away) take ~0.1 s.
MISSING_TIMEOUT = 1.0


def _form(mesh: ProcessGroupMesh, axis: Any) -> dict[str, Any]:
    """Request ``axis`` on ``mesh``; return the outcome and how long it took."""
    started = time.monotonic()
    try:
        group = mesh.get_group_along_axis(axis)
    except GroupFormationError as exc:
        return {"seconds": time.monotonic() - started, **error_of(exc)}
    return {"seconds": time.monotonic() - started, "sum": summed(group) if group else None}


def missing_member(rank: int) -> dict[str, Any]:
    """Rank 3 never asks for its tp group, then rank 2 never does; then both do."""
    out: dict[str, Any] = {}
    for phase, absent in (("first", 3), ("second", 2)):
        mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=MISSING_TIMEOUT)
        with mesh:
            if rank != absent:
                out[phase] = _form(mesh, "tp")
        out[phase + "_closed"] = mesh.closed
        out[phase + "_live"] = live()
        dist.barrier()
        # Every member asks now: the group forms although one member gave up before.
        with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as mesh:
            out[phase + "_retry"] = _form(mesh, "tp")
        dist.barrier()
    # Several axes: rank 0 never asks, the other three wait for it.
    mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=MISSING_TIMEOUT)
    with mesh:
        if rank != 0:
            out["multi"] = _form(mesh, NAMES)
    out["multi_closed"] = mesh.closed
    dist.barrier()
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as mesh:
        out["multi_retry"] = _form(mesh, NAMES)
    return out


def eager_missing_member(rank: int) -> dict[str, Any]:
    """``eager=True`` on every rank but 3: the constructor fails and leaves nothing open."""
    out: dict[str, Any] = {}
    before = live()
    if rank != 3:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.monotonic()
            try:
                ProcessGroupMesh(2, 2, names=NAMES, timeout=MISSING_TIMEOUT, eager=True).close()
                out["outcome"] = "made"
            except GroupFormationError as exc:
                out["outcome"] = error_of(exc)
            out["seconds"] = time.monotonic() - started
            gc.collect()
        out["resource_warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
        ]
    out["leaked"] = live() - before
    dist.barrier()
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0, eager=True) as mesh:
        out["retry"] = [summed(mesh.get_group_along_axis(a)) for a in NAMES]  # type: ignore[arg-type]
    return out


def hand_destroyed(rank: int) -> dict[str, Any]:
    """A mesh's group destroyed by hand inside the scope: close skips it."""
    out: dict[str, Any] = {}
    before = live()
    mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
    with mesh:
        dp = mesh.get_group_along_axis("dp")
        tp = mesh.get_group_along_axis("tp")
        assert dp is not None and tp is not None
        dist.destroy_process_group(dp)
        out["inside"] = live() - before
        try:
            mesh.get_group_along_axis("dp")
            out["asked_again"] = "returned"
        except RuntimeError as exc:
            out["asked_again"] = error_of(exc)
        out["other_group_sum"] = summed(tp)
    out["closed"] = mesh.closed
    out["leaked"] = live() - before
    out["tp_live"] = _c10d.is_live(tp)
    return out


def global_destroy(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """``dist.destroy_process_group()`` inside a scope; then a new world on ``port``."""
    out: dict[str, Any] = {}
    mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
    sub = mesh.submesh("tp")
    try:
        with mesh:
            mesh.get_group_along_axis("dp")
            sub.get_group_along_axis("tp")
            dist.destroy_process_group()
        out["raised"] = None
    except Exception as exc:
        out["raised"] = error_of(exc)
    out["closed"] = [mesh.closed, sub.closed]
    out["initialized"] = dist.is_initialized()
    mesh.close()  # a second close stays a no-op
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as again:
        out["new_world_sums"] = [
            summed(again.get_group_along_axis(a))  # type: ignore[arg-type]
            for a in ("dp", "tp", NAMES)
        ]
    out["live_after"] = live()
    return out
