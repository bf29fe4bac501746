"""What the cases share: a fresh process per run, a count of torch's group creation, timers.

>>> stat([3.0, 1.0, 2.0])
{'median': 2.0, 'min': 1.0, 'max': 3.0, 'n': 3}
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import statistics
import time
import timeit
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
from torch._C._distributed_c10d import HashStore
from torch.distributed import distributed_c10d as c10d

__all__ = ["copy_seconds", "count_group_creations", "init_fake", "ns_per_call", "run_forked"]


def stat(values: Iterable[float]) -> dict[str, float]:
    """Median, min, max and count of ``values``."""
    data = list(values)
    return {"median": statistics.median(data), "min": min(data), "max": max(data), "n": len(data)}


def init_fake(world: int, rank: int) -> None:
    """A fresh one-process world of ``world`` ranks on the ``fake`` backend."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=HashStore(), rank=rank, world_size=world)


def _child(pipe: Any, fn: Callable[..., dict[str, Any]], kwargs: dict[str, Any]) -> None:
    os.setpgid(0, 0)  # a group of its own: a kill on timeout takes everything it started
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # errors are reported, not printed
    os.environ["OMP_NUM_THREADS"] = "1"  # for the processes it starts
    torch.set_num_threads(1)
    try:
        pipe.send({**fn(**kwargs), "torch_threads": torch.get_num_threads()})
    except BaseException:
        pipe.send({"error": "exception", "stderr": traceback.format_exc()})


def run_forked(fn: Callable[..., dict[str, Any]], kwargs: dict[str, Any], timeout: float) -> Any:
    """``fn(**kwargs)`` in a forked child (torch imported, no world), killed after ``timeout``.

    torch allows one world per process; a fork costs milliseconds, importing torch
    seconds. The child runs torch on one thread, as ``torchrun`` does: with a thread
    per core, on a small shared machine, DeviceMesh's figures swung twentyfold.
    """
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(writer, fn, kwargs))
    child.start()
    writer.close()
    ready = reader.poll(timeout)
    if not ready:
        with suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    try:
        result = reader.recv() if ready else {"error": "timeout", "timeout": timeout}
    except EOFError:
        result = None
    child.join()
    return result or {"error": f"the run ended with exit code {child.exitcode}"}


@contextmanager
def count_group_creations(*, keep_members: bool = False) -> Iterator[dict[str, Any]]:
    """Calls of torch's ``_new_process_group_helper``, which every group creation goes
    through, their time, the growth of ``pg_map`` and (``keep_members``) the member lists.
    """
    counts: dict[str, Any] = {"helper_calls": 0, "helper_seconds": 0.0, "members": []}
    original = c10d._new_process_group_helper

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts["helper_calls"] += 1  # wraps() shows scopedmesh the helper's own parameters
        if keep_members:
            counts["members"].append(args[2] if len(args) > 2 else kwargs["global_ranks_in_group"])
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            counts["helper_seconds"] += time.perf_counter() - start

    before = len(c10d._world.pg_map)
    c10d._new_process_group_helper = wrapper
    try:
        yield counts
    finally:
        c10d._new_process_group_helper = original
        counts["groups_registered"] = len(c10d._world.pg_map) - before


def copy_seconds(member_lists: Iterable[Any]) -> float:
    """torch's per-member copy in the helper, alone: pybind converting each list to C++."""
    options = c10d._DistributedBackendOptions()
    start = time.perf_counter()
    for members in member_lists:
        options.global_ranks_in_group = members
    return time.perf_counter() - start


def ns_per_call(stmt: str, namespace: dict[str, Any], *, min_time: float, repeat: int) -> float:
    """Best of ``repeat`` timeit runs of ``stmt`` (each ≥ ``min_time`` s), in ns per call."""
    timer = timeit.Timer(stmt, globals=namespace)
    number = 1
    while timer.timeit(number) < min_time:
        number *= 4
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e9
