"""DTensor, tensor parallelism and FSDP2 on a scopedmesh, through `to_device_mesh`.

    torchrun --standalone --nproc_per_node=8 examples/dtensor.py
    torchrun --standalone --nproc_per_node=4 examples/dtensor.py --shape 1 2 2

`mesh.to_device_mesh(...)` is a torch DeviceMesh over the mesh's own groups: torch
makes none of its own, and the mesh destroys them all when its scope ends.
Rank 0 prints each result's largest error against the same computation done densely.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scopedmesh import ProcessGroupMesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 2, 2], metavar=("DP", "PP", "TP"))
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    rank = dist.get_rank()

    def worst(error: torch.Tensor) -> float:
        """The largest error over all ranks."""
        error = error.detach().abs().max().reshape(1)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        return error.item()

    torch.manual_seed(0)  # the same full tensors and models on every rank
    x_full = torch.randn(8, 16, device=device)
    w_full = torch.randn(16, 32, device=device)
    dense = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh()).to(device)

    with ProcessGroupMesh(*args.shape, names=("dp", "pp", "tp")) as mesh:
        dm = mesh.to_device_mesh(device.type)  # axes dp, pp, tp over the mesh's groups
        assert dm.get_group("tp") is mesh.get_group_along_axis("tp")

        # 1. DTensor: x's rows sharded over dp, w's columns over tp, both replicated over pp.
        x = distribute_tensor(x_full, dm, [Shard(0), Replicate(), Replicate()])
        w = distribute_tensor(w_full, dm, [Replicate(), Replicate(), Shard(1)])
        y = x @ w  # each rank multiplies its own blocks: no communication
        matmul_error = worst(y.full_tensor() - x_full @ w_full)

        # 2. Tensor parallelism over tp, then FSDP2 over dp (the usual "2-D" recipe).
        model = copy.deepcopy(dense)
        parallelize_module(model, dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=dm["dp"])
        out = model(x_full)
        out.sum().backward()
        dense(x_full).sum().backward()
        output_error = worst(out - dense(x_full))
        # FSDP2 averages gradients over dp; every dp rank saw the same x, so they match dense.
        grad_error = worst(model[2].weight.grad.full_tensor() - dense[2].weight.grad)

        if rank == 0:
            print(f"device mesh: {dm}")
            print(
                f"y = x @ w: {tuple(y.shape)} as {y.placements}, local {tuple(y.to_local().shape)}"
            )
            print(
                f"max error: matmul={matmul_error:.3g} tp+fsdp2 output={output_error:.3g} grad={grad_error:.3g}"
            )
    # the groups under dm (and under everything built on it) are destroyed here

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
