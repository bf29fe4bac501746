"""One run of one case; :mod:`benchmarks.run` runs each in a fresh process (``run_forked``).

setup: the mesh and this rank's group along every axis (``fake`` backend, rank
world/2). lookup: a cached group lookup. submesh: a sub-mesh over ("pp", "tp").
real: a gloo world over loopback, every approach in turn. coldstart: a new
interpreter, ``import scopedmesh``, the first mesh and its groups.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import tracemalloc
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks import approaches
from benchmarks.harness import copy_seconds, count_group_creations, init_fake, ns_per_call

__all__ = ["coldstart", "lookup", "real", "setup", "submesh"]


def _timed_setup(impl: str, shape: Sequence[int], names: Sequence[str]) -> tuple[float, Any]:
    """One construction on a fresh world: seconds, and what torch's helper saw."""
    rank, keep = math.prod(shape) // 2, impl == "scopedmesh"
    init_fake(math.prod(shape), rank)
    with count_group_creations(keep_members=keep) as counts, warnings.catch_warnings(record=True) as caught:  # fmt: skip
        warnings.simplefilter("always")
        start = time.perf_counter()
        handle, groups = approaches.build(impl, shape, names)
        seconds = time.perf_counter() - start
    for axis, group in enumerate(groups):  # every group against an independent reference
        got = None if group is None else sorted(dist.get_process_group_ranks(group))
        if got != approaches.members(shape, rank, axis):
            raise RuntimeError(f"{impl}, axis {axis}: wrong group ranks {str(got)[:60]}")
    counts.update(warnings=sorted({f"{w.category.__name__}: {w.message}" for w in caught}))
    counts.update(copy_seconds=copy_seconds(counts.pop("members"))) if keep else counts.pop("members")  # fmt: skip
    approaches.close(impl, handle)
    return seconds, counts


