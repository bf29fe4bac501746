"""What a scoped DeviceMesh costs DTensor work, against torch's own DeviceMesh in the same run.

    python -m benchmarks.dtensor_scope            # 4 gloo ranks, 30 rounds

A 4-rank gloo world runs one DTensor step (a sharded matmul, then a
redistribute to replicated) on a (2, 2) mesh that stays open, four ways, each
timed on rank 0 as the median over the rounds:

- ``torch warm``: over ``DeviceMesh.from_group`` on the mesh's groups (torch's
  own class), DTensor's caches warm;
- ``scoped warm``: over ``mesh.to_device_mesh("cpu")``, caches warm: the price of
  the scoped class on the hot path (one attribute read per group lookup);
- ``scoped after a close``: the first step after another scoped block (its own
  mesh and DeviceMesh, one step) closed, which clears DTensor's caches: what a
  mesh that stays open pays for each block that closes beside it;
- ``torch cold``: torch's own first step after its caches are cleared by hand,
  the same recomputation for comparison.

Ratios are to ``torch warm`` in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh import ProcessGroupMesh
from scopedmesh.c10d.device_mesh import forget_closed_meshes
from scopedmesh.testing import run_world

A = torch.arange(64 * 64, dtype=torch.float64).reshape(64, 64) / 4096


def step(dm: Any) -> None:
    """One DTensor step: a sharded matmul, then a redistribute to replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = distribute_tensor(A, dm, [Shard(0), Replicate()])
    w = distribute_tensor(A, dm, [Replicate(), Shard(1)])
    (x @ w).redistribute(dm, [Replicate(), Replicate()])


def timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_main(rank: int, world_size: int, rounds: int) -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh

    times: dict[str, list[float]] = {k: [] for k in ("torch warm", "scoped warm")}
    times.update({"scoped after a close": [], "torch cold": []})
    with ProcessGroupMesh(2, 2, names=("dp", "tp")) as mesh:
        scoped = mesh.to_device_mesh("cpu")
        groups = [mesh.get_group_along_axis(a) for a in ("dp", "tp")]
        plain = DeviceMesh.from_group(groups, "cpu", scoped.mesh, mesh_dim_names=("dp", "tp"))
        step(scoped)
        step(plain)
        for _ in range(rounds):
            step(plain)  # warm both again: the previous round cleared the caches
            step(scoped)
            times["torch warm"].append(timed(lambda: step(plain)))
            times["scoped warm"].append(timed(lambda: step(scoped)))
            with ProcessGroupMesh(2, 2, names=("dp", "tp")) as other:
                step(other.to_device_mesh("cpu"))
            times["scoped after a close"].append(timed(lambda: step(scoped)))
            forget_closed_meshes()  # clears the caches for torch's own mesh too
            times["torch cold"].append(timed(lambda: step(plain)))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    result = run_world(rank_main, 4, args=(args.rounds,), timeout=600.0)[0]
    base = result["torch warm"]
    print(f"DTensor step on a (2, 2) gloo mesh, median of {args.rounds} rounds on rank 0")
    print(f"{'case':<24} {'ms':>8} {'ratio':>7}")
    for case, seconds in result.items():
        print(f"{case:<24} {seconds * 1e3:>8.2f} {seconds / base:>7.2f}")


if __name__ == "__main__":
    main()
