"""torchtitan's trainer as replicas, from outside: the command, its reports, and a
one-process replay of the membership schedule it went through.

The job runs ``python -m torchtitan.train`` (torchtitan's entry point) with
``--module scopedmesh.interop.titan_configs --config llama3_debugmodel
--scopedmesh.enable`` under the launcher, on the toy tokenizer and text set of
:mod:`scopedmesh.interop.titan_assets`. Each rank writes a report at its end
(``--scopedmesh.report_folder``); the first epoch's source writes the weights
every replica starts from.
"""

from __future__ import annotations

import json
import os
import signal
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

SEQ, LOCAL_BATCH = 16, 2  # tokens per sequence; sequences per rank per step


def trainer_args(assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """torchtitan's command line (after ``-m torchtitan.train``) for the job."""
    return [
        "--module", "scopedmesh.interop.titan_configs",
        "--config", "llama3_debugmodel",
        "--scopedmesh.enable",
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset_path", str(assets / "c4_test"),
        "--training.seq_len", str(SEQ),
        "--training.local_batch_size", str(LOCAL_BATCH),
        "--training.steps", str(steps),
        "--training.mixed_precision_param", "float32",
        "--training.mixed_precision_reduce", "float32",
        "--parallelism.spmd_backend", "partial_dtensor",
        "--metrics.log_freq", "1",
        "--dump_folder", str(out),
        "--scopedmesh.report_folder", str(out / "report"),
        *extra,
    ]  # fmt: skip


def config_of(args: list[str]) -> Any:
    """The job's config, parsed by torchtitan's own ConfigManager from ``args``."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(args)


def reports(folder: Path) -> list[dict[str, Any]]:
    """Every rank's report (one per incarnation that finished)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]


def history(found: list[dict[str, Any]]) -> list[tuple[int, tuple[int, ...], float]]:
    """The job's steps (step, contributors, loss), merged from every report: a rank
    that joined late holds the steps since; where two hold a step they must agree."""
    steps: dict[int, tuple[tuple[int, ...], float]] = {}
    for report in found:
        for step, members, loss in report["history"]:
            entry = (tuple(members), float(loss))
            if steps.setdefault(step, entry) != entry:
                raise AssertionError(f"step {step}: {steps[step]} and {entry} disagree")
    return [(s, *steps[s]) for s in sorted(steps)]


def schedule(steps: list[tuple[int, tuple[int, ...], float]]) -> list[tuple[tuple[int, ...], int]]:
    """Each run of steps with one set of contributors, and its length."""
    return [(members, len(list(run))) for members, run in groupby(m for _, m, _ in steps)]


def workers(root: int) -> dict[tuple[int, int], int]:
    """The trainer processes under process ``root``: (replica, local rank) -> pid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            env = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if "SCOPEDMESH_REPLICA" in env and "LOCAL_RANK" in env:
            found[(int(env["SCOPEDMESH_REPLICA"]), int(env["LOCAL_RANK"]))] = pid
    return found


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ the replay


def _plain(name: str) -> str:
    """A registered parameter's name (``0.`` and activation checkpointing's wrapper) as
    the unwrapped model's."""
    return name.split(".", 1)[1].replace("_checkpoint_wrapped_module.", "")


def replay(
    args: list[str],
    steps: list[tuple[int, tuple[int, ...], float]],
    initial: dict[str, torch.Tensor],
    replicas: int,
    local: int,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` in one process, unsharded, with the job's own torchtitan components
    (model, loss, optimizer, LR schedule, clipping, data shards): each step, each
    contributor's loss on its replica's batch (its ranks' shards together), the
    gradients' mean over the contributors, clipped, then the optimizer and LR steps.
    Returns the losses (the contributors' mean) and the final weights."""
    from torchtitan.components.loss import ChunkedLossWrapper

    from scopedmesh.interop.titan_trainer import _causal_sdpa

    torch.set_num_threads(1)  # the job's ranks share the cores too
    config = config_of(args)
    _causal_sdpa(config)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    model = model_config.build()
    weights = {_plain(name): value for name, value in initial.items()}
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (RoPE); the weights follow
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(
        optimizers=optimizers, training_steps=config.training.steps
    )
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    last = max(s for s, _, _ in steps) + 1
    shards = {}
    # replica r's ranks read shards r*local .. r*local+local-1
    for shard in range(replicas * local):
        loader = config.dataloader.build(
            dp_world_size=replicas * local,
            dp_rank=shard,
            tokenizer=tokenizer,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
        )
        iterator = iter(loader)
        shards[shard] = [next(iterator) for _ in range(last)]
    params = list(model.parameters())
    losses = []
    for step, members, _ in steps:
        optimizers.zero_grad()
        total = 0.0
        for r in members:
            batch = [shards[r * local + k][step] for k in range(local)]
            inputs = torch.cat([d["input"] for d, _ in batch])
            labels = torch.cat([lab for _, lab in batch])
            extra = {k: torch.cat([d[k] for d, _ in batch]) for k in batch[0][0] if k != "input"}
            valid = (labels != -100).sum()
            pred = model(inputs, **extra)
            loss_kwargs = {"positions": extra["positions"]} if "positions" in extra else {}
            loss, _ = loss_fn(pred, labels, valid, **loss_kwargs)
            loss.backward()
            total += float(loss.detach())
        for p in params:
            if p.grad is not None:
                p.grad /= len(members)
        torch.nn.utils.clip_grad_norm_(params, config.training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        losses.append(total / len(members))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