def setup(impl: str, shape: Sequence[int], names: Sequence[str], *, memory: bool, memory_max: float) -> Any:  # fmt: skip
    """Setup time, group-creation counts and (if ``memory``) peak Python memory.

    After a warm-up on a tiny world, the construction is timed on a fresh world
    up to 3 times while under 1 s in all; the fastest is the figure. Memory is
    traced in another pass, unless the timed one took over ``memory_max`` s.
    """
    small = (1, *shape[1:])
    init_fake(math.prod(small), 0)
    approaches.close(impl, approaches.build(impl, small, names)[0])
    tries = [_timed_setup(impl, shape, names)]
    while len(tries) < 3 and sum(t for t, _ in tries) < 1.0:
        tries.append(_timed_setup(impl, shape, names))
    if len({(c["helper_calls"], c["groups_registered"]) for _, c in tries}) > 1:
        raise RuntimeError(f"group-creation counts differ between repetitions: {tries}")
    seconds, counts = min(tries, key=lambda t: t[0])
    world = math.prod(shape)
    result = {"seconds": seconds, "inner_seconds": [t for t, _ in tries], **counts}
    result.update(requested_groups=len(shape), all_groups=sum(world // n for n in shape))
    if memory and seconds > memory_max:
        result["memory_skipped"] = f"the timed pass took {seconds:.1f} s > {memory_max:g} s"
    elif memory:
        init_fake(world, world // 2)
        tracemalloc.start()
        handle, _ = approaches.build(impl, shape, names)
        result["retained_bytes"], result["peak_bytes"] = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        approaches.close(impl, handle)
    return result


LOOKUPS = {
    "scopedmesh": "mesh.get_group_along_axis(axis)",
    "devicemesh": "mesh.get_group(axis)",
    "naive": "mesh.get_group_along_axis(index)",
    "dict": "groups[axis]",
}


def lookup(impl: str, shape: Sequence[int], names: Sequence[str], **timed: Any) -> Any:
    """ns per cached lookup of this rank's group along the last axis (``tp``)."""
    init_fake(math.prod(shape), math.prod(shape) // 2)
    built = "scopedmesh" if impl == "dict" else impl
    mesh, groups = approaches.build(built, shape, names)
    space = {"mesh": mesh, "axis": names[-1], "index": len(names) - 1}
    space["groups"], stmt = dict(zip(names, groups)), LOOKUPS[impl]
    if eval(stmt, space) is not groups[-1]:
        raise RuntimeError(f"{stmt} did not return the cached group")
    ns = ns_per_call(stmt, space, **timed)
    approaches.close(built, mesh)
    return {"ns_per_call": ns, "stmt": stmt}


def _open_submeshes_ns(shape: Sequence[int], names: Sequence[str], min_time: float, repeat: int) -> float:  # fmt: skip
    """ns per ``mesh.submesh("pp", "tp")`` left open, each loop on a fresh mesh closed after it."""
    from scopedmesh.mesh import ProcessGroupMesh

    def loop(number: int) -> float:
        parent = ProcessGroupMesh(*shape, names=names)
        start = time.perf_counter()
        for _ in range(number):
            parent.submesh(*names[-2:])
        seconds = time.perf_counter() - start
        parent.close()
        return seconds / number

    number = max(100, min(5000, int(min_time / max(loop(100), 1e-9))))
    return min(loop(number) for _ in range(repeat)) * 1e9


def submesh(impl: str, shape: Sequence[int], names: Sequence[str], **timed: Any) -> Any:
    """A sub-mesh over the last two axes: the first call, and ns per later call.

    ``ns_per_call`` is scopedmesh's ``mesh.submesh(...)`` (left open) or DeviceMesh's
    ``mesh[...]``; for scopedmesh ``scope_ns_per_call`` adds ``.close()`` and
    ``slice_ns_per_call`` is its ``mesh[...]``.
    """
    init_fake(math.prod(shape), math.prod(shape) // 2)
    mesh, _ = approaches.build(impl, shape, names)
    space = {"mesh": mesh, "axes": tuple(names[-2:])}
    start = time.perf_counter()
    first = mesh.submesh(*names[-2:]) if impl == "scopedmesh" else mesh[space["axes"]]
    first_seconds = time.perf_counter() - start
    if tuple(first.shape) != tuple(shape[-2:]):
        raise RuntimeError(f"sub-mesh shape {first.shape}, expected {tuple(shape[-2:])}")
    if impl == "scopedmesh":
        first.close()
    slice_ns = ns = scope_ns = ns_per_call("mesh[axes]", space, **timed)
    if impl == "scopedmesh":
        ns = _open_submeshes_ns(shape, names, **timed)
        scope_ns = ns_per_call("mesh.submesh(*axes).close()", space, **timed)
    approaches.close(impl, mesh)
    result = {"first_seconds": first_seconds, "ns_per_call": ns, "slice_ns_per_call": slice_ns}
    return {**result, "scope_ns_per_call": scope_ns}


def real(shape: Sequence[int], names: Sequence[str], *, rotate: int, timeout: float) -> Any:
    """Every approach in one gloo world, in an order rotated by ``rotate``; max over ranks."""
    from scopedmesh.testing import run_world

    order = approaches.APPROACHES[rotate % 4 :] + approaches.APPROACHES[: rotate % 4]
    args = (tuple(shape), tuple(names), order)
    per_rank = run_world(approaches.measure, math.prod(shape), args=args, timeout=timeout)
    seconds = {impl: max(r[impl] for r in per_rank) for impl in order}
    return {"order": order, "seconds": seconds, "per_rank": per_rank}


COLD = """
import json, math, sys, time
import torch, torch.distributed as dist, torch.testing._internal.distributed.fake_pg
from torch._C._distributed_c10d import HashStore
from benchmarks.approaches import members
impl, shape, names = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], sys.argv[3].split(",")
torch.set_num_threads(1)
rank = math.prod(shape) // 2
dist.init_process_group("fake", store=HashStore(), rank=rank, world_size=math.prod(shape))
times = [time.perf_counter()]
if impl == "scopedmesh":
    import scopedmesh
    times.append(time.perf_counter())
    mesh = scopedmesh.ProcessGroupMesh(*shape, names=names)
    times.append(time.perf_counter())
    for name in names:
        mesh.get_group_along_axis(name)
        times.append(time.perf_counter())
else:  # the floor: nothing to import or construct, public member-only new_group per group
    times += [times[0]] * 2
    for axis in range(len(shape)):
        dist.new_group(members(shape, rank, axis), use_local_synchronization=True)
        times.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(times, times[1:])]))
"""


def coldstart(impl: str, shape: Sequence[int], names: Sequence[str]) -> Any:
    """A new interpreter with torch.distributed imported: import, first mesh, each group (s)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    argv = [sys.executable, "-c", COLD, impl, ",".join(map(str, shape)), ",".join(names)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=True)
    steps = json.loads(done.stdout.splitlines()[-1])
    result = {"seconds": sum(steps), "import_seconds": steps[0], "construct_seconds": steps[1]}
    return {**result, **{f"group{i}_seconds": s for i, s in enumerate(steps[2:], 1)}}
