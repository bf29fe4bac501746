"""Helpers shared by the worker modules of the reliability and bad-input suites."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.diagnosis import process_gone

NAMES = ("dp", "tp")


def rss_kib() -> int:
    """This process's resident set size in KiB, from /proc/self/status (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status")


def wait_gone(pid: int, limit: float = 30.0) -> bool:
    """Whether process ``pid`` has ended (exited, or a zombie) within ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not process_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def live() -> int:
    return _c10d.live_group_count()


def summed(group: dist.ProcessGroup) -> int:
    """All-reduce a one on ``group``: the number of members that took part."""
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())


def error_of(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def destroy_all_but_world() -> None:
    """Destroy every process group torch holds except WORLD (after a leak, to go on)."""
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)


def in_doubt(step: Any, mesh: Any, out: dict[str, Any]) -> None:
    """Leave this rank in doubt about ``step``: its vote completes (kept in ``out["vote"]``),
    then its mesh is aborted before it reads the answer, as when a death's abort lands just
    after the vote: its peers commit the step, this rank does not know it."""
    vote = step._vote

    def read_too_late(flag: int) -> int | None:
        out["vote"] = vote(flag)
        mesh.abort("by the test, just after this rank's vote")
        return None

    step._vote = read_too_late
