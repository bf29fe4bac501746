"""Worker functions for tests/world/test_mesh.py, and the check runner the gloo suites share.

Spawning a gloo world costs seconds, so one worker runs a sequence of checks
and returns, per check, either the facts it gathered or the traceback that
stopped it. The parent asserts on the facts against expectations written by
hand (never computed with the library's own layout).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import pickle
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from probes import error_text, record_new_groups

from scopedmesh.c10d import groups as _c10d
from scopedmesh.errors import MeshClosedError
from scopedmesh.layout import MeshLayout
from scopedmesh.layout.placement import node_aware_ranks
from scopedmesh.mesh import ProcessGroupMesh

Check = Callable[[int, int], dict[str, Any]]
DIED = "__died__"  # marks a report saved by a rank before a check that may kill it
TIMEOUT = 30.0  # seconds: every mesh here gets it, so a broken check fails instead of hanging

# ------------------------------------------------------------------ the runner


def run_checks(
    rank: int, world_size: int, checks: Sequence[Check], save_to: str | None = None
) -> dict[str, Any]:
    """Run ``checks`` in order (all ranks in step); stop at the first that raises.

    With ``save_to``, the report so far is pickled there before each check, so a
    rank that a check kills still leaves the reports of the checks before it.
    Each entry is ``{"status": "ok", "facts": ..., "live_before": n, "live_after": n,
    "warnings": [...]}`` (the warnings the check did not catch itself),
    ``{"status": "error", "detail": traceback}`` or ``{"status": "not run", ...}``.
    """
    report: dict[str, Any] = {}
    failed: str | None = None
    for check in checks:
        name = check.__name__
        if failed is not None:
            report[name] = {"status": "not run", "detail": f"check {failed!r} failed first"}
            continue
        if save_to is not None:
            Path(save_to).write_bytes(pickle.dumps({**report, DIED: True}))
        try:
            dist.barrier()
            before = _c10d.live_group_count()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                facts = check(rank, world_size)
            report[name] = {
                "status": "ok",
                "facts": facts,
                "live_before": before,
                "live_after": _c10d.live_group_count(),
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            }
        except Exception:
            report[name] = {"status": "error", "detail": traceback.format_exc()}
            failed = name
    return report


def last_words(
    results: Sequence[dict[str, Any] | None], save_dir: Path
) -> list[dict[str, Any] | None]:
    """``results`` with each dead rank's ``None`` replaced by the report it saved."""
    out = list(results)
    for rank, report in enumerate(results):
        saved = save_dir / f"rank{rank}.pkl"
        if report is None and saved.exists():
            out[rank] = pickle.loads(saved.read_bytes())
    return out


def entries(results: Sequence[dict[str, Any] | None], name: str) -> list[dict[str, Any] | None]:
    """The report of check ``name`` from every rank (``None`` for a rank that died in it).

    Raises AssertionError with the rank and traceback if any rank did not pass it.
    """
    out: list[dict[str, Any] | None] = []
    for rank, report in enumerate(results):
        if report is None or (name not in report and report.get(DIED)):
            out.append(None)
            continue
        entry = report.get(name)
        if entry is None:
            raise AssertionError(f"rank {rank} has no report for check {name!r}")
        if entry["status"] != "ok":
            raise AssertionError(
                f"check {name!r} {entry['status']} on rank {rank}:\n{entry['detail']}"
            )
        out.append(entry)
    return out


def facts(results: Sequence[dict[str, Any] | None], name: str) -> list[dict[str, Any]]:
    """The facts of check ``name``, indexed by rank (ranks that died are left out)."""
    return [e["facts"] for e in entries(results, name) if e is not None]


# ------------------------------------------------------------------ helpers


def members(group: dist.ProcessGroup | None, world_size: int) -> list[int] | None:
    """The global ranks of ``group`` as a real collective sees them: one-hot all_reduce."""
    if group is None:
        return None
    t = torch.zeros(world_size, dtype=torch.int64)
    t[dist.get_rank()] = 1
    dist.all_reduce(t, group=group)
    return [r for r in range(world_size) if int(t[r]) == 1]


