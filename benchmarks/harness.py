"""What the cases share: a fresh process per run, a count of torch's group creation, timers.

>>> stat([3.0, 1.0, 2.0])
{'median': 2.0, 'min': 1.0, 'max': 3.0, 'n': 3}
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import statistics
import sys
import tempfile
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


def run_forked(fn: Callable[..., dict[str, Any]], kwargs: dict[str, Any], timeout: float) -> Any:
    """``fn(**kwargs)`` in a forked child (torch imported, no world); its JSON-able result.

    torch allows one world per process; a fork costs milliseconds, importing
    torch seconds. The child leads its own process group, so on timeout it is
    killed with everything it started. Like ``torchrun``, it runs torch on one
    thread: DeviceMesh's OpenMP threads, one per core, spun against other work on
    this small shared machine and its figures swung twentyfold.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    reader, writer = os.pipe()
    log = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.setpgid(0, 0)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.environ["OMP_NUM_THREADS"] = "1"  # for the processes it starts
        torch.set_num_threads(1)
        try:
            payload = json.dumps({**fn(**kwargs), "torch_threads": torch.get_num_threads()})
        except BaseException:
            payload = json.dumps({"error": "exception", "stderr": traceback.format_exc()})
        os.write(writer, payload.encode())  # a pipe write blocks until the parent reads it all
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        ready = select.select([pipe], [], [], timeout)[0]
        data = pipe.read() if ready else b""
    if not ready:
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    log.seek(0)
    tail = log.read().decode(errors="replace")[-3000:]
    log.close()
    if not ready:
        return {"error": "timeout", "timeout": timeout, "stderr": tail}
    try:
        return json.loads(data)
    except ValueError:
        return {"error": f"child ended with status {status}", "stderr": tail}


@contextmanager
def count_group_creations(*, keep_members: bool = False) -> Iterator[dict[str, Any]]:
    """Calls of torch's ``_new_process_group_helper``, their time, and groups registered.

    Every group creation goes through the helper: public ``new_group`` (on every
    calling rank, members or not) and scopedmesh's named groups alike.
    ``groups_registered`` is the growth of torch's ``pg_map`` (this rank's groups).
    The wrapper adds about half a microsecond per call; ``__wrapped__`` shows
    scopedmesh the helper's own parameters. With ``keep_members`` it keeps each
    call's member list, for :func:`copy_seconds`.
    """
    counts: dict[str, Any] = {"helper_calls": 0, "helper_seconds": 0.0, "members": []}
    original = c10d._new_process_group_helper

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts["helper_calls"] += 1
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
    """torch's per-member copy of these member lists, timed alone.

    Inside ``_new_process_group_helper`` torch assigns each group's member list
    to its backend options (``global_ranks_in_group``); pybind converts it element
    by element into a ``std::vector``, O(group size) for every group made.
    """
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
