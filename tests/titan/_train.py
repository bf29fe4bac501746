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
                mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(mine.to_local())
            else:
                param.copy_(full)


def train(
    parallel_dims: Any,
    *,
    steps: int = 2,
    layers: int = 2,
    spmd_backend: str = "partial_dtensor",
    load: bool = True,
) -> list[float]:
    """The global mean loss of each step (every rank returns the same list)."""
    from torch.distributed.tensor import DTensor

    config = _config(parallel_dims, spmd_backend)
    model_config = _model_config(config, layers)
    with torch.device("meta"):
        model = model_config.build()
    if parallel_dims is not None:
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
        from torch.distributed.fsdp import FSDPModule

        # gloo has neither AVG nor PREMUL_SUM: FSDP sums, then divides by the dp degree.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE); with load, weights are replaced
    if load:
        _load(model, full_weights(layers))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for tokens in batches(steps):
        if parallel_dims is not None and parallel_dims.dp_enabled:
            batch = parallel_dims.get_mesh("batch")
            tokens = tokens.chunk(batch.size())[batch.get_local_rank()]
        inputs = tokens[:, :-1]
        positions = torch.arange(SEQ).expand(inputs.shape[0], SEQ).contiguous()
        logits = model(inputs, positions=positions)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if parallel_dims is not None:
            mesh = parallel_dims.get_optional_mesh("loss")
            if mesh is not None:
                dist.all_reduce(value, group=mesh.get_group())
                value /= mesh.size()
        losses.append(value.item())
    return losses
