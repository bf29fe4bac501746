"""Worker functions for tests/test_reliability.py and tests/test_bad_input.py.

Spawned ranks import these by name, so they live at module top level. A world
costs seconds to start, so each function runs many checks and returns plain
data (dicts of ints, strings and lists) for the test to assert on; a check that
fails is reported, never swallowed.

Run as a script, the module replays a fixed-seed corpus of bad inputs in a
one-rank gloo world and prints a JSON summary; the tests run it under
``python -O``, where ``assert`` statements vanish::

    python -O tests/_workers_reliability.py replay --seed 0 --count 3000
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import json
import math
import os
import random
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh import _c10d
from scopedmesh.errors import GroupFormationError
from scopedmesh.mesh import ProcessGroupMesh

# The exceptions bad input may raise; anything else (or an empty message) is a violation.
ALLOWED = (TypeError, ValueError, KeyError, IndexError)
NAMES = ("dp", "tp")


def rss_kib() -> int:
    """This process's resident set size in KiB, from /proc/self/status (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status")


def live() -> int:
    return _c10d.live_group_count()


def summed(group: dist.ProcessGroup) -> int:
    """All-reduce a one on ``group``: the number of members that took part."""
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


# ================================================================== soak


def soak(rank: int, world_size: int, cycles: int, warmup: int) -> dict[str, Any]:
    """``cycles`` of open -> every axis, a multi-axis group, a sub-mesh group -> close.

    The sub-mesh opens first and owns the groups it makes, so each cycle also
    re-creates a group (tp) in the parent right after the sub-mesh destroyed it.
    Returns the leak count, collective checks and the RSS samples.
    """
    baseline = live()
    leaked = bad_sums = made = 0
    samples: list[tuple[int, int]] = []
    every = max(1, cycles // 20)
    start_rss = rss_kib()
    start_keys = _store_keys()
    started = time.monotonic()
    for cycle in range(cycles):
        if cycle == warmup:
            start_rss = rss_kib()
            start_keys = _store_keys()
            samples.append((cycle, start_rss))
        with ProcessGroupMesh(2, 2, names=NAMES, timeout=60) as mesh:
            with mesh.submesh("tp") as sub:
                g = sub.get_group_along_axis("tp")
                assert g is not None
                bad_sums += summed(g) != 2
                made += 1
            leaked += abs(live() - baseline)
            groups = [mesh.get_group_along_axis(axis) for axis in NAMES]
            groups.append(mesh.get_group_along_axis(NAMES))
            made += len(groups)
            for group, size in zip(groups, (2, 2, 4)):
                assert group is not None
                bad_sums += summed(group) != size
            leaked += abs(live() - (baseline + 3))
        leaked += abs(live() - baseline)
        if cycle >= warmup and (cycle - warmup) % every == 0:
            samples.append((cycle, rss_kib()))
    end_rss = rss_kib()
    samples.append((cycles, end_rss))
    return {
        "rank": rank,
        "cycles": cycles,
        "groups_made": made,
        "leaked": leaked,
        "bad_sums": bad_sums,
        "baseline": baseline,
        "final_live": live(),
        "rss_start_kib": start_rss,
        "rss_end_kib": end_rss,
        "rss_max_kib": max(kib for _, kib in samples),
        "samples": samples,
        "seconds": time.monotonic() - started,
        "tags": len(_torch_world().tags_to_pg),
        "store_keys_added": _store_keys() - start_keys,
    }


def _store_keys() -> int:
    """How many keys the world's TCPStore (hosted by rank 0) holds."""
    from torch.distributed import distributed_c10d as c10d

    return int(c10d._get_default_store().num_keys())


def _torch_world() -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._world


# ================================================================ faults


@contextlib.contextmanager
def _catch(out: dict[str, Any], key: str) -> Iterator[None]:
    """Record an unexpected exception of one section instead of losing the rest."""
    try:
        yield
    except Exception as exc:
        out[key] = {"unexpected": traceback.format_exc(), **_error(exc)}


def _form(mesh: ProcessGroupMesh, axis: Any) -> dict[str, Any]:
    """Request ``axis`` on ``mesh``; return the outcome and how long it took."""
    started = time.monotonic()
    try:
        group = mesh.get_group_along_axis(axis)
    except GroupFormationError as exc:
        return {"seconds": time.monotonic() - started, **_error(exc)}
    return {"seconds": time.monotonic() - started, "sum": summed(group) if group else None}


def ci_world(
    rank: int,
    world_size: int,
    port: int,
    outdir: str,
    soak_cycles: int,
    schedules: int,
    victim: int,
) -> dict[str, Any]:
    """Every CI check in one 4-rank world (a world costs ~10-30 s to start).

    In order: the soak; the faults, exception-safety and misuse sections; the
    independence schedules; ``dist.destroy_process_group()`` inside a scope and a
    new world on ``port``; and last ``victim`` dies inside a scope. The report is
    rewritten to ``outdir/rank<r>.json`` after every section, since the launcher
    raises for the dead rank and so returns nothing.
    """
    out: dict[str, Any] = {"rank": rank, "baseline": live()}
    path = Path(outdir, f"rank{rank}.json")

    def save() -> None:
        path.write_text(json.dumps(out, default=repr))

    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("soak", lambda: soak(rank, world_size, soak_cycles, 5)),
        ("missing", lambda: _missing_member(rank)),
        ("eager_missing", lambda: _eager_missing_member(rank)),
        ("hand_destroyed", lambda: _hand_destroyed(rank)),
        ("exception", lambda: _exception_safety(rank)),
        ("close_fails", lambda: _close_fails(rank)),
        ("misuse", lambda: _misuse(rank)),
        ("collected", lambda: _collected_while_open(rank)),
        ("independence", lambda: independence(rank, world_size, schedules, 12, 0)),
    ]
    for name, section in sections:
        with _catch(out, name):
            out[name] = section()
        out[name + "_live"] = live()
        save()
        dist.barrier()
    with _catch(out, "global_destroy"):
        out["global_destroy"] = _global_destroy(rank, world_size, port)
    save()
    with _catch(out, "death"):
        out["death"] = death(rank, world_size, victim)
    save()
    return out


