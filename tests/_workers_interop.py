"""Top-level worker functions for tests/test_interop.py (spawned children import them by name).

One 4-rank world, a ``(dp=2, tp=2)`` mesh, runs every check; the tests read its results.
Results hold plain lists, not tensors: a tensor sent through a pipe by a process that
has exited cannot be rebuilt (torch shares its storage through the sender).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scopedmesh import MeshClosedError, ProcessGroupMesh
from scopedmesh.c10d import groups as _c10d
from scopedmesh.interop import layout_of

FULL = torch.arange(24, dtype=torch.float64).reshape(4, 6)


def make_linear() -> nn.Linear:
    """The same small model on every rank (and in the test process)."""
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def batch(rank: int) -> torch.Tensor:
    """A batch that differs on every rank, so averaging over the wrong ranks shows."""
    return torch.arange(12, dtype=torch.float64).reshape(4, 3) * (rank + 1) / 10


def local_grad(rank: int) -> list[list[float]]:
    """The weight gradient ``rank`` computes alone, without any averaging."""
    model = make_linear()
    model(batch(rank)).square().sum().backward()
    assert model.weight.grad is not None
    return model.weight.grad.tolist()  # type: ignore[no-any-return]


def _device_mesh_checks(mesh: ProcessGroupMesh, out: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dp = mesh.get_group_along_axis("dp")
    tp = mesh.get_group_along_axis("tp")
    dm = mesh.to_device_mesh("cpu")
    out["layout"] = layout_of(dm)
    out["dim_names"] = dm.mesh_dim_names
    out["coordinate"] = tuple(dm.get_coordinate() or ())
    out["same_groups"] = dm.get_group("dp") is dp and dm.get_group("tp") is tp
    out["sliced_tp_group"] = dm["tp"].get_group() is tp

    # distribute_tensor round trip: rows over dp, columns over tp.
    d = distribute_tensor(FULL, dm, [Shard(0), Shard(1)])
    out["local"] = d.to_local().tolist()
    out["full"] = d.full_tensor().tolist()
    out["redistributed"] = d.redistribute(dm, [Replicate(), Shard(0)]).full_tensor().tolist()

    # A DeviceMesh over some axes, in another order.
    tp_dp = mesh.to_device_mesh("cpu", axes=("tp", "dp"))
    out["tp_dp_layout"] = layout_of(tp_dp)
    out["tp_dp_full"] = distribute_tensor(FULL, tp_dp, [Shard(1), Shard(0)]).full_tensor().tolist()
    with mesh.submesh("tp") as sub:
        sub_dm = sub.to_device_mesh("cpu")
        out["submesh_layout"] = layout_of(sub_dm)
        out["submesh_group"] = sub_dm.get_group() is tp


def _tp_fsdp_checks(mesh: ProcessGroupMesh, out: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dm = mesh.to_device_mesh("cpu")
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = dense(x)
    expected.sum().backward()

    tp_model = parallelize_module(
        copy.deepcopy(dense), dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    out["tp_error"] = (tp_model(x) - expected).abs().max().item()

    fsdp_model = copy.deepcopy(dense)
    fsdp_model.zero_grad()
    fully_shard(fsdp_model, mesh=dm["dp"])
    y = fsdp_model(x)
    y.sum().backward()
    grad = fsdp_model[0].weight.grad
    assert dense[0].weight.grad is not None and grad is not None
    out["fsdp_error"] = (y - expected).abs().max().item()
    # FSDP2 averages over dp; every dp rank saw the same x, so the average is the local grad.
    out["fsdp_grad_error"] = (grad.full_tensor() - dense[0].weight.grad).abs().max().item()


def _ddp_checks(mesh: ProcessGroupMesh, out: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dp = mesh.get_group_along_axis("dp")
    model = make_linear()
    ddp = DistributedDataParallel(model, process_group=dp)
    ddp(batch(dist.get_rank())).square().sum().backward()
    assert model.weight.grad is not None
    out["ddp_grad"] = model.weight.grad.tolist()
    out["dp_ranks"] = mesh.get_ranks_in_group(dp) if dp is not None else []


def device_mesh_world(rank: int, world_size: int) -> dict[str, Any]:
    """Every interop check on a ``(dp=2, tp=2)`` mesh of 4 ranks."""
    out: dict[str, Any] = {"rank": rank}
    with ProcessGroupMesh(2, 2, names=("dp", "tp")) as mesh:
        out["mesh_layout"] = mesh.layout
        out["mesh_coordinate"] = mesh.coordinate()
        _device_mesh_checks(mesh, out)
        _tp_fsdp_checks(mesh, out)
        _ddp_checks(mesh, out)
        # WORLD + the mesh's dp and tp groups: DTensor, TP, FSDP2, DDP made none of their own.
        out["live_groups_in_scope"] = _c10d.live_group_count()
    out["live_groups_after_close"] = _c10d.live_group_count()
    try:
        mesh.to_device_mesh("cpu")
    except MeshClosedError as error:
        out["closed_error"] = str(error)
    # WORLD is untouched by the mesh's close.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["world_sum"] = t.item()
    return out
