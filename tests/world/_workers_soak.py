"""Soak (tests/world/test_reliability.py, section 1): open/close cycles, leaks and memory."""

from __future__ import annotations

import time
from typing import Any

from _workers_common import NAMES, live, rss_kib, summed

from scopedmesh.mesh import ProcessGroupMesh


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