def _missing_member(rank: int) -> dict[str, Any]:
    """Rank 3 never asks for its tp group, then rank 2 never does; then both do."""
    out: dict[str, Any] = {}
    for phase, absent in (("first", 3), ("second", 2)):
        mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=2.0)
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
    mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=2.0)
    with mesh:
        if rank != 0:
            out["multi"] = _form(mesh, NAMES)
    out["multi_closed"] = mesh.closed
    dist.barrier()
    with ProcessGroupMesh(2, 2, names=NAMES, timeout=10.0) as mesh:
        out["multi_retry"] = _form(mesh, NAMES)
    return out


def _eager_missing_member(rank: int) -> dict[str, Any]:
    """``eager=True`` on every rank but 3: the constructor fails and leaves nothing open."""
    out: dict[str, Any] = {}
    before = live()
    if rank != 3:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.monotonic()
            try:
                ProcessGroupMesh(2, 2, names=NAMES, timeout=2.0, eager=True).close()
                out["outcome"] = "made"
            except GroupFormationError as exc:
                out["outcome"] = _error(exc)
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


def _hand_destroyed(rank: int) -> dict[str, Any]:
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
            out["asked_again"] = _error(exc)
        out["other_group_sum"] = summed(tp)
    out["closed"] = mesh.closed
    out["leaked"] = live() - before
    out["tp_live"] = _c10d.is_live(tp)
    return out


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


def _exception_safety(rank: int) -> dict[str, Any]:
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


def _close_fails(rank: int) -> dict[str, Any]:
    """A destroy that fails during close: the other groups still go; no error is lost."""
    out: dict[str, Any] = {}
    real = _c10d.destroy
    calls: list[int] = []

    def flaky(group: dist.ProcessGroup) -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected destroy failure")
        return real(group)

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
                result = {"raised": _error(exc)}
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