def total(group: dist.ProcessGroup) -> int:
    """The sum of the global ranks of ``group``'s members (another membership probe)."""
    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


@contextlib.contextmanager
def record_destroys() -> Iterator[list[str]]:
    """Record the name of every group passed to ``dist.destroy_process_group``."""
    names: list[str] = []
    original = dist.destroy_process_group

    @functools.wraps(original)
    def wrapper(group: Any = None) -> None:
        names.append("<global>" if group is None else group.group_name)
        original(group)

    dist.destroy_process_group = wrapper
    try:
        yield names
    finally:
        dist.destroy_process_group = original


def mesh3(**kwargs: Any) -> ProcessGroupMesh:
    """The 2 x 2 x 2 mesh most checks use: rank = 4 * dp + 2 * pp + tp."""
    kwargs.setdefault("timeout", TIMEOUT)
    return ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp"), **kwargs)


# ------------------------------------------------------------ mesh checks (world of 8)

AXES_3D: list[Any] = [
    "dp",
    "pp",
    "tp",
    ("dp", "tp"),
    ("pp", "tp"),
    ("dp", "pp"),
    ("dp", "pp", "tp"),
]


def membership_3d(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with mesh3() as mesh:
        out["coordinate"] = mesh.coordinate()
        for axes in AXES_3D:
            group = mesh.get_group_along_axis(axes)
            assert group is not None
            key = "+".join(axes) if isinstance(axes, tuple) else axes
            out[key] = {
                "members": members(group, world_size),
                "sum": total(group),
                "ranks_in_group": mesh.get_ranks_in_group(group),
                "group_rank": dist.get_rank(group),
                "local_rank": mesh.local_rank(axes),
                "is_first": mesh.is_first(axes),
                "is_last": mesh.is_last(axes),
                "is_world": group is dist.group.WORLD,
            }
    return out


def world_untouched(rank: int, world_size: int) -> dict[str, Any]:
    """A mesh axis spanning the world gets its own group; closing never touches WORLD."""
    world = dist.group.WORLD
    with record_destroys() as destroyed:
        with ProcessGroupMesh(world_size, names=("all",), timeout=TIMEOUT) as mesh:
            group = mesh.get_group_along_axis("all")
            assert group is not None
            name = group.group_name
            span = members(group, world_size)
        world_sum = total(world)  # type: ignore[arg-type]
    return {
        "is_world": group is world,
        "members": span,
        "destroyed": destroyed == [name],
        "world_live": _c10d.is_live(world),  # type: ignore[arg-type]
        "world_sum": world_sum,
    }


def indices_subsets(rank: int, world_size: int) -> dict[str, Any]:
    """Pipeline ends in a 4 x 2 (pp, tp) mesh: rank = 2 * pp + tp."""
    with (
        record_new_groups() as calls,
        ProcessGroupMesh(4, 2, names=("pp", "tp"), timeout=TIMEOUT) as mesh,
    ):
        ends = mesh.get_group_along_axis("pp", indices_at_axis=[0, -1])
        again = mesh.get_group_along_axis("pp", indices_at_axis=[-1, 0])
        corner = mesh.get_group_along_axis(("pp", "tp"), indices_at_axis=[[0, -1], [1]])
        corner_again = mesh.get_group_along_axis(("tp", "pp"), indices_at_axis=[[1], [3, 0]])
        return {
            "ends": members(ends, world_size),
            "ends_is_none": ends is None,
            "ends_again_same": again is ends,
            "corner": members(corner, world_size),
            "corner_is_none": corner is None,
            "corner_again_same": corner_again is corner,
            "corner_is_ends": corner is not None and corner is ends,
            "calls": len(calls),
        }


def custom_ranks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    order = [3, 1, 7, 5, 0, 2, 6, 4]
    with ProcessGroupMesh(2, 4, names=("a", "b"), ranks=order, timeout=TIMEOUT) as mesh:
        out["perm_coordinate"] = mesh.coordinate()
        out["perm_a"] = members(mesh.get_group_along_axis("a"), world_size)
        out["perm_b"] = members(mesh.get_group_along_axis("b"), world_size)
        out["perm_local_rank_b"] = mesh.local_rank("b")
        out["perm_b_order"] = dist.get_process_group_ranks(mesh.get_group_along_axis("b"))  # type: ignore[arg-type]
    odd = [1, 3, 5, 7]
    if rank in odd:
        with ProcessGroupMesh(2, 2, names=("x", "y"), ranks=odd, timeout=TIMEOUT) as mesh:
            out["sub_x"] = members(mesh.get_group_along_axis("x"), world_size)
            out["sub_y"] = members(mesh.get_group_along_axis("y"), world_size)
            out["sub_xy"] = members(mesh.get_group_along_axis(("x", "y")), world_size)
            out["sub_coordinate"] = mesh.coordinate()
    else:
        out["outside"] = error_text(lambda: ProcessGroupMesh(2, 2, ranks=odd))
    out["beyond_world"] = error_text(lambda: ProcessGroupMesh(9, ranks=range(9)))
    return out


def from_layout(rank: int, world_size: int) -> dict[str, Any]:
    """``ProcessGroupMesh.from_layout`` over a permuted table and over a slice, by all_reduce."""
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    order = [3, 1, 7, 5, 0, 2, 6, 4]
    layout = MeshLayout((2, 4), names=("a", "b"), ranks=order)
    with ProcessGroupMesh.from_layout(layout, timeout=TIMEOUT, eager=True) as mesh:
        out["perm_live"] = _c10d.live_group_count() - live0  # eager: a and b
        out["perm_coordinate"] = mesh.coordinate()
        out["perm_a"] = members(mesh.get_group_along_axis("a"), world_size)
        out["perm_b"] = members(mesh.get_group_along_axis("b"), world_size)
        out["perm_timeout"] = mesh.timeout
    sliced = MeshLayout((2, 4), names=("a", "b"))[:, 1::2]  # ranks 1 3 | 5 7
    if rank in sliced:
        with ProcessGroupMesh.from_layout(sliced, timeout=TIMEOUT) as mesh:
            out["slice_coordinate"] = mesh.coordinate()
            out["slice_a"] = members(mesh.get_group_along_axis("a"), world_size)
            out["slice_ab"] = members(mesh.get_group_along_axis(("a", "b")), world_size)
    else:
        out["outside"] = error_text(lambda: ProcessGroupMesh.from_layout(sliced))
    out["leaked"] = _c10d.live_group_count() - live0
    return out


def lazy_and_cached(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    with record_new_groups() as calls:
        mesh = mesh3()
        with mesh:
            out["after_construction"] = (len(calls), _c10d.live_group_count() - live0)
            tp = mesh.get_group_along_axis("tp")
            out["after_first"] = (len(calls), _c10d.live_group_count() - live0)
            out["same_tp"] = [
                mesh.get_group_along_axis("tp") is tp,
                mesh.get_group_along_axis(2) is tp,
                mesh.get_group_along_axis(-1) is tp,
                mesh.get_group_along_axis(("tp",)) is tp,
                mesh.create_group_along_axis("tp") is tp,
                mesh.get_group_along_axis("tp", backend="gloo") is tp,
                mesh.get_group_along_axis("tp", backend="GLOO") is tp,
                mesh.get_group_along_axis("tp", indices_at_axis=[0, 1]) is tp,
            ]
            out["after_repeats"] = len(calls)
            dp_tp = mesh.get_group_along_axis(("dp", "tp"))
            out["same_dp_tp"] = [
                mesh.get_group_along_axis(("tp", "dp")) is dp_tp,
                mesh.get_group_along_axis((0, 2)) is dp_tp,
                mesh.get_group_along_axis((2, 0)) is dp_tp,
                mesh.get_group_along_axis(["dp", -1]) is dp_tp,
            ]
            out["dp_tp_members"] = members(dp_tp, world_size)
            out["after_several"] = (len(calls), _c10d.live_group_count() - live0)
            out["call_ranks"] = [c["ranks"] for c in calls]
            out["call_names"] = [c["name"] for c in calls]
        out["after_exit"] = _c10d.live_group_count() - live0
    return out


def submeshes(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    with record_new_groups() as calls, mesh3() as mesh:
        tp = mesh.get_group_along_axis("tp")
        with mesh.submesh("pp", "tp") as stage:
            out["stage_shape"] = (stage.shape, stage.names, stage.layout.ranks)
            out["stage_tp_shared"] = stage.get_group_along_axis("tp") is tp
            out["calls_after_shared"] = len(calls)
            stage_pp = stage.get_group_along_axis("pp")
            out["stage_pp"] = members(stage_pp, world_size)
            out["calls_after_stage_pp"] = len(calls)
            out["parent_sees_stage_pp"] = mesh.get_group_along_axis("pp") is stage_pp
            with stage.submesh("pp") as inner:  # a sub-sub-mesh
                out["inner_pp_shared"] = inner.get_group_along_axis("pp") is stage_pp
                inner_end = inner.get_group_along_axis("pp", indices_at_axis=[-1])
                out["inner_end"] = members(inner_end, world_size)
                out["calls_after_inner"] = len(calls)
                out["live_inside_inner"] = _c10d.live_group_count() - live0
            out["inner_end_destroyed"] = inner_end is None or not _c10d.is_live(inner_end)
            out["stage_pp_alive_after_inner"] = _c10d.is_live(stage_pp)  # type: ignore[arg-type]
            out["live_after_inner"] = _c10d.live_group_count() - live0
        out["stage_pp_destroyed"] = not _c10d.is_live(stage_pp)  # type: ignore[arg-type]
        out["tp_alive"] = _c10d.is_live(tp)  # type: ignore[arg-type]
        out["tp_still_works"] = members(tp, world_size)
        out["live_after_stage"] = _c10d.live_group_count() - live0
        pp = mesh.get_group_along_axis("pp")  # the parent held it: still the same group
        out["pp_new_object"] = pp is not stage_pp
        out["pp_again"] = members(pp, world_size)
        out["calls_total"] = len(calls)
        with mesh["pp", "tp"] as indexed:
            out["indexed_shares_tp"] = indexed.get_group_along_axis("tp") is tp
            out["indexed_shares_pp"] = indexed.get_group_along_axis("pp") is pp
        out["pp_alive_after_indexed"] = _c10d.is_live(pp)  # type: ignore[arg-type]
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def close_order(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    with record_destroys() as destroyed:
        mesh = mesh3()
        tp = mesh.get_group_along_axis("tp")
        dp = mesh.get_group_along_axis("dp")
        stage = mesh.submesh("pp", "tp")
        plane = stage.get_group_along_axis(("pp", "tp"))
        inner = stage.submesh("pp")
        pp = inner.get_group_along_axis("pp")
        everything = mesh.get_group_along_axis(("dp", "pp", "tp"))
        names = {
            "tp": tp.group_name,  # type: ignore[union-attr]
            "dp": dp.group_name,  # type: ignore[union-attr]
            "plane": plane.group_name,  # type: ignore[union-attr]
            "pp": pp.group_name,  # type: ignore[union-attr]
            "everything": everything.group_name,  # type: ignore[union-attr]
        }
        out["live_open"] = _c10d.live_group_count() - live0
        mesh.close()
        out["order"] = [next(k for k, v in names.items() if v == n) for n in destroyed]
        out["closed"] = (mesh.closed, stage.closed, inner.closed)
        out["live_closed"] = _c10d.live_group_count() - live0
        before = len(destroyed)
        mesh.close()
        stage.close()
        inner.close()
        mesh.destroy_mesh_process_groups()
        out["second_close_destroys"] = len(destroyed) - before
    # A sub-mesh closed by hand first: its own groups go, the parent's stay.
    with record_destroys() as destroyed, mesh3() as mesh:
        tp = mesh.get_group_along_axis("tp")
        stage = mesh.submesh("pp", "tp")
        stage_pp = stage.get_group_along_axis("pp")
        stage.close()
        out["stage_closed_destroys"] = destroyed == [stage_pp.group_name]  # type: ignore[union-attr]
        out["parent_tp_alive"] = _c10d.is_live(tp)  # type: ignore[arg-type]
        out["parent_still_open"] = not mesh.closed
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def skips_destroyed(rank: int, world_size: int) -> dict[str, Any]:
    live0 = _c10d.live_group_count()
    mesh = mesh3()
    tp = mesh.get_group_along_axis("tp")
    dp = mesh.get_group_along_axis("dp")
    dist.destroy_process_group(tp)  # by hand, behind the mesh's back
    with record_destroys() as destroyed:
        error = error_text(mesh.close)
    return {
        "close_error": error,
        "destroyed": destroyed == [dp.group_name],  # type: ignore[union-attr]
        "after_exit": _c10d.live_group_count() - live0,
    }


def two_meshes(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    for first in ("a", "b"):
        meshes = {"a": mesh3(), "b": mesh3()}
        groups = {k: m.get_group_along_axis("tp") for k, m in meshes.items()}
        second = "b" if first == "a" else "a"
        row: dict[str, Any] = {
            "distinct": groups["a"] is not groups["b"],
            "names_differ": groups["a"].group_name != groups["b"].group_name,  # type: ignore[union-attr]
            "members": [members(groups[k], world_size) for k in "ab"],
        }
        meshes[first].close()
        row["first_dead"] = not _c10d.is_live(groups[first])  # type: ignore[arg-type]
        row["second_alive"] = _c10d.is_live(groups[second])  # type: ignore[arg-type]
        row["second_works"] = members(groups[second], world_size)
        row["second_mesh_gives_same"] = meshes[second].get_group_along_axis("tp") is groups[second]
        meshes[second].close()
        row["second_dead"] = not _c10d.is_live(groups[second])  # type: ignore[arg-type]
        out[f"{first}_first"] = row
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def exception_propagates(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    error = KeyError("boom")
    mesh = mesh3()
    try:
        with mesh:
            mesh.get_group_along_axis("tp")
            raise error
    except KeyError as caught:
        out["same_object"] = caught is error
    out["closed"] = mesh.closed
    out["live_after"] = _c10d.live_group_count() - live0
    # A close that itself fails must not replace the exception that ended the block.
    mesh = mesh3()
    original = _c10d.destroy

    def broken(group: dist.ProcessGroup, **options: Any) -> bool:
        raise RuntimeError("destroy failed")

    leaked: list[dist.ProcessGroup] = []
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        try:
            with mesh:
                leaked.append(mesh.get_group_along_axis("tp"))  # type: ignore[arg-type]
                _c10d.destroy = broken
                raise error
        except KeyError as caught:
            out["same_object_when_close_fails"] = caught is error
        finally:
            _c10d.destroy = original
    out["close_failure_warned"] = [
        str(w.message) for w in caught_warnings if issubclass(w.category, RuntimeWarning)
    ]
    for group in leaked:
        _c10d.destroy(group)
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def closed_mesh(rank: int, world_size: int) -> dict[str, Any]:
    mesh = mesh3()
    with mesh:
        mesh.get_group_along_axis("tp")
    calls: dict[str, Callable[[], object]] = {
        "get_group_along_axis": lambda: mesh.get_group_along_axis("tp"),
        "get_new_group": lambda: mesh.get_group_along_axis("pp"),
        "create_group_along_axis": lambda: mesh.create_group_along_axis("dp"),
        "create_groups": mesh.create_groups,
        "submesh": lambda: mesh.submesh("tp"),
        "enter": mesh.__enter__,
    }
    errors: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except MeshClosedError as error:
            errors[name] = {"runtime_error": isinstance(error, RuntimeError), "text": str(error)}
    return {
        "errors": errors,
        "layout": {
            "shape": mesh.shape,
            "names": mesh.names,
            "size": mesh.size(),
            "size_tp": mesh.size("tp"),
            "coordinate": mesh.coordinate(),
            "coordinate_pp": mesh.coordinate("pp"),
            "local_rank_tp": mesh.local_rank("tp"),
            "is_first_dp": mesh.is_first("dp"),
            "is_last_dp": mesh.is_last("dp"),
            "group_tp": mesh.layout.group(mesh.coordinate(), "tp"),
            "rank": mesh.rank,
        },
        "repr": repr(mesh),
    }


def resource_warning(rank: int, world_size: int) -> dict[str, Any]:
    live0 = _c10d.live_group_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = mesh3()
        group = mesh.get_group_along_axis("tp")
        del mesh
        gc.collect()
        open_warnings = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        leaked_alive = _c10d.is_live(group)  # type: ignore[arg-type]
        _c10d.destroy(group)  # type: ignore[arg-type]
        caught.clear()
        with mesh3() as closed:
            closed.get_group_along_axis("tp")
        del closed
        explicit = mesh3()
        explicit.close()
        del explicit
        gc.collect()
        closed_warnings = [
            str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
        ]
    return {
        "open_warnings": open_warnings,
        "not_destroyed_by_del": leaked_alive,
        "closed_warnings": closed_warnings,
        "after_exit": _c10d.live_group_count() - live0,
    }


def eager_and_create_groups(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    with record_new_groups() as calls:
        with mesh3(eager=True) as mesh:
            out["eager_calls"] = sorted(tuple(c["ranks"]) for c in calls)
            out["eager_live"] = _c10d.live_group_count() - live0
            mesh.get_group_along_axis("tp")
            mesh.get_group_along_axis("dp")
            out["eager_then_get_calls"] = len(calls)
        calls.clear()
        with mesh3() as mesh:
            mesh.create_groups("tp", "dp")
            out["create_two"] = sorted(tuple(c["ranks"]) for c in calls)
            mesh.create_groups()
            out["create_all_total"] = len(calls)
            out["tp_cached"] = mesh.get_group_along_axis("tp") is not None and len(calls) == 3
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def defaults(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    other = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    with (
        record_new_groups() as calls,
        ProcessGroupMesh(
            2, 2, 2, names=("dp", "pp", "tp"), backend="gloo", timeout=17, pg_options=options
        ) as mesh,
    ):
        tp = mesh.get_group_along_axis("tp")
        assert tp is not None
        call = calls[-1]
        out["backend"] = str(dist.get_backend(tp))  # what the group runs on
        out["timeout_passed"] = call["timeout"].total_seconds()
        out["options_passed"] = call["backend_options"] is options
        out["backend_timeout"] = _backend_timeout(tp)
        out["same_options_ok"] = mesh.get_group_along_axis("tp", pg_options=options) is tp
        out["other_options"] = error_text(lambda: mesh.get_group_along_axis("tp", pg_options=other))
        out["calls"] = len(calls)
        with mesh.submesh("pp") as stage:  # a sub-mesh inherits the defaults
            stage.get_group_along_axis("pp")
            out["stage_timeout_passed"] = calls[-1]["timeout"].total_seconds()
            out["stage_options_passed"] = calls[-1]["backend_options"] is options
    with (
        record_new_groups() as calls,
        ProcessGroupMesh(8, names=("all",), timeout=timedelta(seconds=9)) as mesh,
    ):
        group = mesh.get_group_along_axis("all")
        out["timedelta_timeout"] = calls[-1]["timeout"].total_seconds()
        out["timedelta_backend_timeout"] = _backend_timeout(group)  # type: ignore[arg-type]
        out["default_backend"] = str(dist.get_backend(group))
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def _backend_timeout(group: dist.ProcessGroup) -> float | None:
    try:
        backend = group._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):  # a torch without these internals
        return None


def seed_names(rank: int, world_size: int) -> dict[str, Any]:
    live0 = _c10d.live_group_count()
    mesh = mesh3()
    tp = mesh.create_group_along_axis("tp")
    pp = mesh.create_group_along_axis("pp", indices_at_axis=[1])
    out = {
        "size": mesh.size(),
        "size_tp": mesh.size("tp"),
        "size_0": mesh.size(0),
        "coordinate": mesh.coordinate(),
        "coordinate_pp": mesh.coordinate("pp"),
        "coordinate_neg": mesh.coordinate(-1),
        "create_then_get": mesh.get_group_along_axis("tp") is tp,
        "ranks_in_group": mesh.get_ranks_in_group(tp),  # type: ignore[arg-type]
        "pp_at_1": members(pp, world_size),
        "ravel": ProcessGroupMesh.ravel((0, 1, 0), (2, 2, 2)),
        "unravel": ProcessGroupMesh.unravel(5, (2, 2, 2)),
        "coords": ProcessGroupMesh.get_coords_along_axis(mesh.coordinate(), 2, [0, 1]),
    }
    mesh.destroy_mesh_process_groups()
    out["closed"] = mesh.closed
    out["tp_dead"] = not _c10d.is_live(tp)  # type: ignore[arg-type]
    out["after_exit"] = _c10d.live_group_count() - live0
    return out


def global_destroy(rank: int, world_size: int) -> dict[str, Any]:
    """Last check of the world: a global destroy behind two meshes' backs (no re-init)."""
    mesh = mesh3()
    other = mesh3()
    mesh.get_group_along_axis("tp")
    stage = mesh.submesh("pp", "tp")
    stage.get_group_along_axis("pp")
    other.get_group_along_axis(("dp", "tp"))
    live_open = _c10d.live_group_count()
    dist.destroy_process_group()  # every group, WORLD included
    with record_destroys() as destroyed:
        errors = [error_text(mesh.close), error_text(other.close), error_text(stage.close)]
    return {
        "live_open": live_open,
        "errors": errors,
        "destroy_calls": destroyed,
        "closed": (mesh.closed, stage.closed, other.closed),
        "initialized": dist.is_initialized(),
        "live_after": _c10d.live_group_count(),
    }


def descriptions(rank: int, world_size: int) -> dict[str, Any]:
    """What torch's tools read back as each group's description (``group_desc``)."""
    out: dict[str, Any] = {}
    with mesh3() as mesh:
        out["tp"] = mesh.get_group_along_axis("tp").group_desc  # type: ignore[union-attr]
        out["dp+tp"] = mesh.get_group_along_axis(("tp", "dp")).group_desc  # type: ignore[union-attr]
        ends = mesh.get_group_along_axis("pp", indices_at_axis=[0, -1])
        out["pp ends"] = ends.group_desc if ends is not None else None
    with ProcessGroupMesh(4, 2, timeout=TIMEOUT) as unnamed:
        out["unnamed"] = unnamed.get_group_along_axis(1).group_desc  # type: ignore[union-attr]
    with ProcessGroupMesh(8, names=("x" * 5000,), timeout=TIMEOUT) as long_name:
        out["long"] = long_name.get_group_along_axis(0).group_desc  # type: ignore[union-attr]
    return out


def views(rank: int, world_size: int) -> dict[str, Any]:
    """A dense (dp=4, tp=2) mesh and an expert view (edp=2, ep=2, tp=2) over the same 8 ranks.

    Dense: rank = 2 * dp + tp. Expert: rank = 4 * edp + 2 * ep + tp.
    """
    out: dict[str, Any] = {}
    live0 = _c10d.live_group_count()
    with record_new_groups() as calls:
        dense = ProcessGroupMesh(4, 2, names=("dp", "tp"), timeout=TIMEOUT).__enter__()
        expert = dense.view(2, 2, 2, names=("edp", "ep", "tp")).__enter__()
        out["expert_layout"] = (expert.shape, expert.names, expert.layout.ranks)
        out["expert_coordinate"] = expert.coordinate()
        dense_groups = {axis: dense.get_group_along_axis(axis) for axis in ("dp", "tp")}
        expert_groups = {axis: expert.get_group_along_axis(axis) for axis in ("edp", "ep", "tp")}
        out["made"] = len(calls)  # dp, tp, edp, ep: tp is shared
        out["tp_shared"] = expert_groups["tp"] is dense_groups["tp"]
        out["sums"] = {
            **{f"dense {a}": total(g) for a, g in dense_groups.items() if g is not None},
            **{f"expert {a}": total(g) for a, g in expert_groups.items() if g is not None},
        }
        dense.__exit__(None, None, None)  # the dense side first: the shared tp must stay
        out["dense_closed"] = dense.closed
        out["tp_alive_after_dense"] = _c10d.is_live(expert_groups["tp"])  # type: ignore[arg-type]
        out["dp_destroyed"] = not _c10d.is_live(dense_groups["dp"])  # type: ignore[arg-type]
        out["tp_works_after_dense"] = members(expert_groups["tp"], world_size)
        out["live_after_dense"] = _c10d.live_group_count() - live0  # edp, ep, tp
        out["expert_tp_again"] = expert.get_group_along_axis("tp") is expert_groups["tp"]
        with expert.view(8, names=("world",)) as flat:  # a view of a view: the same table
            out["flat_members"] = members(flat.get_group_along_axis("world"), world_size)
        expert.__exit__(None, None, None)
        out["made_total"] = len(calls)
    out["live_after_both"] = _c10d.live_group_count() - live0
    return out


# Two rank orders DTensor gets handed: a permutation, and the node-aware table of a
# round-robin launch (rank r on node r % 2) that keeps tp inside a node.
ORDERS = {
    "permuted": ((2, 4), (3, 1, 7, 5, 0, 2, 6, 4)),
    "round_robin": ((4, 2), node_aware_ranks((4, 2), [r % 2 for r in range(8)], 1)),
}
DTENSOR_FULL = torch.arange(8 * 4, dtype=torch.float64).reshape(8, 4)
DTENSOR_WEIGHT = torch.arange(4 * 8, dtype=torch.float64).reshape(4, 8) / 10


def dtensor_any_order(rank: int, world_size: int) -> dict[str, Any]:
    """DTensor over meshes whose ranks do not ascend: shards follow coordinates."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # Gathering columns sharded over both axes is two all_gathers, and torch says so
    # (a warning per rank) every time; here it is the point, so it need not be said.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for label, (shape, table) in ORDERS.items():
        layout = MeshLayout(shape, names=("dp", "tp"), ranks=table)
        with ProcessGroupMesh.from_layout(layout, timeout=TIMEOUT) as mesh:
            dm = mesh.to_device_mesh("cpu")
            d = distribute_tensor(DTENSOR_FULL, dm, [Shard(0), Shard(1)])
            x = distribute_tensor(DTENSOR_FULL, dm, [Replicate(), Replicate()])
            w = distribute_tensor(DTENSOR_WEIGHT, dm, [Shard(1), Shard(1)])  # columns over both
            out[label] = {
                "coordinate": mesh.coordinate(),
                "local_rank_dp": mesh.local_rank("dp"),
                "local": d.to_local().tolist(),
                "full": d.full_tensor().tolist(),
                "matmul": torch.mm(x, w).full_tensor().tolist(),
            }
    return out


MESH_CHECKS: list[Check] = [
    membership_3d,
    dtensor_any_order,
    descriptions,
    views,
    world_untouched,
    indices_subsets,
    custom_ranks,
    from_layout,
    lazy_and_cached,
    submeshes,
    close_order,
    skips_destroyed,
    two_meshes,
    exception_propagates,
    closed_mesh,
    resource_warning,
    eager_and_create_groups,
    defaults,
    seed_names,
    global_destroy,  # must stay last: it tears the world down
]


def mesh_world(rank: int, world_size: int) -> dict[str, Any]:
    """Every ProcessGroupMesh check, in one world (rank order is the checks' order)."""
    return run_checks(rank, world_size, MESH_CHECKS)
