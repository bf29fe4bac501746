"""Top-level worker functions for tests/test_launcher.py (spawned children import them by name)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

BIG = 4 * 1024 * 1024  # bytes in the large result: more than any pipe buffer


def _record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def all_reduce_ranks(rank: int, world_size: int, pid_dir: str) -> dict[str, object]:
    _record_pid(pid_dir, rank)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": t.item(),
        "env_rank": os.environ["RANK"],
        "env_world_size": os.environ["WORLD_SIZE"],
        "env_local_rank": os.environ["LOCAL_RANK"],
        "flag": os.environ.get("SCOPEDMESH_TEST_FLAG"),
        "dist_rank": dist.get_rank(),
        "big": bytes([rank]) * BIG,
        "tensor": t,  # reaches the parent after this process has gone
    }


def raise_or_unpicklable(rank: int, world_size: int) -> object:
    if rank == 1:
        raise ValueError("boom from rank 1")
    return threading.Lock()  # cannot be pickled


def exit_on_rank(rank: int, world_size: int, bad_rank: int, code: int, pid_dir: str) -> int:
    _record_pid(pid_dir, rank)
    if rank == bad_rank:
        os._exit(code)
    time.sleep(3600)  # stands in for a collective that never completes
    return rank


def kill_self_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank * 10


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def store_after_rank0_left(rank: int, world_size: int) -> int:
    """Rank 0 returns at once; the others use the store after it has exited."""
    if rank == 0:
        return 0
    time.sleep(3.0)  # rank 0 has reported, torn down and exited by now
    store = dist.distributed_c10d._get_default_store()
    return int(store.add("late-rank-count", 1))