def _misuse(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    before = live()

    def outcome(fn: Callable[[], object]) -> dict[str, str]:
        try:
            fn()
        except Exception as exc:
            return _error(exc)
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


def _collected_while_open(rank: int) -> dict[str, Any]:
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


def _global_destroy(rank: int, world_size: int, port: int) -> dict[str, Any]:
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
        out["raised"] = _error(exc)
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


# ================================================================= death


def death(rank: int, world_size: int, victim: int) -> dict[str, Any]:
    """``victim`` dies inside a scope; the survivors' close() must return promptly."""
    baseline = live()
    report: dict[str, Any] = {"rank": rank, "baseline": baseline}
    mesh = ProcessGroupMesh(2, 2, names=NAMES, timeout=5.0)
    sub = mesh.submesh("tp")
    with mesh:
        groups = [mesh.get_group_along_axis(a) for a in ("dp", NAMES)]
        groups.append(sub.get_group_along_axis("tp"))
        report["inside"] = live() - baseline
        dist.barrier()
        if rank == victim:
            os._exit(17)
        # A survivor notices when a collective with the dead rank fails (bounded by timeout).
        started = time.monotonic()
        try:
            summed(groups[1])  # type: ignore[arg-type]
            report["collective"] = "completed"
        except Exception as exc:
            report["collective"] = _error(exc)
        report["collective_seconds"] = time.monotonic() - started
        close_started = time.monotonic()
    report["close_seconds"] = time.monotonic() - close_started
    report["closed"] = [mesh.closed, sub.closed]
    report["leaked"] = live() - baseline
    return report


def death_world(rank: int, world_size: int, victim: int, outdir: str) -> dict[str, Any]:
    """:func:`death` alone; survivors write their report to ``outdir/rank<r>.json``."""
    report = {"death": death(rank, world_size, victim)}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    return report


# ========================================================== independence


# What each mesh may request: (axis, indices_at_axis).
_REQUESTS: dict[str, list[tuple[Any, Any]]] = {
    "A": [
        ("dp", None),
        ("tp", None),
        (("dp", "tp"), None),
        ("tp", [0]),
        (("dp", "tp"), [[0, 1], [1]]),
    ],
    "B": [("x", None), ("y", None), (("x", "y"), None), ("y", [-1])],
}


def _open(name: str) -> ProcessGroupMesh:
    if name == "A":  # rows [0, 1], [2, 3]
        return ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=30.0)
    # The same ranks in another order: every B group has the ranks of an A group.
    return ProcessGroupMesh(2, 2, names=("x", "y"), ranks=[3, 1, 2, 0], timeout=30.0)


def schedule(seed: int, steps: int) -> list[tuple[str, str, int]]:
    """A random interleaving of open/request/sub-mesh/close for meshes A and B."""
    rng = random.Random(seed)
    is_open = {"A": False, "B": False}
    ops: list[tuple[str, str, int]] = []
    for _ in range(steps):
        name = rng.choice("AB")
        if not is_open[name]:
            ops.append(("open", name, 0))
            is_open[name] = True
            continue
        kind = rng.choices(["request", "sub", "close"], [5, 2, 2])[0]
        ops.append((kind, name, rng.randrange(len(_REQUESTS[name]))))
        if kind == "close":
            is_open[name] = False
    ops += [("close", n, 0) for n in "AB" if is_open[n]]
    return ops


