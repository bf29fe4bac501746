"""Case (d): the per-rank body run by ``scopedmesh.testing.run_world`` over gloo.

It lives in its own importable module because spawned ranks unpickle it by name.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from benchmarks import approaches

__all__ = ["measure"]


def measure(
    rank: int, world: int, shape: Sequence[int], names: Sequence[str], order: Sequence[str]
) -> dict[str, float]:
    """Seconds from a world barrier until this rank's groups along every axis are usable.

    "Usable" means a first ``all_reduce`` on each group has completed. The
    approaches run one after another in ``order`` (each after a barrier); their
    modules are imported and WORLD's connections warmed first, so none of them
    pays for that.
    """
    torch.set_num_threads(1)  # as torchrun does for multi-process jobs, and as the other cases
    approaches.preload()
    warm = torch.ones(1)
    dist.all_reduce(warm)
    if warm.item() != world:
        raise RuntimeError(f"warm-up all_reduce gave {warm.item()}, expected {world}")
    seconds: dict[str, float] = {}
    handles = []
    for impl in order:
        dist.barrier()
        start = time.perf_counter()
        handle, groups = approaches.build(impl, shape, names)
        values = []
        for group in groups:
            value = torch.ones(1)
            dist.all_reduce(value, group=group)
            values.append(value.item())
        seconds[impl] = time.perf_counter() - start
        handles.append((impl, handle))
        if values != [float(n) for n in shape]:
            raise RuntimeError(f"{impl}: all_reduce sums {values}, expected group sizes {shape}")
    dist.barrier()
    for impl, handle in reversed(handles):
        approaches.close(impl, handle)
    return seconds
