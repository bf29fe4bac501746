"""One benchmark run in this process: ``python -m benchmarks.worker --case ... --impl ...``.

Prints one line of JSON on stdout. torch allows one world per process, so each
run needs its own process. The orchestrator (:mod:`benchmarks.run`) starts one
``python -m benchmarks.worker --serve`` that imports torch once and forks a fresh
child per run (:func:`run_forked`): a run then costs milliseconds, not the
seconds of importing torch.

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
import inspect
import json
import math
import os
import select
import signal
import sys
import tempfile
import time
import timeit
import traceback
import tracemalloc
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
from torch._C._distributed_c10d import HashStore
from torch.distributed import distributed_c10d as c10d

from benchmarks import approaches

__all__ = ["main", "ns_per_call", "run_case"]

CASES = ("setup", "lookup", "submesh", "real")
TORCH_THREADS = 1


# ------------------------------------------------------------------ helpers


def init_fake(world: int, rank: int) -> None:
    """A fresh one-process world of ``world`` ranks on the ``fake`` backend."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=HashStore(), rank=rank, world_size=world)


def _counting_wrapper(original: types.FunctionType, counts: dict[str, Any]) -> Callable[..., Any]:
    """A function with ``original``'s exact parameters that counts its calls and their time.

    scopedmesh reads the helper's parameter names from ``__code__`` before using
    it, so a ``*args, **kwargs`` wrapper would send it down its fallback path.
    """
    parameters = inspect.signature(original).parameters.values()
    positional, keyword = [], []
    for p in parameters:
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            positional.append(p.name)
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            keyword.append(p.name)
        else:
            raise RuntimeError(f"cannot wrap {original.__name__}: parameter {p} is {p.kind}")
    names = positional + (["*", *keyword] if keyword else [])
    call = ", ".join(f"{n}={n}" for n in positional + keyword)
    source = (
        f"def {original.__name__}({', '.join(names)}):\n"
        "    counts['helper_calls'] += 1\n"
        "    start = perf_counter()\n"
        "    try:\n"
        f"        return original({call})\n"
        "    finally:\n"
        "        counts['helper_seconds'] += perf_counter() - start\n"
    )
    namespace: dict[str, Any] = {
        "counts": counts,
        "original": original,
        "perf_counter": time.perf_counter,
    }
    exec(source, namespace)
    wrapper: types.FunctionType = namespace[original.__name__]
    wrapper.__defaults__ = original.__defaults__
    wrapper.__kwdefaults__ = original.__kwdefaults__
    return wrapper


@contextmanager
def count_group_creations() -> Iterator[dict[str, Any]]:
    """Count calls of torch's ``_new_process_group_helper``, their time, and groups registered.

    Every path that makes a process group goes through the helper: public
    ``new_group`` (on every calling rank, members or not) and scopedmesh's named
    groups alike. ``groups_registered`` is the growth of torch's ``pg_map``: the
    groups this rank is a member of. ``helper_seconds`` is the time spent inside
    the helper (torch's own work for each group); the wrapper adds about half a
    microsecond per call to the caller's time.
    """
    counts: dict[str, Any] = {"helper_calls": 0, "groups_registered": 0, "helper_seconds": 0.0}
    original = c10d._new_process_group_helper
    before = len(c10d._world.pg_map)
    c10d._new_process_group_helper = _counting_wrapper(original, counts)  # type: ignore[arg-type]
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


def _timed_setup(
    impl: str, world: int, shape: Sequence[int], names: Sequence[str]
) -> tuple[float, dict[str, Any], list[str]]:
    """One construction on a fresh world: seconds, creation counts, warnings raised."""
    rank = world // 2
    init_fake(world, rank)
    with count_group_creations() as counts, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        handle, groups = approaches.build(impl, shape, names)
        seconds = time.perf_counter() - start
    check_groups(shape, rank, groups)
    approaches.close(impl, handle)
    return seconds, counts, sorted({f"{w.category.__name__}: {w.message}" for w in caught})