def independence(
    rank: int, world_size: int, schedules: int, steps: int, seed: int
) -> dict[str, Any]:
    """Two meshes over the same ranks, opened and closed in random interleavings."""
    baseline = live()
    lost: list[str] = []
    made = checks = ops_run = 0
    for number in range(schedules):
        meshes: dict[str, ProcessGroupMesh] = {}
        held: dict[str, dict[int, Any]] = {"A": {}, "B": {}}
        for step, (kind, name, which) in enumerate(schedule(seed * 100_003 + number, steps)):
            ops_run += 1
            where = f"schedule {number} step {step} {kind} {name}"
            if kind == "open":
                meshes[name] = _open(name)
                held[name] = {}
            elif kind == "request":
                axis, indices = _REQUESTS[name][which]
                before = live()
                group = meshes[name].get_group_along_axis(axis, indices_at_axis=indices)
                made += live() - before
                held[name].setdefault(which, group)
                if held[name][which] is not group:
                    lost.append(f"{where}: a second request returned another group")
            elif kind == "sub":
                axis = _REQUESTS[name][which][0]
                first = axis if isinstance(axis, str) else axis[0]
                with meshes[name].submesh(first) as sub:
                    group = sub.get_group_along_axis(first)
                    if group is not None:
                        checks += 1
                        if summed(group) != len(sub.get_ranks_in_group(group)):
                            lost.append(f"{where}: the sub-mesh group failed")
            else:
                mesh = meshes.pop(name)
                mesh.close()
                for group in held[name].values():
                    if group is not None and _c10d.is_live(group):
                        lost.append(f"{where}: a closed mesh's group is still live")
                held[name] = {}
            # The other mesh never loses a group: still registered, still working.
            for other in meshes:
                for key, group in held[other].items():
                    if group is None:
                        continue
                    if not _c10d.is_live(group):
                        lost.append(f"{where}: mesh {other} lost group {key}")
                        continue
                    if kind in ("close", "sub", "open"):
                        checks += 1
                        if summed(group) != len(dist.get_process_group_ranks(group)):
                            lost.append(f"{where}: mesh {other} group {key} failed a collective")
        if live() != baseline:
            lost.append(f"schedule {number}: {live() - baseline} groups left after both closed")
    return {
        "rank": rank,
        "schedules": schedules,
        "ops": ops_run,
        "groups_made": made,
        "collective_checks": checks,
        "lost": lost,
        "final_live": live() - baseline,
    }


# ===================================================== bad input: shared


def outcome_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any, str]:
    """``("ok", result, "")``, ``("rejected", TypeName, message)`` or ``("violation", ...)``.

    A violation is an exception outside :data:`ALLOWED`, or one with an empty message.
    """
    try:
        result = fn(*args, **kwargs)
    except ALLOWED as exc:
        message = str(exc).strip("'\" ")
        if not message:
            return ("violation", type(exc).__name__, "empty message")
        return ("rejected", type(exc).__name__, message)
    except Exception as exc:
        return ("violation", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    return ("ok", result, "")


class Tally:
    """Counts of outcomes per entry point, and the first violations in full."""

    def __init__(self) -> None:
        self.tried = 0
        self.rejected = 0
        self.accepted = 0
        self.by_type: dict[str, int] = {}
        self.violations: dict[str, str] = {}

    def add(self, entry: str, outcome: tuple[str, Any, str], inputs: str) -> Any:
        self.tried += 1
        kind, value, message = outcome
        if kind == "ok":
            self.accepted += 1
            return value
        if kind == "rejected":
            self.rejected += 1
            self.by_type[value] = self.by_type.get(value, 0) + 1
            return None
        key = f"{entry}: {value}"
        self.violations.setdefault(key, f"{inputs}\n{message}")
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "tried": self.tried,
            "rejected": self.rejected,
            "accepted": self.accepted,
            "by_type": self.by_type,
            "violations": self.violations,
        }


def public_methods(cls: type) -> list[str]:
    """The public methods of ``cls``, plus ``__getitem__``; scope methods left out."""
    skip = {"close", "destroy_mesh_process_groups"}
    names = [
        n
        for n, v in vars(cls).items()
        if (not n.startswith("_") or n == "__getitem__")
        and n not in skip
        and (inspect.isfunction(v) or isinstance(v, staticmethod))
    ]
    return sorted(names)


def arity(cls: type, name: str) -> tuple[int, int, list[str], bool]:
    """(required positional, total positional, keyword-only names, has *args) of a method."""
    fn = inspect.unwrap(getattr(cls, name))
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    star = any(p.kind == p.VAR_POSITIONAL for p in params)
    return required, len(positional), keywords, star


# ======================================================= mesh fuzzing


