"""A sweep of torchtitan layouts in one process, each block's groups destroyed before the next.

Needs the extra (``pip install "scopedmesh[torchtitan]"``, Python >= 3.11). On CPU:

    torchrun --nproc-per-node 4 examples/titan_sweep.py
    torchrun --nproc-per-node 4 examples/titan_sweep.py --compare   # also torchtitan's own meshes

Each block opens a mesh, builds torchtitan's ``ParallelDims`` on it
(:class:`~scopedmesh.interop.torchtitan.ScopedParallelDims`), applies torchtitan's
own ``parallelize_llama`` (tensor parallelism, FSDP2, HSDP) to llama3's debug model
cut to 2 layers, and trains 2 steps on a fixed batch. Rank 0 prints, per layout,
the losses, the groups inside the block (all, real, distinct rank sets) and after
it. ``--compare`` first trains each layout on torchtitan's own
``ParallelDims.build_mesh()``, whose groups are never destroyed, and prints both.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg
from torch import nn

from scopedmesh import ProcessGroupMesh
from scopedmesh.c10d.groups import live_groups
from scopedmesh.interop.torchtitan import ScopedParallelDims

LAYOUTS = {4: [(1, 2, 2), (1, 4, 1), (2, 2, 1), (1, 2, 2)], 8: [(2, 2, 2), (1, 4, 2), (2, 4, 1)]}
SEQ, BATCH, STEPS = 16, 8, 2


def held() -> set[Any]:
    """The groups torch holds in this process, WORLD left out."""
    return {g for g in live_groups() if g is not dist.group.WORLD}


def census(groups: set[Any]) -> dict[str, int]:
    """How many ``groups``, how many real (not fake), over how many distinct rank sets."""
    real = [g for g in groups if dist.get_backend(g) != "fake"]
    sets = {tuple(dist.get_process_group_ranks(g)) for g in real}
    return {"groups": len(groups), "real": len(real), "rank_sets": len(sets)}


def build_model(parallel_dims: Any) -> nn.Module:
    """llama3's debug model (2 layers, causal SDPA: FlexAttention has no CPU backward), parallelized."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism = ParallelismConfig(
        data_parallel_replicate_degree=parallel_dims.dp_replicate,
        data_parallel_shard_degree=parallel_dims.dp_shard,
        tensor_parallel_degree=parallel_dims.tp,
        spmd_backend="partial_dtensor",
    )
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = config.training.mixed_precision_reduce = "float32"
    config.compile.enable = False
    config.model_spec = model_registry("debugmodel")
    model_config = config.model_spec.model
    model_config.layers = model_config.layers[:2]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():  # gloo has no AVG nor PREMUL_SUM: sum, then divide
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def train(parallel_dims: Any) -> list[float]:
    """``STEPS`` steps of AdamW on a fixed batch; the global mean loss of each."""
    from torch.distributed.tensor import DTensor

    model = build_model(parallel_dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=generator)
        batch = parallel_dims.get_optional_mesh("batch")
        if batch is not None:
            tokens = tokens.chunk(batch.size())[batch.get_local_rank()]
        inputs = tokens[:, :-1]
        logits = model(inputs, positions=torch.arange(SEQ).expand(inputs.shape[0], SEQ))
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        mesh = parallel_dims.get_optional_mesh("loss")
        if mesh is not None:
            dist.all_reduce(value, group=mesh.get_group())
            value /= mesh.size()
        losses.append(value.item())
    return losses


def torchtitans_own(layout: tuple[int, int, int], world_size: int) -> Any:
    """torchtitan's ParallelDims on its own build_mesh (on CPU: its device type patched)."""
    from unittest.mock import patch

    from torchtitan.distributed.parallel_dims import ParallelDims

    dp_replicate, dp_shard, tp = layout
    dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=1,
        tp=tp,
        pp=1,
        ep=1,
        world_size=world_size,
        spmd_backend="partial_dtensor",
    )
    with patch("torchtitan.distributed.parallel_dims.device_type", "cpu"):
        dims.build_mesh()
    return dims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="also torchtitan's own meshes")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    for layout in LAYOUTS.get(world_size, [(1, world_size, 1)]):
        name = "dp_replicate={} dp_shard={} tp={}".format(*layout)
        if args.compare:
            before = held()
            theirs = train(torchtitans_own(layout, world_size))
            made = census(held() - before)
            say(f"{name}  torchtitan's own meshes: losses {theirs}, groups made {made} (kept)")
        before = held()
        with ProcessGroupMesh(world_size, names=("world",)) as mesh:
            dp_replicate, dp_shard, tp = layout
            with ScopedParallelDims(
                mesh,
                dp_replicate=dp_replicate,
                dp_shard=dp_shard,
                tp=tp,
                spmd_backend="partial_dtensor",
            ) as dims:
                losses = train(dims)
                inside = census(held() - before)
        after = census(held() - before)
        say(
            f"{name}  scoped meshes:           losses {losses}, in the block {inside}, after {after}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
