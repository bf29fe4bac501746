"""One benchmark run in this process: ``python -m benchmarks.worker --case ... --impl ...``.

Prints one line of JSON on stdout. The orchestrator (:mod:`benchmarks.run`) starts
one of these per run, because torch allows one world per process.

Cases:
    setup    construct the mesh and get this rank's group along every axis
             (``fake`` backend, rank ``world // 2``): wall time, group-creation
             calls, groups registered, and peak Python memory (tracemalloc, in a
             second pass on a fresh world so tracing does not slow the timed one).
    lookup   a cached single-axis group lookup, in ns per call.
    submesh  a sub-mesh over ("pp", "tp"): the first call, and ns per call.
    real     a gloo world over loopback (``scopedmesh.testing.run_world``): time until
             every single-axis group has completed a first all_reduce, max over ranks.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import timeit
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
from torch.distributed import distributed_c10d as c10d

from benchmarks import approaches

__all__ = ["main", "ns_per_call", "run_case"]

CASES = ("setup", "lookup", "submesh", "real")


# ------------------------------------------------------------------ helpers


def init_fake(world: int, rank: int) -> None:
    """A fresh one-process world of ``world`` ranks on the ``fake`` backend."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)


@contextmanager
def count_group_creations() -> Iterator[dict[str, int]]:
    """Count calls of torch's ``_new_process_group_helper`` and groups registered.

    Every path that makes a process group goes through the helper: public
    ``new_group`` (on every calling rank, members or not) and scopedmesh's named
    groups alike. ``functools.wraps`` keeps its signature visible to
    ``inspect.signature``, which scopedmesh checks before using it.
    """
    counts = {"helper_calls": 0, "groups_registered": 0}
    original = c10d._new_process_group_helper
    before = len(c10d._world.pg_map)

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        counts["helper_calls"] += 1
        return original(*args, **kwargs)

    c10d._new_process_group_helper = counting
    try:
        yield counts
    finally:
        c10d._new_process_group_helper = original
        counts["groups_registered"] = len(c10d._world.pg_map) - before


