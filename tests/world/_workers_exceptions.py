"""Exception safety and misuse (tests/world/test_reliability.py, sections 3-4)."""

from __future__ import annotations

import gc
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from _workers_common import NAMES, error_of, live, summed

from scopedmesh.c10d import groups as _c10d
from scopedmesh.errors import GroupFormationError
from scopedmesh.mesh import ProcessGroupMesh


class Boom(Exception):
    """The exception the exception-safety checks raise."""


def _raise_boom(error: Boom) -> None:
    raise error


def _nested_scopes(error: BaseException | None, held: list[Any]) -> None:
    """mesh -> sub-mesh -> sub-sub-mesh, each making a group; raise ``error`` innermost."""
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as mesh:
        held += [mesh, mesh.get_group_along_axis("dp")]
        with mesh.submesh("dp", "tp") as sub:
            held += [sub, sub.get_group_along_axis(("dp", "tp"))]
            with sub.submesh("tp") as subsub:
                held += [subsub, subsub.get_group_along_axis("tp")]
                if isinstance(error, Boom):
                    _raise_boom(error)
                elif error is not None:
                    raise error


def exception_safety(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"swallowed": 0}
    before = live()
    for kind in ("Boom", "KeyboardInterrupt", "GroupFormationError"):
        error: BaseException = {
            "Boom": Boom("inner failure"),
            "KeyboardInterrupt": KeyboardInterrupt(),
            "GroupFormationError": GroupFormationError("a peer vanished"),
        }[kind]
        held: list[Any] = []
        caught_exc: BaseException | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _nested_scopes(error, held)
                out["swallowed"] += 1
            except BaseException as exc:
                caught_exc = exc
        frames = traceback.extract_tb(caught_exc.__traceback__) if caught_exc else []
        meshes = [h for h in held if isinstance(h, ProcessGroupMesh)]
        groups = [h for h in held if isinstance(h, dist.ProcessGroup)]
        out[kind] = {
            "same_object": caught_exc is error,
            "frames": [f.name for f in frames],
            "context": repr(getattr(caught_exc, "__context__", None)),
            "cause": repr(getattr(caught_exc, "__cause__", None)),
            "closed": [m.closed for m in meshes],
            "live_groups": [_c10d.is_live(g) for g in groups],
            "groups": len(groups),
            "leaked": live() - before,
            "warnings": [str(w.message) for w in caught],
        }
        del held, meshes, groups, caught_exc
    return out


def close_fails(rank: int) -> dict[str, Any]:
    """A destroy that fails during close: the other groups still go; no error is lost."""
    out: dict[str, Any] = {}
    real = _c10d.destroy
    calls: list[int] = []

    def flaky(group: dist.ProcessGroup, **options: Any) -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected destroy failure")
        return real(group, **options)

    before = live()
    for in_flight in (False, True):
        calls.clear()
        mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
        groups: list[Any] = []
        _c10d.destroy = flaky  # type: ignore[assignment]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with mesh:
                    groups = [mesh.get_group_along_axis(a) for a in ("dp", "tp", NAMES)]
                    if in_flight:
                        raise Boom("the block failed")
                result: dict[str, Any] = {"raised": None}
            except Exception as exc:
                result = {"raised": error_of(exc)}
            finally:
                _c10d.destroy = real  # type: ignore[assignment]
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        result["closed"] = mesh.closed
        result["still_live"] = sum(_c10d.is_live(g) for g in groups if g is not None)
        for g in groups:  # clean up by hand what the failed destroy left
            if g is not None:
                _c10d.destroy(g)
        result["leaked_after_cleanup"] = live() - before
        out["in_flight" if in_flight else "no_exception"] = result
        dist.barrier()
    return out


