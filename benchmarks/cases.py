"""The approaches, and the cases that measure them (one run each, in a fresh process).

Each approach gives this rank's group along every axis: scopedmesh; DeviceMesh;
naive, ColossalAI's classic mesh (every rank makes and caches every group); the
floor, member-only ``new_group`` for the same groups as the mesh, no mesh.

>>> members((2, 2, 2), 5, 0), members((2, 2, 2), 5, 2)
([1, 5], [4, 5])
"""

from __future__ import annotations

import compileall
import itertools
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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.harness import copy_seconds, count_group_creations, init_fake, ns_per_call
from scopedmesh import ProcessGroupMesh
from scopedmesh.testing import run_world

__all__ = [
    "build",
    "close",
    "coldstart",
    "lookup",
    "measure",
    "members",
    "real",
    "setup",
    "submesh",
]

APPROACHES = ("scopedmesh", "devicemesh", "naive", "floor")
Shape, Names = Sequence[int], Sequence[str]


def members(shape: Shape, rank: int, axis: int) -> list[int]:
    """The C-order group of ``rank`` along ``axis``: a reference independent of scopedmesh."""
    stride = math.prod(shape[axis + 1 :])
    base = rank - (rank // stride) % shape[axis] * stride
    return [base + i * stride for i in range(shape[axis])]


class NaiveMesh:
    """Every rank creates every group along an axis; a lookup recomputes this rank's ranks."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape, self.rank = tuple(shape), dist.get_rank()
        self.strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
        self.ranks_to_group: dict[tuple[int, ...], Any] = {}  # non-members cache torch's marker

    def get_group_along_axis(self, axis: int) -> Any:
        ranks = tuple(members(self.shape, self.rank, axis))
        if ranks not in self.ranks_to_group:
            others = [range(n) if a != axis else range(1) for a, n in enumerate(self.shape)]
            for coord in itertools.product(*others):
                group = members(self.shape, sum(map(math.prod, zip(coord, self.strides))), axis)
                self.ranks_to_group[tuple(group)] = dist.new_group(group)
        return self.ranks_to_group[ranks]


def build(impl: str, shape: Shape, names: Names) -> tuple[Any, list[Any]]:
    """A handle to keep alive and this rank's group along each axis, made by ``impl``."""
    if impl == "scopedmesh":
        mesh = ProcessGroupMesh(*shape, names=names)
        return mesh, [mesh.get_group_along_axis(name) for name in names]
    if impl == "devicemesh":
        device_mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        return device_mesh, [device_mesh.get_group(name) for name in names]
    axes = range(len(shape))
    if impl == "naive":
        naive = NaiveMesh(shape)
        return naive, [naive.get_group_along_axis(axis) for axis in axes]
    if impl == "floor":
        floor = [members(shape, dist.get_rank(), axis) for axis in axes]
        floor = [dist.new_group(ranks, use_local_synchronization=True) for ranks in floor]
        return floor, floor
    raise ValueError(f"unknown approach {impl!r}; known: {APPROACHES}")


def close(impl: str, handle: Any) -> None:
    """Release what ``build`` made, where the approach can (DeviceMesh never destroys)."""
    if impl == "scopedmesh":
        handle.close()
    for group in handle if impl == "floor" else ():
        dist.destroy_process_group(group)


def measure(rank: int, world: int, shape: Shape, names: Names, order: Names) -> dict[str, Any]:
    """Case (d) on each rank: seconds from a barrier until each group's first all_reduce is done,
    then seconds per all_reduce of one float on them (200 rounds). The approaches run one after
    another in ``order``, each after a barrier; imports done, WORLD's connections warmed first.
    """
    torch.set_num_threads(1)
    dist.all_reduce(torch.ones(1))
    seconds: dict[str, dict[str, float]] = {}
    handles = []
    for impl in order:
        dist.barrier()
        start = time.perf_counter()
        handles.append((impl, build(impl, shape, names)))
        sums = [torch.ones(1) for _ in shape]
        for value, group in zip(sums, handles[-1][1][1]):
            dist.all_reduce(value, group=group)
        seconds[impl] = {"seconds": time.perf_counter() - start}
        if [v.item() for v in sums] != [float(n) for n in shape]:
            raise RuntimeError(f"{impl}: all_reduce sums {sums}, expected group sizes {shape}")
        start = time.perf_counter()
        for group in handles[-1][1][1] * 200:
            dist.all_reduce(sums[0], op=dist.ReduceOp.MAX, group=group)
        seconds[impl]["collective_seconds"] = (time.perf_counter() - start) / (200 * len(shape))
    dist.barrier()
    for impl, (handle, _) in reversed(handles):
        close(impl, handle)
    return seconds


def _timed_setup(impl: str, shape: Shape, names: Names) -> tuple[float, Any]:
    """One construction on a fresh world: seconds, and what torch's helper saw."""
    rank, keep = math.prod(shape) // 2, impl == "scopedmesh"
    init_fake(math.prod(shape), rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with count_group_creations(keep_members=keep) as counts:
            start = time.perf_counter()
            handle, groups = build(impl, shape, names)
            seconds = time.perf_counter() - start
    for axis, group in enumerate(groups):  # every group against an independent reference
        got = None if group is None else sorted(dist.get_process_group_ranks(group))
        if got != members(shape, rank, axis):
            raise RuntimeError(f"{impl}, axis {axis}: wrong group ranks {str(got)[:60]}")
    counts["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    lists = counts.pop("members")
    if keep:
        counts["copy_seconds"] = copy_seconds(lists)
    close(impl, handle)
    return seconds, counts


def setup(impl: str, shape: Shape, names: Names, *, memory: bool, memory_max: float) -> Any:
    """(a): after a warm-up, the fastest of up to 3 constructions (while under 1 s in all)."""
    small = (1, *shape[1:])
    init_fake(math.prod(small), 0)
    close(impl, build(impl, small, names)[0])
    tries = [_timed_setup(impl, shape, names)]
    while len(tries) < 3 and sum(t for t, _ in tries) < 1.0:
        tries.append(_timed_setup(impl, shape, names))
    if len({(c["helper_calls"], c["groups_registered"]) for _, c in tries}) > 1:
        raise RuntimeError(f"group-creation counts differ between repetitions: {tries}")
    seconds, counts = min(tries, key=lambda t: t[0])
    result = {"seconds": seconds, "inner_seconds": [t for t, _ in tries], **counts}
    result["requested_groups"] = len(shape)
    if memory and seconds <= memory_max:  # tracing would take about ten times as long
        init_fake(math.prod(shape), math.prod(shape) // 2)
        tracemalloc.start()
        handle, _ = build(impl, shape, names)
        result["retained_bytes"], result["peak_bytes"] = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        close(impl, handle)
    return result


LOOKUPS = {"scopedmesh": "mesh.get_group_along_axis(axis)", "devicemesh": "mesh.get_group(axis)"}
LOOKUPS |= {"naive": "mesh.get_group_along_axis(index)", "dict": "groups[axis]"}


def lookup(impl: str, shape: Shape, names: Names, **timed: Any) -> Any:
    """(b): ns per cached lookup of this rank's group along the last axis (``tp``)."""
    init_fake(math.prod(shape), math.prod(shape) // 2)
    built = "scopedmesh" if impl == "dict" else impl
    mesh, groups = build(built, shape, names)
    space = {"mesh": mesh, "axis": names[-1], "index": len(names) - 1}
    space["groups"], stmt = dict(zip(names, groups)), LOOKUPS[impl]
    if eval(stmt, space) is not groups[-1]:
        raise RuntimeError(f"{stmt} did not return the cached group")
    ns = ns_per_call(stmt, space, **timed)
    close(built, mesh)
    return {"ns_per_call": ns, "stmt": stmt}


def submesh(impl: str, shape: Shape, names: Names, **timed: Any) -> Any:
    """(c): ``mesh.submesh("pp", "tp")`` left open, each loop on a fresh mesh; ``mesh[...]``."""
    init_fake(math.prod(shape), math.prod(shape) // 2)
    mesh, _ = build(impl, shape, names)
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

        def loop(number: int) -> float:
            parent = ProcessGroupMesh(*shape, names=names)
            start = time.perf_counter()
            for _ in range(number):
                parent.submesh(*names[-2:])
            seconds = time.perf_counter() - start
            parent.close()
            return seconds / number

        number = max(100, min(5000, int(timed["min_time"] / max(loop(100), 1e-9))))
        ns = min(loop(number) for _ in range(timed["repeat"])) * 1e9
        scope_ns = ns_per_call("mesh.submesh(*axes).close()", space, **timed)
    close(impl, mesh)
    result = {"first_seconds": first_seconds, "ns_per_call": ns, "slice_ns_per_call": slice_ns}
    return {**result, "scope_ns_per_call": scope_ns}


def real(shape: Shape, names: Names, *, rotate: int, timeout: float) -> Any:
    """(d): every approach in one gloo world, in an order rotated by ``rotate``; max over ranks."""
    order = APPROACHES[rotate % 4 :] + APPROACHES[: rotate % 4]
    args = (tuple(shape), tuple(names), order)
    per_rank = run_world(measure, math.prod(shape), args=args, timeout=timeout)
    seconds = {i: {k: max(r[i][k] for r in per_rank) for k in per_rank[0][i]} for i in order}
    return {"order": order, "seconds": seconds, "per_rank": per_rank}


COLD = """
import json, math, sys, time
import torch, torch.distributed as dist, torch.testing._internal.distributed.fake_pg
from torch._C._distributed_c10d import HashStore
impl, shape, names = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].split(",")
floor = json.loads(sys.argv[4])
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
    for ranks in floor:
        dist.new_group(ranks, use_local_synchronization=True)
        times.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(times, times[1:])]))
"""


def coldstart(impl: str, shape: Shape, names: Names) -> Any:
    """(f): a new interpreter, torch.distributed imported: import, first mesh, each group."""
    root = Path(__file__).resolve().parent.parent  # bytecode first, as a wheel has it:
    compileall.compile_dir(root / "scopedmesh", quiet=1)  # else we'd time the compiler
    env = {**os.environ, "PYTHONPATH": str(root)}
    floor = json.dumps([members(shape, math.prod(shape) // 2, a) for a in range(len(shape))])
    argv = [sys.executable, "-c", COLD, impl, json.dumps(shape), ",".join(names), floor]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=True)
    steps = json.loads(done.stdout.splitlines()[-1])
    result = {"seconds": sum(steps), "import_seconds": steps[0], "construct_seconds": steps[1]}
    return {**result, **{f"group{i}_seconds": s for i, s in enumerate(steps[2:], 1)}}
