"""Heal: a dp x tp training loop loses a rank, the survivors re-form a smaller mesh and go on.

    torchrun --standalone --nproc_per_node=4 examples/heal.py
    torchrun --standalone --nproc_per_node=8 examples/heal.py --shape 4 2 --leave-rank 5

At ``--leave-step`` the rank ``--leave-rank`` leaves with exit code 0, as a
rank does when it honours a preemption notice. Its peers' next collective
fails at once; every survivor checks in to the store, and after
``--agree-seconds`` they share one verdict on the lost ranks
(``scopedmesh.fault.heal.agree_on_lost``). They close the old mesh, drop the dp row
that held the lost rank (its tp partner sits out and exits 0) and train on
with one replica fewer. Rank 0 prints each step's loss next to the loss of
plain data parallelism computed on one process, and the time from the death to
the first step on the re-formed mesh.

Under torchrun, a worker that *crashes* (non-zero exit, a signal) makes the
agent stop every other local worker, and restart them all if ``--max-restarts``
allows: healing in place needs the lost rank's process to end cleanly or hang.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from scopedmesh import ProcessGroupMesh
from scopedmesh.fault.heal import LostRankError, agree_on_lost, reform

IN, OUT, BATCH, LR = 8, 4, 8, 0.1


def say(line: str) -> None:
    """Print ``line`` in one write: lines of ranks that share a pipe never interleave."""
    os.write(1, (line + "\n").encode())


def batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica`` of ``replicas``' data at ``step``: the same in every run."""
    g = torch.Generator().manual_seed(1000003 * step + 1009 * replicas + replica)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    w_true = torch.arange(OUT * IN, dtype=torch.float64).reshape(OUT, IN) / (OUT * IN)
    return x, x @ w_true.T


def initial_weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def reference(steps: int, replicas: list[int]) -> list[float]:
    """Plain data parallelism on one process, ``replicas[step]`` replicas at each step."""
    w = initial_weight()
    losses = []
    for step in range(steps):
        n = replicas[step]
        grad, total = torch.zeros_like(w), 0.0
        for replica in range(n):
            x, y = batch(step, replica, n)
            wr = w.clone().requires_grad_(True)
            loss = ((x @ wr.T - y) ** 2).mean()
            loss.backward()
            assert wr.grad is not None
            grad += wr.grad
            total += float(loss.detach())
        w -= LR * grad / n
        losses.append(total / n)
    return losses


def train_step(mesh: ProcessGroupMesh, w_shard: torch.Tensor, step: int) -> float:
    """tp shards the input features (one all_reduce of the output); dp averages the gradients."""
    tp, dp = mesh.get_group_along_axis("tp"), mesh.get_group_along_axis("dp")
    width = IN // mesh.size("tp")
    lo = mesh.coordinate("tp") * width
    x, y = batch(step, mesh.coordinate("dp"), mesh.size("dp"))
    shard = w_shard.clone().requires_grad_(True)
    partial = x[:, lo : lo + width] @ shard.T
    full = partial.detach().clone()
    dist.all_reduce(full, group=tp)
    loss = ((partial + (full - partial.detach()) - y) ** 2).mean()
    loss.backward()
    assert shard.grad is not None
    packed = torch.cat([shard.grad.flatten(), loss.detach().reshape(1)])
    dist.all_reduce(packed, group=dp)
    packed /= mesh.size("dp")
    w_shard -= LR * packed[:-1].reshape(w_shard.shape)
    return float(packed[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[2, 2], metavar=("DP", "TP"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--leave-rank", type=int, default=3)
    parser.add_argument("--leave-step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=5.0, help="collective timeout, s")
    parser.add_argument("--agree-seconds", type=float, default=10.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's agent hosts the store
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ProcessGroupMesh(*args.shape, names=("dp", "tp"), timeout=args.timeout)
    width = IN // mesh.size("tp")
    lo = mesh.coordinate("tp") * width
    w_shard = initial_weight()[:, lo : lo + width].clone()
    losses: list[float] = []
    replicas: list[int] = []
    step = 0
    with mesh:
        try:
            while step < args.steps:
                if rank == args.leave_rank and step == args.leave_step:
                    say(f"rank {rank} leaves at step {step}, t={time.time():.3f}")
                    os._exit(0)
                losses.append(train_step(mesh, w_shard, step))
                replicas.append(mesh.size("dp"))
                step += 1
        except RuntimeError as error:
            say(f"rank {rank}: step {step} failed: {str(error).splitlines()[0][:100]}")
    if step == args.steps:  # nobody left: nothing to heal
        healed = None
    else:
        try:
            lost = agree_on_lost(range(world), rank, tag=f"step{step}", timeout=args.agree_seconds)
            healed = reform(mesh, lost, "dp")
        except LostRankError as error:
            say(f"rank {rank} sits out: {error}")
            dist.destroy_process_group()
            return
        if rank == 0:
            say(
                f"lost ranks {sorted(lost)}; re-formed mesh {healed.shape} over {healed.layout.ranks}"
            )
        with healed:
            while step < args.steps:
                losses.append(train_step(healed, w_shard, step))
                replicas.append(healed.size("dp"))
                if step == args.leave_step and rank == 0:
                    say(f"first step on the re-formed mesh done, t={time.time():.3f}")
                step += 1
    if rank == 0:
        expected = reference(args.steps, replicas)
        for s, (loss, ref, n) in enumerate(zip(losses, expected, replicas)):
            say(f"step {s:3d} replicas {n} loss {loss:.9f} reference {ref:.9f}")
        say(f"max_abs_diff={max(abs(a - b) for a, b in zip(losses, expected)):.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
