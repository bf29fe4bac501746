"""One torchrun agent per replica group: a crash stops only its replica, the others heal in place.

    .venv/bin/python examples/launch_replicas.py        # 3 agents x 2 workers, two kills

Each agent runs one dp replica (its ``--nproc-per-node`` workers are the tp
ranks of one dp slice), so when a worker crashes its agent stops only that
replica. Every worker runs a :class:`~scopedmesh.LivenessWatch` guarding a
(dp, tp) mesh, and each step runs in ``watch.step(mesh, "dp")``: the
workers of the other agents learn of the deaths (the stopped replica's sockets
close), the step fails on every one of them, they agree on the lost ranks,
drop that dp slice and redo the step. Each step all-reduces ``rank + 1`` along
dp and tp and checks the sums against the mesh it ran on.
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
        ran_on, started = mesh, time.time()
        verdict = watch.step(mesh, "dp")  # the step counts on every member or on none
        try:
            with verdict:
                dp, tp = sums(ran_on, rank)
        except LostRankError as sat_out:
            say(f"{tag}: sits out: {sat_out}")
            break
        if verdict.healed:
            mesh, now = verdict.mesh, time.time()
            say(f"{tag}: step {step} failed")
            say(
                f"{tag}: healed at {now:.3f} ({now - started:.3f} s into the step): "
                f"lost {sorted(watch.lost())}, mesh {mesh.shape} over {list(mesh.layout.ranks)}"
            )
        if not verdict.committed:
            continue  # redo the step on the healed mesh
        ok = dp == expected(ran_on, "dp") and tp == expected(ran_on, "tp")
        bad += not ok
        say(f"{tag}: step {step} mesh {ran_on.shape} sums dp={dp} tp={tp} {'ok' if ok else 'BAD'}")
        step += 1
        time.sleep(args.pace)
    mesh.close()
    watch.close()
    say(f"{tag}: done, {step} steps, {bad} bad sums")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