def expected_ranks(shape: Sequence[int], rank: int, axis: int) -> list[int]:
    """The C-order group of ``rank`` along ``axis`` (an independent reference)."""
    stride = math.prod(shape[axis + 1 :])
    coord = (rank // stride) % shape[axis]
    base = rank - coord * stride
    return [base + i * stride for i in range(shape[axis])]


def check_groups(shape: Sequence[int], rank: int, groups: Sequence[Any]) -> None:
    """Raise unless ``groups[a]`` holds exactly this rank's group along axis ``a``."""
    for axis, group in enumerate(groups):
        if group is None:
            raise RuntimeError(f"axis {axis}: no group returned")
        got = sorted(dist.get_process_group_ranks(group))
        want = expected_ranks(shape, rank, axis)
        if got != want:
            raise RuntimeError(f"axis {axis}: group ranks {got[:8]}... expected {want[:8]}...")


def ns_per_call(
    stmt: str, namespace: dict[str, Any], *, min_time: float, repeat: int
) -> tuple[float, int]:
    """Best of ``repeat`` timeit runs of ``stmt``, in ns per call, and the loop count.

    The loop count grows until one run takes at least ``min_time`` seconds.
    """
    timer = timeit.Timer(stmt, globals=namespace)
    number = 1
    while True:
        if timer.timeit(number) >= min_time:
            break
        number *= 4
    best = min(timer.repeat(repeat=repeat, number=number))
    return best / number * 1e9, number


def _warm_up(impl: str, shape: Sequence[int], names: Sequence[str]) -> None:
    """Run ``impl`` once on a tiny world so lazy imports and first-call costs are paid."""
    small = (1, *shape[1:])
    init_fake(math.prod(small), 0)
    handle, _ = approaches.build(impl, small, names)
    approaches.close(impl, handle)


# -------------------------------------------------------------------- cases


def case_setup(
    impl: str, world: int, shape: Sequence[int], names: Sequence[str], *, memory: bool
) -> dict[str, Any]:
    """Setup time, group-creation counts and (if ``memory``) peak Python memory."""
    rank = world // 2
    _warm_up(impl, shape, names)
    init_fake(world, rank)
    with count_group_creations() as counts:
        start = time.perf_counter()
        handle, groups = approaches.build(impl, shape, names)
        seconds = time.perf_counter() - start
    check_groups(shape, rank, groups)
    approaches.close(impl, handle)
    del handle, groups
    result: dict[str, Any] = {
        "seconds": seconds,
        "requested_groups": len(shape),
        **counts,
        "all_groups": approaches.total_groups(shape),
    }
    if memory:
        init_fake(world, rank)
        tracemalloc.start()
        tracemalloc.reset_peak()
        handle, groups = approaches.build(impl, shape, names)
        retained, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        approaches.close(impl, handle)
        result.update(peak_bytes=peak, retained_bytes=retained)
    return result


def case_lookup(
    impl: str, world: int, shape: Sequence[int], names: Sequence[str], *, min_time: float, repeat: int
) -> dict[str, Any]:
    """ns per cached lookup of this rank's group along the last axis (``tp``)."""
    init_fake(world, world // 2)
    axis = names[-1]
    if impl == "dict":
        handle, groups = approaches.build("scopedmesh", shape, names)
        table = dict(zip(names, groups))
        namespace: dict[str, Any] = {"groups": table, "axis": axis}
        stmt = "groups[axis]"
        expected = table[axis]
    else:
        handle, groups = approaches.build(impl, shape, names)
        namespace = {"mesh": handle, "axis": axis, "index": len(names) - 1}
        stmt = {
            "scopedmesh": "mesh.get_group_along_axis(axis)",
            "devicemesh": "mesh.get_group(axis)",
            "naive": "mesh.get_group_along_axis(index)",
        }[impl]
        expected = groups[-1]
    if eval(stmt, namespace) is not expected:
        raise RuntimeError(f"{stmt} did not return the cached group")
    ns, number = ns_per_call(stmt, namespace, min_time=min_time, repeat=repeat)
    approaches.close("scopedmesh" if impl == "dict" else impl, handle)
    return {"ns_per_call": ns, "loops": number, "stmt": stmt}


def case_submesh(
    impl: str, world: int, shape: Sequence[int], names: Sequence[str], *, min_time: float, repeat: int
) -> dict[str, Any]:
    """A sub-mesh over the last two axes: the first call's time and ns per later call.

    scopedmesh's per-call figure is a whole scope (``submesh(...)`` then ``close()``);
    ``create_ns_per_call`` is ``submesh(...)`` alone, closed after the timing.
    """
    init_fake(world, world // 2)
    axes = tuple(names[-2:])
    handle, _ = approaches.build(impl, shape, names)
    namespace: dict[str, Any] = {"mesh": handle, "axes": axes}
    if impl == "scopedmesh":
        start = time.perf_counter()
        first = handle.submesh(*axes)
        first_seconds = time.perf_counter() - start
        sub_shape = first.shape
        first.close()
        ns, number = ns_per_call(
            "mesh.submesh(*axes).close()", namespace, min_time=min_time, repeat=repeat
        )
        create_ns, _ = ns_per_call("mesh.submesh(*axes)", namespace, min_time=min_time, repeat=1)
    elif impl == "devicemesh":
        start = time.perf_counter()
        first = handle[axes]
        first_seconds = time.perf_counter() - start
        sub_shape = tuple(first.shape)
        ns, number = ns_per_call("mesh[axes]", namespace, min_time=min_time, repeat=repeat)
        create_ns = ns
    else:
        raise ValueError(f"case submesh has no approach {impl!r}")
    if tuple(sub_shape) != tuple(shape[-2:]):
        raise RuntimeError(f"sub-mesh shape {sub_shape}, expected {tuple(shape[-2:])}")
    approaches.close(impl, handle)
    return {
        "first_seconds": first_seconds,
        "ns_per_call": ns,
        "create_ns_per_call": create_ns,
        "loops": number,
    }


def case_real(
    world: int, shape: Sequence[int], names: Sequence[str], *, rotate: int, timeout: float
) -> dict[str, Any]:
    """All approaches in one gloo world, in an order rotated by ``rotate``; max over ranks."""
    from scopedmesh.testing import run_world

    from benchmarks.realworld import measure

    order = list(approaches.APPROACHES)
    k = rotate % len(order)
    order = order[k:] + order[:k]
    per_rank = run_world(
        measure, world, args=(tuple(shape), tuple(names), tuple(order)), timeout=timeout
    )
    return {
        "order": order,
        "seconds": {impl: max(r[impl] for r in per_rank) for impl in order},
        "per_rank": per_rank,
    }


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """Dispatch the parsed command line to a case; the result echoes the parameters."""
    shape = tuple(int(n) for n in args.shape.split(","))
    names = tuple(args.names.split(","))
    world = math.prod(shape)
    if args.world is not None and args.world != world:
        raise ValueError(f"--world {args.world} does not match --shape {shape} ({world} ranks)")
    if len(names) != len(shape):
        raise ValueError(f"--names {names} does not match --shape {shape}")
    head: dict[str, Any] = {
        "case": args.case,
        "impl": args.impl,
        "world": world,
        "shape": list(shape),
        "names": list(names),
    }
    if args.case == "setup":
        body = case_setup(args.impl, world, shape, names, memory=args.memory)
    elif args.case == "lookup":
        body = case_lookup(
            args.impl, world, shape, names, min_time=args.min_time, repeat=args.timeit_repeat
        )
    elif args.case == "submesh":
        body = case_submesh(
            args.impl, world, shape, names, min_time=args.min_time, repeat=args.timeit_repeat
        )
    else:
        body = case_real(world, shape, names, rotate=args.rotate, timeout=args.timeout)
    return {**head, **body}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker", description=__doc__)
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--impl", default="all", help="approach (the real case runs all)")
    parser.add_argument("--shape", required=True, help="axis sizes, e.g. 1024,8,8")
    parser.add_argument("--names", required=True, help="axis names, e.g. dp,pp,tp")
    parser.add_argument("--world", type=int, default=None, help="check: product of --shape")
    parser.add_argument("--memory", action="store_true", help="setup: also trace memory")
    parser.add_argument("--min-time", type=float, default=0.2, help="timeit: s per repeat")
    parser.add_argument("--timeit-repeat", type=int, default=5)
    parser.add_argument("--rotate", type=int, default=0, help="real: rotate the order")
    parser.add_argument("--timeout", type=float, default=300.0, help="real: world timeout")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], Any] = print) -> int:
    args = parse(argv)
    result = run_case(args)
    result["pid"] = os.getpid()
    out(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
