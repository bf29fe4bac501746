"""Peer death inside a scope (tests/world/test_reliability.py, section 5)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _workers_common import NAMES, error_of, live, summed

from scopedmesh.mesh import ProcessGroupMesh


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
            report["collective"] = error_of(exc)
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