def fuzz_mesh(rank: int, world_size: int, max_examples: int, seed: int) -> dict[str, Any]:
    """Hypothesis-driven bad input for ProcessGroupMesh in a one-rank world.

    Every constructor argument and every public method get junk mixed with valid
    values; a mesh that gets made is closed, and no group may outlive it.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    tally = Tally()
    leaks: list[str] = []
    baseline = live()
    junk = junk_strategy(st)
    methods = public_methods(ProcessGroupMesh)

    valid_shape = st.sampled_from([(1,), ((1,),), (1, 1), (-1,), ([1, 1],), (1, -1, 1)])
    junk_shape = st.one_of(st.lists(junk, max_size=3).map(tuple), st.tuples(junk))
    bad_backends = st.sampled_from(["nccl", "mpi", "ucc", "xccl", "bogus", "", "gloo,nccl"])
    valid_kwargs: dict[str, Any] = {
        "ranks": st.sampled_from([[0], range(1), (0,)]),
        "backend": st.sampled_from(["gloo", "GLOO", "cpu:gloo"]),
        "timeout": st.sampled_from([5, 2.5, timedelta(seconds=5), 10**6]),
        "pg_options": st.none(),
        "eager": st.booleans(),
    }
    bad_kwargs: dict[str, Any] = {
        "backend": st.one_of(junk, bad_backends),
        "timeout": st.one_of(junk, st.sampled_from([timedelta.max, 10**20, -1, 0])),
    }
    call_st = st.lists(
        st.tuples(st.sampled_from(methods), st.lists(junk, max_size=4), st.integers(0, 4)),
        max_size=6,
    )

    @hseed(seed)
    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data(), calls=call_st)
    def run(data: Any, calls: list[Any]) -> None:
        def corrupt() -> bool:  # one argument in five is bad: most meshes get made
            return bool(data.draw(st.integers(0, 4)) == 0)

        shape = data.draw(junk_shape if corrupt() else valid_shape)
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape
        kwargs: dict[str, Any] = {}
        if data.draw(st.booleans()):
            ndim = len(dims) if isinstance(dims, (list, tuple)) else 1
            names = st.just(("dp", "tp", "pp", "cp")[:ndim])
            kwargs["names"] = data.draw(junk if corrupt() else names)
        for key, valid in valid_kwargs.items():
            if data.draw(st.booleans()):
                kwargs[key] = data.draw(bad_kwargs.get(key, junk) if corrupt() else valid)
        inputs = f"ProcessGroupMesh(*{shape!r}, **{kwargs!r})"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = tally.add(
                "ProcessGroupMesh()", outcome_of(ProcessGroupMesh, *shape, **kwargs), inputs
            )
        if mesh is None:
            gc.collect()
            if live() != baseline:
                leaks.append(f"{inputs} left {live() - baseline} groups")
                _destroy_all_but_world()
            return
        valid_pool = data
        with mesh:
            for name, args, valid_count in calls:
                args = _mix_valid(mesh, args, valid_count, valid_pool)
                required, total, _keywords, star = arity(ProcessGroupMesh, name)
                if not star:
                    args = args[:total]
                    if len(args) < required:
                        args += [0] * (required - len(args))
                fn = getattr(mesh, name)
                tally.add(
                    f"ProcessGroupMesh.{name}",
                    outcome_of(fn, *args),
                    f"{inputs}.{name}(*{args!r})",
                )
        if live() != baseline:
            leaks.append(f"{inputs} and {calls!r} left {live() - baseline} groups after close")
            _destroy_all_but_world()

    run()
    return {
        "rank": rank,
        **tally.as_dict(),
        "leaks": leaks,
        "final_live": live() - baseline,
        "regressions": _regressions(),
    }


def _regressions() -> dict[str, Any]:
    """Inputs the fuzzing found mishandled, replayed as plain checks (one-rank world)."""

    def kind(fn: Callable[[], object]) -> str:
        outcome = outcome_of(fn)
        return (
            outcome[0] if outcome[0] == "ok" else f"{outcome[0]} {outcome[1]}: {outcome[2][:200]}"
        )

    out: dict[str, Any] = {}
    with ProcessGroupMesh(1, 1, names=NAMES) as mesh:
        mesh.get_group_along_axis(1)
        mesh.get_group_along_axis((0, 1))
        # Cached under 1 and (0, 1): equal-but-wrong keys must still be rejected.
        out["float_axis_after_cache"] = kind(lambda: mesh.get_group_along_axis(1.0))  # type: ignore[arg-type]
        out["bool_in_axes_after_cache"] = kind(lambda: mesh.get_group_along_axis((0, True)))
        out["float_in_axes_after_cache"] = kind(lambda: mesh.get_group_along_axis((0, 1.0)))  # type: ignore[arg-type]
        out["per_call_backend_bogus"] = kind(lambda: mesh.get_group_along_axis(0, backend="bogus"))
        out["per_call_backend_nccl"] = kind(lambda: mesh.get_group_along_axis(0, backend="nccl"))
    for name, kwargs in {
        "backend_bogus": {"backend": "bogus"},
        "backend_nccl": {"backend": "nccl"},
        "backend_mpi": {"backend": "mpi"},
        "timeout_inf": {"timeout": float("inf")},
        "timeout_nan": {"timeout": float("nan")},
        "timeout_huge_number": {"timeout": 10**20},
        "timeout_timedelta_max": {"timeout": timedelta.max},
    }.items():
        out[name] = kind(lambda kwargs=kwargs: ProcessGroupMesh(1, eager=True, **kwargs).close())  # type: ignore[misc]
    out["backend_gloo_qualified"] = kind(
        lambda: ProcessGroupMesh(1, backend="cpu:gloo", eager=True).close()
    )
    out["timeout_200_years"] = kind(
        lambda: ProcessGroupMesh(1, timeout=timedelta(days=73_000), eager=True).close()
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["eager_not_bool"] = kind(lambda: ProcessGroupMesh(1, eager="yes"))  # type: ignore[arg-type]
        gc.collect()
    out["eager_not_bool_warnings"] = [str(w.message) for w in caught]
    return out


def _mix_valid(mesh: ProcessGroupMesh, args: list[Any], count: int, data: Any) -> list[Any]:
    """Replace the first ``count`` junk arguments with values valid for ``mesh``."""
    from hypothesis import strategies as st

    ndim = len(mesh.shape)
    valid = [
        st.integers(-ndim, max(ndim - 1, 0)),
        st.just(tuple(range(ndim))),
        st.just(mesh.coordinate()),
        st.just([0]),
        st.just("gloo"),
        st.just("cpu"),
    ]
    if mesh.names:
        valid.append(st.sampled_from(mesh.names))
        valid.append(st.just(tuple(mesh.names)))
    valid_st = st.one_of(*valid)
    out = list(args)
    for i in range(min(count, len(out))):
        out[i] = data.draw(valid_st)
    return out


def _destroy_all_but_world() -> None:
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)


def junk_strategy(st: Any) -> Any:
    """Values of every kind a caller might pass by mistake, and some valid ones."""
    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 5),
        st.integers(),
        st.floats(),
        st.text(max_size=3),
        st.binary(max_size=2),
        st.sampled_from(
            ["dp", "tp", "pp", "x", "", "0", "gloo", "nccl", "cpu", "raise", "wrap", "clip"]
        ),
        st.sampled_from([slice(None), slice(0, 1), slice(None, None, 0), slice("a"), Ellipsis]),
        st.sampled_from([float("inf"), float("nan"), -0.0, 10**30, -(10**30), 2**63]),
        st.sampled_from(
            [object(), range(2), range(0), range(5, -1, -1), timedelta(0), timedelta(-1)]
        ),
        st.sampled_from([torch.tensor(1), torch.tensor([0, 1]), 1 + 2j]),
    )
    return st.one_of(
        scalar,
        st.lists(scalar, max_size=3),
        st.lists(st.integers(-2, 4), max_size=4),
        st.lists(st.integers(-2, 4), max_size=3).map(tuple),
        st.lists(st.lists(st.integers(-2, 3), max_size=3), max_size=3),
        st.lists(st.sampled_from(["dp", "tp", "x"]), max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["dp", "tp", 0, 1]), st.integers(-2, 3), max_size=2),
        st.sets(st.integers(0, 3), max_size=3),
    )


# ================================================== the -O corpus replay

# A fixed pool: the corpus draws from it with random.Random(seed), so a seed names a corpus.
POOL: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 10**20, -(10**20), 2**63, 1.0, 1.5, -0.0,
    float("nan"), float("inf"), 1j, "", "dp", "tp", "pp", "x", "0", "gloo", "nccl", "mpi",
    "cuda", "cpu", "raise", "wrap", "clip", b"dp", [], [0], [0, 0], [1, 0], [-1], [0, 1, 2],
    [[0]], [[0, 1], [1]], [["dp"]], (), (0,), (1,), (0, 1), (-1,), (1, 1), (-1, -1), ("dp",),
    ("dp", "dp"), ("dp", "tp"), (0, "dp"), (True,), (1.0,), (None,), {"dp": 0}, {}, {0: 0},
    {"zz": 1}, {0, 1}, slice(None), slice(0, 0), slice(None, None, 0), slice(0.5), Ellipsis,
    (Ellipsis, Ellipsis), range(1), range(0), range(3, -1, -1), timedelta(0),
    timedelta(seconds=-1), timedelta.max, object(), print, ProcessGroupMesh,
]  # fmt: skip


def corpus(seed: int, count: int) -> Iterator[tuple[str, list[Any]]]:
    """``count`` (entry point, arguments) pairs drawn from :data:`POOL` with ``seed``."""
    from scopedmesh.layout import MeshLayout

    rng = random.Random(seed)
    layout_methods = public_methods(MeshLayout)
    mesh_methods = public_methods(ProcessGroupMesh)
    entries = (
        ["MeshLayout"] * 3
        + [f"MeshLayout.{m}" for m in layout_methods]
        + ["ProcessGroupMesh"] * 3
        + [f"ProcessGroupMesh.{m}" for m in mesh_methods]
        + ["cli"] * 3
        + ["layout_of", "to_device_mesh"]
    )
    for _ in range(count):
        entry = rng.choice(entries)
        args = [rng.choice(POOL) for _ in range(rng.randrange(0, 5))]
        yield entry, args


CLI_TOKENS = [
    "plan", "2", "3", "-1", "0", "1", "64", "2147483648", "99999999999999999999", "-5", "x",
    "", " ", "--names", "dp", "tp", "dp,tp", "dp,dp", "--world", "--axis", "--rank",
    "--nproc-per-node", "--json", "--full", "--help", "--bogus", "--", "-", ",", "1.5",
    "tp,x", "--names=", "--world=8", "--axis=0,1", "\u00e9", "\x00",
]  # fmt: skip


def cli_argv(rng: random.Random) -> list[str]:
    """A ``plan`` command line: well formed, or (half the time) with bad values or tokens."""
    bad = rng.random() < 0.5
    sizes = [rng.choice(["1", "2", "3", "4", "8"]) for _ in range(rng.randint(1, 3))]
    world = str(math.prod(int(n) for n in sizes))
    if rng.random() < 0.3:
        sizes[rng.randrange(len(sizes))] = "-1"
    argv = ["plan", *sizes]
    last = int(world) - 1
    options = {
        "--names": (["dp", "pp", "tp"][: len(sizes)], ["dp", "x", "y", "z"][: len(sizes) + 1]),
        "--world": ([world], [rng.choice(["0", "x", "7", "-8"])]),
        "--axis": (
            [rng.choice(["0", "-1", f"0,{len(sizes) - 1}"])],
            [rng.choice(["5", "dp,dp", "", "q"])],
        ),
        "--rank": ([str(rng.randint(0, last))], [rng.choice(["-1", str(last + 1), "x"])]),
        "--nproc-per-node": ([rng.choice(["1", "2", "4", "8"])], [rng.choice(["0", "-2", "x"])]),
        "--json": ([], []),
        "--full": ([], []),
    }
    for option, (good, poor) in options.items():
        if rng.random() < 0.4 or (option == "--world" and "-1" in sizes):
            argv += [option, *(poor if bad and rng.random() < 0.3 else good)]
    for _ in range(rng.choice([0, 1, 2, 3]) if bad else 0):
        token = rng.choice(CLI_TOKENS)
        at = rng.randrange(len(argv) + 1)
        kind = rng.choice(["insert", "replace", "delete"])
        if kind == "insert" or at == len(argv):
            argv.insert(at, token)
        elif kind == "replace":
            argv[at] = token
        else:
            del argv[at]
    if "--full" in argv and any(len(t) > 2 and t.lstrip("-").isdigit() for t in argv):
        argv.remove("--full")  # --full on a huge world lists every rank: asked for, not bad
    return argv


def replay(seed: int, count: int) -> dict[str, Any]:
    """Run the corpus against a one-rank gloo world; needs no pytest and no hypothesis."""
    from scopedmesh.cli import main
    from scopedmesh.interop import layout_of, to_device_mesh
    from scopedmesh.layout import MeshLayout
    from scopedmesh.testing import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    tally = Tally()
    rng = random.Random(seed ^ 0x5EED)
    baseline = live()
    leaks = 0
    layout = MeshLayout((2, 3), names=("dp", "tp"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for entry, args in corpus(seed, count):
                inputs = f"{entry}(*{args!r})"
                if entry == "MeshLayout":
                    tally.add(entry, outcome_of(MeshLayout, *args[:3]), inputs)
                elif entry.startswith("MeshLayout."):
                    method = getattr(layout, entry.split(".", 1)[1])
                    tally.add(entry, outcome_of(method, *args), inputs)
                elif entry == "ProcessGroupMesh":
                    positional = args[: rng.randrange(0, 3)]
                    kwargs = {
                        k: rng.choice(POOL)
                        for k in ("names", "ranks", "backend", "timeout", "pg_options", "eager")
                        if rng.random() < 0.3
                    }
                    mesh = tally.add(
                        entry,
                        outcome_of(ProcessGroupMesh, *positional, **kwargs),
                        f"ProcessGroupMesh(*{positional!r}, **{kwargs!r})",
                    )
                    if mesh is not None:
                        mesh.close()
                elif entry.startswith("ProcessGroupMesh."):
                    with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
                        method = getattr(mesh, entry.split(".", 1)[1])
                        tally.add(entry, outcome_of(method, *args), inputs)
                elif entry == "cli":
                    argv = cli_argv(rng)
                    tally.add(entry, cli_outcome(main, argv), f"main({argv!r})")
                elif entry == "layout_of":
                    tally.add(entry, outcome_of(layout_of, *args[:1]), inputs)
                else:
                    with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
                        tally.add(entry, outcome_of(to_device_mesh, mesh, *args[:2]), inputs)
                if live() != baseline:
                    leaks += 1
                    _destroy_all_but_world()
    finally:
        dist.destroy_process_group()
    return {
        "optimize": sys.flags.optimize,
        "asserts_run": _asserts_run(),
        "seed": seed,
        "leaks": leaks,
        **tally.as_dict(),
    }


def _asserts_run() -> bool:
    try:
        assert False  # noqa: B011 -- tells whether this interpreter runs asserts
    except AssertionError:
        return True
    return False


def cli_outcome(main: Callable[[list[str]], int], argv: list[str]) -> tuple[str, Any, str]:
    """Run the CLI: it must return 0, 1 or 2, and explain a 2 on stderr in one line."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    except BaseException as exc:
        return ("violation", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    if status == 2:
        text = err.getvalue()
        if not text.strip() or "error:" not in text or "Traceback" in text:
            return ("violation", "bad usage message", repr(text))
        return ("rejected", "usage error (exit 2)", text.strip())
    if status == 0:
        return ("ok", status, "")
    return ("violation", f"exit status {status!r}", err.getvalue())


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    play = commands.add_parser("replay", help="replay the fixed-seed bad-input corpus")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--count", type=int, default=3000)
    args = parser.parse_args(argv)
    print(json.dumps(replay(args.seed, args.count)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
