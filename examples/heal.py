"""Heal: a dp x tp training loop loses a rank, the survivors re-form a smaller mesh and go on.

    torchrun --standalone --nproc_per_node=4 examples/heal.py
    torchrun --standalone --nproc_per_node=8 examples/heal.py --shape 4 2 --leave-rank 5

At ``--leave-step`` the rank ``--leave-rank`` leaves with exit code 0, as a
rank does when it honours a preemption notice. Every rank runs a
:class:`~scopedmesh.LivenessWatch` guarding the mesh, and each step in
``watch.step(mesh, "dp")``: the watch learns of the death from the leaver's
closed sockets and aborts the mesh, the step fails on every survivor (none
applies its update), they agree on the lost ranks, drop the dp row that held
the lost rank (its tp partner sits out and exits 0) and redo the step with one
replica fewer. Rank 0 prints each step's loss next to the loss of plain data
parallelism computed on one process, and the time from the death to the first
step on the re-formed mesh.

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

from scopedmesh import LivenessWatch, LostRankError, ProcessGroupMesh

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


def train_step(
    mesh: ProcessGroupMesh, w_shard: torch.Tensor, step: int
) -> tuple[torch.Tensor, float]:
    """tp shards the input features (one all_reduce of the output); dp averages the gradients.

    Returns the update to subtract from ``w_shard`` once the step has committed, and the loss.
    """
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
    return LR * packed[:-1].reshape(w_shard.shape), float(packed[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[2, 2], metavar=("DP", "TP"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--leave-rank", type=int, default=3)
    parser.add_argument("--leave-step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=5.0, help="collective timeout, s")
    parser.add_argument(
        "--agree-seconds", type=float, default=10.0, help="the liveness watch's timeout, s"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's agent hosts the store
    rank = dist.get_rank()
    watch = LivenessWatch(interval=0.02, timeout=args.agree_seconds)
    mesh = ProcessGroupMesh(*args.shape, names=("dp", "tp"), timeout=args.timeout)
    watch.guard(mesh)
    width = IN // mesh.size("tp")
    lo = mesh.coordinate("tp") * width
    w_shard = initial_weight()[:, lo : lo + width].clone()
    losses: list[float] = []
    replicas: list[int] = []
    step, healed_at = 0, None
    while step < args.steps:
        if rank == args.leave_rank and step == args.leave_step:
            say(f"rank {rank} leaves at step {step}, t={time.time():.3f}")
            os._exit(0)
        ran_on = mesh
        verdict = watch.step(mesh, "dp")  # the step counts on every member or on none
        try:
            with verdict:
                update, loss = train_step(ran_on, w_shard, step)
        except LostRankError as error:
            say(f"rank {rank} sits out: {error}")
            watch.close()
            dist.destroy_process_group()
            return
        if verdict.healed:
            mesh, healed_at = verdict.mesh, step
            if rank == 0:
                say(
                    f"lost ranks {sorted(verdict.lost)}; re-formed mesh {mesh.shape} "
                    f"over {mesh.layout.ranks}"
                )
        if not verdict.committed:
            continue  # redo the step on the re-formed mesh
        w_shard -= update
        losses.append(loss)
        replicas.append(ran_on.size("dp"))
        if rank == 0 and healed_at is not None and step == healed_at and ran_on is mesh:
            say(f"first step on the re-formed mesh done, t={time.time():.3f}")
        step += 1
    mesh.close()
    watch.close()
    if rank == 0:
        expected = reference(args.steps, replicas)
        for s, (loss, ref, n) in enumerate(zip(losses, expected, replicas)):
            say(f"step {s:3d} replicas {n} loss {loss:.9f} reference {ref:.9f}")
        say(f"max_abs_diff={max(abs(a - b) for a, b in zip(losses, expected)):.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