def misuse(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    before = live()

    def outcome(fn: Callable[[], object]) -> dict[str, str]:
        try:
            fn()
        except Exception as exc:
            return error_of(exc)
        return {"type": "none", "message": ""}

    # A sub-mesh used after its parent closed.
    mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
    sub = mesh.submesh("tp")
    g = sub.get_group_along_axis("tp")
    mesh.close()
    out["sub_after_parent"] = {
        "sub_closed": sub.closed,
        "group_live": _c10d.is_live(g),  # type: ignore[arg-type]
        "get_group": outcome(lambda: sub.get_group_along_axis("tp")),
        "create_groups": outcome(sub.create_groups),
        "submesh": outcome(lambda: sub.submesh("tp")),
        "enter": outcome(lambda: sub.__enter__()),
        "close_again": outcome(sub.close),
        "layout_queries": [sub.shape, sub.coordinate(), sub.size("tp"), sub.local_rank("tp")],
        "parent_get_group": outcome(lambda: mesh.get_group_along_axis("dp")),
    }
    # Entering a closed mesh; entering a mesh twice (nested, and again after exit).
    closed = ProcessGroupMesh(2, 2, names=NAMES)
    closed.close()

    def enter_closed() -> None:
        with closed:
            pass

    twice = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
    with twice:
        group = twice.get_group_along_axis("dp")

        def enter_again() -> None:
            with twice:
                pass

        nested = outcome(enter_again)
        still_open = not twice.closed and _c10d.is_live(group)  # type: ignore[arg-type]
    after_exit = outcome(enter_again)
    out["enter"] = {
        "closed": outcome(enter_closed),
        "nested": nested,
        "open_after_nested": still_open,
        "after_exit": after_exit,
        "group_live_after_exit": _c10d.is_live(group),  # type: ignore[arg-type]
    }
    # Closing a parent while a child is open.
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as parent:
        kept = parent.get_group_along_axis("dp")
        with parent.submesh("dp", "tp") as child:
            owned = child.get_group_along_axis(("dp", "tp"))
            parent.close()
            state = {
                "child_closed": child.closed,
                "parent_closed": parent.closed,
                "owned_live": _c10d.is_live(owned),  # type: ignore[arg-type]
                "kept_live": _c10d.is_live(kept),  # type: ignore[arg-type]
                "child_get": outcome(lambda: child.get_group_along_axis("tp")),
            }
    out["parent_closed_first"] = state
    out["leaked"] = live() - before
    return out


def collected_while_open(rank: int) -> dict[str, Any]:
    """A mesh dropped while open warns (ResourceWarning) and destroys nothing."""
    out: dict[str, Any] = {}
    before = live()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
        group = mesh.get_group_along_axis("tp")
        del mesh  # no cycle: collected now
        plain = [w for w in caught if issubclass(w.category, ResourceWarning)]
        out["plain"] = [str(w.message) for w in plain]
        out["plain_source"] = [type(w.source).__name__ for w in plain]
        out["group_live"] = _c10d.is_live(group)  # type: ignore[arg-type]
        caught.clear()
        # A mesh with an open sub-mesh is a reference cycle: gc finds it; one warning only.
        mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0)
        sub = mesh.submesh("dp")
        sub.get_group_along_axis("dp")
        del mesh, sub
        gc.collect()
        out["cycle"] = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        caught.clear()
        # A mesh whose constructor failed was never open: no warning.
        try:
            ProcessGroupMesh(2, 2, names=NAMES, timeout=-1)
        except ValueError:
            pass
        gc.collect()
        out["failed_constructor"] = [str(w.message) for w in caught]
    out["leaked_before_cleanup"] = live() - before
    # The leaked groups stay usable and a new mesh over the same ranks still forms its own.
    out["leaked_group_sum"] = summed(group)  # type: ignore[arg-type]
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as fresh:
        out["fresh_sums"] = [summed(fresh.get_group_along_axis(a)) for a in NAMES]  # type: ignore[arg-type]
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):  # the user's remedy: destroy by hand
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)
    out["leaked"] = live() - before
    return out
