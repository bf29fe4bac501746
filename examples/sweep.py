"""Sweep layouts in one process per rank: FSDP2 + tensor parallelism, one scoped block each.

    torchrun --standalone --nproc_per_node=4 examples/sweep.py --steps 4
    python examples/sweep.py --reference --steps 4    # the same training, one process

Each layout (dp x tp) opens its own mesh, hands its DeviceMesh to tensor
parallelism (over tp) and FSDP2 (over dp), trains the same model from the same
seed on the same batches, and closes: its groups, the DeviceMeshes and what
DTensor cached about them go with it. Layouts repeat on purpose: a block over
the same ranks and shape as a closed one runs on its own groups. Rank 0 prints
every layout's losses; in float64 they match the one-process run to ~1e-12.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scopedmesh import ProcessGroupMesh

LAYOUTS = ((2, 2), (4, 1), (1, 4), (2, 2))  # (dp, tp) over 4 ranks; (2, 2) twice


def build_model(seed: int) -> nn.Sequential:
    """The full model, the same on every rank and in the reference."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()


def get_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, the same everywhere."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, 8, generator=g, dtype=torch.float64)
    return x, torch.sin(x.flip(1))


def reference_losses(steps: int, batch: int, seed: int) -> list[float]:
    """The losses of one process training on the whole batch."""
    model = build_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = get_batch(step, batch)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def sweep_losses(dp: int, tp: int, steps: int, batch: int, seed: int) -> list[float]:
    """Train under ``dp x tp`` in one scoped block; the global loss of every step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    losses = []
    with ProcessGroupMesh(dp, tp, names=("dp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu")
        model = copy.deepcopy(build_model(seed))
        parallelize_module(model, dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=dm["dp"])  # averages gradients over dp
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        rows = batch // dp
        here = mesh.coordinate("dp") * rows
        dp_group = mesh.get_group_along_axis("dp")
        for step in range(steps):
            x, y = get_batch(step, batch)
            loss = F.mse_loss(model(x[here : here + rows]), y[here : here + rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total = loss.detach().reshape(1)
            dist.all_reduce(total, group=dp_group)  # equal shards: the mean of the means
            losses.append(total.item() / dp)
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true", help="one process, no mesh")
    args = parser.parse_args(argv)

    if args.reference:
        for step, loss in enumerate(reference_losses(args.steps, args.batch, args.seed)):
            print(f"reference step {step} loss {loss:.12f}")
        return

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    for dp, tp in LAYOUTS:
        losses = sweep_losses(dp, tp, args.steps, args.batch, args.seed)
        if dist.get_rank() == 0:
            for step, loss in enumerate(losses):
                print(f"dp={dp} tp={tp} step {step} loss {loss:.12f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
