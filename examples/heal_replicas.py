"""One torchrun agent per replica group: a crash stops only its replica, the others heal in place.

    .venv/bin/python examples/launch_replicas.py        # 3 agents x 2 workers, two kills

Each agent runs one dp replica (its ``--nproc-per-node`` workers are the tp
ranks of one dp slice), so when a worker crashes its agent stops only that
replica. Every worker runs a :class:`~scopedmesh.LivenessWatch` guarding a
(dp, tp) mesh: the workers of the other agents learn of the deaths (the
stopped replica's sockets close), agree on the lost ranks, drop that dp slice
and go on. Each step all-reduces ``rank + 1`` along dp and tp and checks the
sums against the current mesh.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from scopedmesh import LivenessWatch, LostRankError, ProcessGroupMesh


def say(line: str) -> None:
    """Print ``line`` in one write: lines of ranks that share a pipe never interleave."""
    os.write(1, (line + "\n").encode())


def sums(mesh: ProcessGroupMesh, rank: int) -> tuple[int, int]:
    """``rank + 1`` summed along dp and along tp."""
    out = []
    for axis in ("dp", "tp"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=mesh.get_group_along_axis(axis))
        out.append(int(t.item()))
    return out[0], out[1]


def expected(mesh: ProcessGroupMesh, axis: str) -> int:
    return sum(r + 1 for r in mesh.layout.group(mesh.coordinate(), axis))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pace", type=float, default=0.2, help="seconds per step")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # the agents' store
    rank, world = dist.get_rank(), dist.get_world_size()
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    tag = f"rank {rank} pid {os.getpid()} agent {os.getppid()} node {node}"
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(world // local, local, names=("dp", "tp"), timeout=60))
    step, bad = 0, 0
    while step < args.steps:
        try:
            dp, tp = sums(mesh, rank)
            ok = dp == expected(mesh, "dp") and tp == expected(mesh, "tp")
            bad += not ok
            say(
                f"{tag}: step {step} mesh {mesh.shape} sums dp={dp} tp={tp} {'ok' if ok else 'BAD'}"
            )
            step += 1
            time.sleep(args.pace)
        except RuntimeError as error:
            failed = time.time()
            say(f"{tag}: step {step} failed: {str(error).splitlines()[0][:90]}")
            try:
                mesh = watch.heal(mesh, "dp", tag=f"step{step}")
            except LostRankError as sat_out:
                say(f"{tag}: sits out: {sat_out}")
                break
            lost, now = sorted(watch.lost()), time.time()
            say(
                f"{tag}: healed at {now:.3f} ({now - failed:.3f} s after the failure): "
                f"lost {lost}, mesh {mesh.shape} over {list(mesh.layout.ranks)}"
            )
    mesh.close()
    watch.close()
    say(f"{tag}: done, {step} steps, {bad} bad sums")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