def case_setup(
    impl: str,
    world: int,
    shape: Sequence[int],
    names: Sequence[str],
    *,
    memory: bool,
    memory_max_seconds: float = math.inf,
    inner: int = 3,
    inner_seconds: float = 1.0,
) -> dict[str, Any]:
    """Setup time, group-creation counts and (if ``memory``) peak Python memory.

    After a warm-up on a tiny world, the construction is timed on a fresh world
    up to ``inner`` times (while they add up to under ``inner_seconds``); the
    fastest is this run's figure, so a preemption by another process on a busy
    machine does not become the result. Every repetition must count the same.
    """
    _warm_up(impl, shape, names)
    tries: list[tuple[float, dict[str, Any]]] = []
    caught: set[str] = set()
    while not tries or (len(tries) < inner and sum(t for t, _ in tries) < inner_seconds):
        seconds, counts, warned = _timed_setup(impl, world, shape, names)
        tries.append((seconds, counts))
        caught.update(warned)
    calls = {(c["helper_calls"], c["groups_registered"]) for _, c in tries}
    if len(calls) > 1:
        raise RuntimeError(f"group-creation counts differ between repetitions: {calls}")
    seconds, counts = min(tries, key=lambda t: t[0])
    result: dict[str, Any] = {
        "seconds": seconds,
        "inner_seconds": [t for t, _ in tries],
        "requested_groups": len(shape),
        **counts,
        "all_groups": approaches.total_groups(shape),
        "warnings": sorted(caught),
    }
    if memory and seconds > memory_max_seconds:
        result["memory_skipped"] = (
            f"the timed pass took {seconds:.1f} s > {memory_max_seconds:g} s; tracing "
            "would take about ten times as long"
        )
    elif memory:
        init_fake(world, world // 2)
        tracemalloc.start()
        tracemalloc.reset_peak()
        handle, _ = approaches.build(impl, shape, names)
        retained, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        approaches.close(impl, handle)
        result.update(peak_bytes=peak, retained_bytes=retained)
    return result


def case_lookup(
    impl: str,
    world: int,
    shape: Sequence[int],
    names: Sequence[str],
    *,
    min_time: float,
    repeat: int,
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


def _open_submeshes_ns(
    shape: Sequence[int],
    names: Sequence[str],
    axes: tuple[str, ...],
    *,
    min_time: float,
    repeat: int,
) -> tuple[float, int]:
    """ns per ``mesh.submesh(*axes)`` left open: best of ``repeat`` loops, and the loop count.

    Each loop runs on a fresh mesh (it makes no group), closed afterwards with
    the sub-meshes it collected, so that open sub-meshes do not pile up.
    """
    from scopedmesh.mesh import ProcessGroupMesh

    def loop(number: int) -> float:
        parent = ProcessGroupMesh(*shape, names=names)
        start = time.perf_counter()
        for _ in range(number):
            parent.submesh(*axes)
        seconds = time.perf_counter() - start
        parent.close()
        return seconds

    per_call = loop(100) / 100
    number = max(100, min(5000, int(min_time / max(per_call, 1e-9))))
    best = min(loop(number) for _ in range(repeat))
    return best / number * 1e9, number


def case_submesh(
    impl: str,
    world: int,
    shape: Sequence[int],
    names: Sequence[str],
    *,
    min_time: float,
    repeat: int,
) -> dict[str, Any]:
    """A sub-mesh over the last two axes: the first call's time and ns per later call.

    ``ns_per_call`` is the issue's comparison: scopedmesh's ``mesh.submesh(...)``
    (left open) vs DeviceMesh's ``mesh[...]``. ``scope_ns_per_call`` is a whole
    scope for scopedmesh, ``mesh.submesh(...)`` then ``.close()``; ``slice_ns_per_call``
    is its ``mesh[...]`` (which returns the open sub-mesh it made before, if any).
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
        ns, number = _open_submeshes_ns(shape, names, axes, min_time=min_time, repeat=repeat)
        scope_ns, _ = ns_per_call(
            "mesh.submesh(*axes).close()", namespace, min_time=min_time, repeat=repeat
        )
        slice_ns, _ = ns_per_call("mesh[axes]", namespace, min_time=min_time, repeat=repeat)
    elif impl == "devicemesh":
        start = time.perf_counter()
        first = handle[axes]
        first_seconds = time.perf_counter() - start
        sub_shape = tuple(first.shape)
        ns, number = ns_per_call("mesh[axes]", namespace, min_time=min_time, repeat=repeat)
        scope_ns = slice_ns = ns
    else:
        raise ValueError(f"case submesh has no approach {impl!r}")
    if tuple(sub_shape) != tuple(shape[-2:]):
        raise RuntimeError(f"sub-mesh shape {sub_shape}, expected {tuple(shape[-2:])}")
    approaches.close(impl, handle)
    return {
        "first_seconds": first_seconds,
        "ns_per_call": ns,
        "scope_ns_per_call": scope_ns,
        "slice_ns_per_call": slice_ns,
        "loops": number,
    }


def case_real(
    world: int, shape: Sequence[int], names: Sequence[str], *, rotate: int, timeout: float
) -> dict[str, Any]:
    """All approaches in one gloo world, in an order rotated by ``rotate``; max over ranks."""
    from benchmarks.realworld import measure
    from scopedmesh.testing import run_world

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
    """Dispatch the parsed command line to a case; the result echoes the parameters.

    torch runs its CPU ops on one thread (:data:`TORCH_THREADS`), as ``torchrun``
    sets ``OMP_NUM_THREADS=1`` for multi-process jobs. DeviceMesh does tensor
    work; with torch's default of one thread per core, on a small machine shared
    with other work, its OpenMP threads spin against other processes (a 2^16
    slice took 48 ms instead of 2.4 ms here) and its figures swing twentyfold.
    """
    torch.set_num_threads(TORCH_THREADS)
    shape = tuple(int(n) for n in args.shape.split(","))
    names = tuple(args.names.split(","))
    world = math.prod(shape)
    if args.world is not None and args.world != world:
        raise ValueError(f"--world {args.world} does not match --shape {shape} ({world} ranks)")
    if len(names) != len(shape):
        raise ValueError(f"--names {names} does not match --shape {shape}")
    head: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "case": args.case,
        "impl": args.impl,
        "world": world,
        "shape": list(shape),
        "names": list(names),
    }
    if args.case == "setup":
        body = case_setup(
            args.impl,
            world,
            shape,
            names,
            memory=args.memory,
            memory_max_seconds=args.memory_max_seconds,
        )
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
    parser.add_argument(
        "--memory-max-seconds",
        type=float,
        default=math.inf,
        help="setup: skip tracing when the timed pass took longer than this",
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="timeit: s per repeat")
    parser.add_argument("--timeit-repeat", type=int, default=5)
    parser.add_argument("--rotate", type=int, default=0, help="real: rotate the order")
    parser.add_argument("--timeout", type=float, default=300.0, help="real: world timeout")
    return parser.parse_args(argv)


def run_forked(argv: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run one case in a forked child of this (already imported) process.

    The child is a fresh process with torch imported and no world; it leads its
    own process group, so on timeout it is killed with everything it started
    (the ranks of a real world included). Its stdout and stderr go to a log
    whose tail is returned on failure.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    reader, writer = os.pipe()
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setpgid(0, 0)
            os.close(reader)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            outcome = run_case(parse(argv))
            outcome["pid"] = os.getpid()
            payload, code = json.dumps(outcome), 0
        except BaseException:
            payload = json.dumps({"error": "exception", "stderr": traceback.format_exc()})
        try:
            with os.fdopen(writer, "w") as pipe:
                pipe.write(payload)
        finally:
            os._exit(code)
    os.close(writer)
    chunks: list[bytes] = []
    deadline = start + timeout
    timed_out = False
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([reader], [], [], left)
        if ready:
            chunk = os.read(reader, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(reader)
    if timed_out:
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    wall = time.perf_counter() - start
    if timed_out:
        return {"error": "timeout", "timeout": timeout, "process_seconds": wall}
    try:
        result: dict[str, Any] = json.loads(b"".join(chunks))
    except ValueError:
        log.seek(0)
        tail = log.read().decode(errors="replace")[-3000:]
        return {"error": f"child ended with status {status}", "stderr": tail}
    finally:
        log.close()
    result["process_seconds"] = wall
    return result


def serve(lines: Iterable[str], out: TextIO) -> None:
    """Answer each request line ``{"argv": [...], "timeout": s}`` with one result line.

    Everything a run may import is imported first, so no child pays for it.
    """
    from benchmarks import realworld  # noqa: F401
    from scopedmesh import testing  # noqa: F401

    approaches.preload()

    for line in lines:
        if not line.strip():
            continue
        request = json.loads(line)
        result = run_forked(request["argv"], float(request["timeout"]))
        out.write(json.dumps(result) + "\n")
        out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one case and print its JSON, or with ``--serve`` answer requests on stdin."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--serve"]:
        serve(sys.stdin, sys.stdout)
        return 0
    result = run_case(parse(argv))
    result["pid"] = os.getpid()
    print(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
