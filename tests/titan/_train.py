"""One torchtitan training run on given ParallelDims: llama3's debug model, shrunk, a few steps.

The same function trains on torchtitan's own ``ParallelDims.build_mesh()`` and on
:class:`~scopedmesh.interop.torchtitan.ScopedParallelDims`, and (``parallel_dims=None``)
as a one-process reference: same weights (made in one process and sliced to each
rank's shard, so every layout starts from the same model), same global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB = 64
SEQ = 16
GLOBAL_BATCH = 8
LR = 1e-3


def _config(parallel_dims: Any, spmd_backend: str) -> Any:
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    p = parallel_dims
    config.parallelism = ParallelismConfig(
        data_parallel_replicate_degree=p.dp_replicate if p else 1,
        data_parallel_shard_degree=p.dp_shard if p else 1,
        tensor_parallel_degree=p.tp if p else 1,
        expert_parallel_degree=p.ep if p else 1,
        spmd_backend=spmd_backend,
    )
    config.training.seq_len = SEQ
    config.training.local_batch_size = GLOBAL_BATCH // (p.dp_replicate * p.dp_shard if p else 1)
    config.training.mixed_precision_param = "float32"
    config.training.mixed_precision_reduce = "float32"
    config.compile.enable = False
    return config


def _model_config(config: Any, layers: int) -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    model_config = spec.model
    model_config.layers = model_config.layers[:layers]
    for layer in model_config.layers:
        # FlexAttention (the language models' default) has no backward on CPU: causal SDPA
        # computes the same attention for one document per sequence.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = spec
    model_config.update_from_config(config=config)
    return model_config


def full_weights(layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's initial weights, made in one process from ``seed``."""
    config = _config(None, "partial_dtensor")
    model = _model_config(config, layers).build()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    # Parameters, not the state dict: its hooks show the fused wqkv as wq, wk, wv.
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def _load(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every rank holds the full weights: each copies its own shard, without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            full = weights[name]
            if isinstance(param, DTensor):
                mine = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(mine.to_local())
            else:
                param.copy_(full)


class Run:
    """A model parallelized by torchtitan on ``parallel_dims`` (None: one process), and its steps."""

    def __init__(
        self,
        parallel_dims: Any,
        *,
        layers: int = 2,
        spmd_backend: str = "partial_dtensor",
        load: bool = True,
    ) -> None:
        self.parallel_dims = parallel_dims
        config = _config(parallel_dims, spmd_backend)
        model_config = _model_config(config, layers)
        with torch.device("meta"):
            model = model_config.build()
        if parallel_dims is not None:
            from torch.distributed.fsdp import FSDPModule
            from torchtitan.models.llama3 import parallelize_llama

            model = parallelize_llama(
                model,
                parallel_dims=parallel_dims,
                training=config.training,
                parallelism=config.parallelism,
                compile_config=config.compile,
                ac_config=None,
                dump_folder="",
            )
            # gloo has neither AVG nor PREMUL_SUM: FSDP sums, then divides by the dp degree.
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(
                buffer_device=None
            )  # buffers (RoPE); with load, weights are replaced
        if load:
            _load(model, full_weights(layers))
        model.train()
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        self.batches = batches(STEPS_MAX)
        self.losses: list[float] = []

    def step(self) -> float:
        """One training step on the next batch; the global mean loss (the same on every rank)."""
        from torch.distributed.tensor import DTensor

        tokens = self.batches[len(self.losses)]
        dims = self.parallel_dims
        if dims is not None and dims.dp_enabled:
            batch = dims.get_mesh("batch")
            tokens = tokens.chunk(batch.size())[batch.get_local_rank()]
        inputs = tokens[:, :-1]
        positions = torch.arange(SEQ).expand(inputs.shape[0], SEQ).contiguous()
        logits = self.model(inputs, positions=positions)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        value = loss.detach().clone()
        if dims is not None:
            mesh = dims.get_optional_mesh("loss")
            if mesh is not None:
                dist.all_reduce(value, group=mesh.get_group())
                value /= mesh.size()
        self.losses.append(value.item())
        return self.losses[-1]

    def dtensors(self) -> list[Any]:
        """Every DTensor the model and its optimizer hold."""
        from torch.distributed.tensor import DTensor

        found = [p for p in self.model.parameters() if isinstance(p, DTensor)]
        for state in self.optimizer.state.values():
            found += [v for v in state.values() if isinstance(v, DTensor)]
        return found


STEPS_MAX = 4


def train(
    parallel_dims: Any,
    *,
    steps: int = 2,
    layers: int = 2,
    spmd_backend: str = "partial_dtensor",
    load: bool = True,
) -> list[float]:
    """The global mean loss of each step (every rank returns the same list)."""
    run = Run(parallel_dims, layers=layers, spmd_backend=spmd_backend, load=load)
    for _ in range(steps):
        run.step()
    return run.losses


def group_names(parallel_dims: Any) -> set[str]:
    """The names of the groups of every mesh ``parallel_dims`` built."""
    meshes = [parallel_dims._world_mesh, *parallel_dims._global_meshes.values()]
    return {name for mesh in meshes for name in mesh._dim_group_names}


def live() -> set[Any]:
    """The process groups torch holds in this process now, WORLD left out."""
    from scopedmesh.c10d.groups import live_groups

    return {g for g in live_groups() if g is not dist.group.WORLD}


def census(groups: set[Any] | None = None) -> dict[str, Any]:
    """How many of ``groups`` (default: all live) there are, how many are real, over which rank sets."""
    groups = live() if groups is None else groups
    real = [g for g in groups if dist.get_backend(g) != "fake"]
    rank_sets = sorted({tuple(dist.get_process_group_ranks(g)) for g in real})
    return {"groups": len(groups), "real": len(real), "rank_sets": rank_sets}


def theirs(world_size: int, layout: tuple[int, int, int], spmd_backend: str) -> Any:
    """torchtitan's own ParallelDims, its meshes built by its own build_mesh (never destroyed)."""
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
        spmd_backend=spmd_backend,
    )
    with patch("torchtitan.distributed.parallel_dims.device_type", "cpu"):
        dims.build_mesh()
    return dims


def compare(world_size: int, layout: tuple[int, int, int], steps: int = 2) -> dict[str, Any]:
    """Train on torchtitan's own meshes, then on scoped ones; losses and the groups of each."""
    from scopedmesh import ProcessGroupMesh
    from scopedmesh.interop.torchtitan import ScopedParallelDims

    backend = "partial_dtensor"
    out: dict[str, Any] = {}
    before = live()
    own = theirs(world_size, layout, backend)
    made = live() - before
    out["theirs"] = train(own, steps=steps, spmd_backend=backend)
    out["theirs_groups"] = census(made)
    out["theirs_trained"] = census(live() - before - made)  # groups training itself made
    before = live()
    dp_replicate, dp_shard, tp = layout
    with ProcessGroupMesh(world_size, names=("world",)) as world:
        with ScopedParallelDims(
            world, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, spmd_backend=backend
        ) as dims:
            dims.build_mesh()
            made = live() - before
            out["ours"] = train(dims, steps=steps, spmd_backend=backend)
            out["ours_groups"] = census(made)
            out["ours_trained"] = census(live() - before - made)
    out["ours_left"] = census(live() - before)
    return out
