"""torchtitan on Replicas: 3 replicas of torchtitan's llama3 debug model, each sharded with
FSDP2 (or TP) over :class:`~scopedmesh.interop.torchtitan.ScopedParallelDims`; a replica
SIGKILLed at a random moment restarts, rejoins and catches up.

Needs the extra (``pip install "scopedmesh[torchtitan]"``, Python >= 3.11). On CPU:

    python examples/titan_replicas.py                # 3 replicas x 2 ranks, FSDP2, one kill
    python examples/titan_replicas.py --tp           # tensor parallel inside each replica
    python examples/titan_replicas.py --no-replay    # skip the one-process replay at the end

This script is the launcher: a :class:`~scopedmesh.testing.replicas.ReplicaJob` hosts
the job's store and runs each replica as a world of its own (2 gloo ranks), restarted
when one of its ranks dies, as a torchrun agent with ``--max-restarts`` would. Inside
a replica, torchtitan's own ``parallelize_llama`` shards the model over a scoped mesh
of the replica's WORLD (FSDP2: ``dp_shard=2``; ``--tp``: ``tp=2``), and FSDP2's
reduce-scatter averages the gradients over the replica's ranks. Across replicas,
``Replicas.all_reduce_`` averages each rank's local gradient shard with the same
shard of the other replicas (one dp group per coordinate), and decides the step's
verdict. Each replica trains on its own data (seeded by replica and step).

Once the job is whole and has trained a few steps, a random rank of a random
replica is SIGKILLed at a random moment. Its replica restarts, is admitted at a
step boundary and caught up from a live replica (FSDP2's DTensor state and AdamW's,
shard by shard); the job trains on at full shape and stops ``--after`` steps later.
The launcher then checks what issue 39 asks:

- the job is back to 3 replicas;
- the ranks of one coordinate hold bit-identical weights and optimizer state in
  every replica (a sha256 of their local shards);
- the losses equal a one-process, unsharded replay of the membership schedule the
  job went through (each step: the mean loss over the replicas that contributed,
  AdamW on the mean of their gradients), as close as float32 allows.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SEQ = 16  # tokens per sequence
BATCH = 4  # sequences per replica per step
VOCAB = 64  # token ids drawn below this (the model's vocabulary is 2048)
LR = 1e-3
STOP, STEP = "titan/stop", "titan/step"  # the launcher's stop step; the source's step


# ------------------------------------------------------------------ the model


def _configs(dp_shard: int, tp: int) -> tuple[Any, Any]:
    """torchtitan's job config and llama3's debug model config (causal SDPA: FlexAttention,
    the language models' default, has no backward on CPU)."""
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism = ParallelismConfig(
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=tp,
        spmd_backend="partial_dtensor",
    )
    config.training.seq_len = SEQ
    config.training.local_batch_size = BATCH // dp_shard
    config.training.mixed_precision_param = config.training.mixed_precision_reduce = "float32"
    config.compile.enable = False
    config.model_spec = model_registry("debugmodel")
    model_config = config.model_spec.model
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.update_from_config(config=config)
    return config, model_config


def initial_weights() -> dict[str, torch.Tensor]:
    """The debug model's initial weights, made in one process (seed 0): every replica and
    the replay start from them."""
    _, model_config = _configs(1, 1)
    model = model_config.build()
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def build(parallel_dims: Any) -> nn.Module:
    """llama3's debug model, parallelized by torchtitan on ``parallel_dims`` (None: one
    process, unsharded), holding :func:`initial_weights`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    dp_shard = 1 if parallel_dims is None else parallel_dims.dp_shard
    tp = 1 if parallel_dims is None else parallel_dims.tp
    config, model_config = _configs(dp_shard, tp)
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
        for module in model.modules():  # gloo has no AVG nor PREMUL_SUM: sum, then divide
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (RoPE); the weights follow
        weights = initial_weights()
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):  # each rank copies its own shard: no collective
                mine = distribute_tensor(
                    weights[name], param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(mine.to_local())
            else:
                param.copy_(weights[name])
    model.train()
    return model


def tokens_of(replica: int, step: int) -> torch.Tensor:
    """Replica ``replica``'s batch at ``step`` (its own data): ``BATCH`` x ``SEQ + 1`` ids."""
    gen = torch.Generator().manual_seed(1_000_003 * replica + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy of ``tokens`` (full logits, whatever the sharding)."""
    from torch.distributed.tensor import DTensor

    inputs = tokens[:, :-1]
    positions = torch.arange(SEQ).expand(inputs.shape[0], SEQ).contiguous()
    logits = model(inputs, positions=positions)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


# ------------------------------------------------------------------ the worker


class Progress:
    """The step and, per agreed step, its contributors and the replicas' mean loss."""

    def __init__(self) -> None:
        self.step = 0
        self.history: list[tuple[int, tuple[int, ...], float]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "history": [[s, list(c), x] for s, c, x in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.history = [
            (int(s), tuple(int(r) for r in c), float(x)) for s, c, x in state["history"]
        ]


def digest(state: Any) -> str:
    from scopedmesh.interop.titan_trainer import local

    buffer = io.BytesIO()
    torch.save(local(state), buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def train(
    replica: int, coordinate: int, job_port: int, replicas: int, tp: bool, pace: float
) -> dict[str, Any]:
    """One rank of one replica (its WORLD is up): train until the launcher's stop step."""
    import torch.testing._internal.distributed.fake_pg  # torchtitan's unused axes

    from scopedmesh import ProcessGroupMesh, Replicas
    from scopedmesh.interop.titan_trainer import Params, local
    from scopedmesh.interop.torchtitan import ScopedParallelDims

    started = time.time()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", job_port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    size = dist.get_world_size()
    degrees = {"tp": size} if tp else {"dp_shard": size}
    progress = Progress()
    commits: list[tuple[float, int, int, int]] = []  # (time, epoch, size, contributors)
    with ProcessGroupMesh(size, names=("world",), timeout=60) as world:
        with ScopedParallelDims(world, spmd_backend="partial_dtensor", **degrees) as dims:
            model = build(dims)
            optim = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
            batch = dims.get_optional_mesh("batch")
            loss_mesh = dims.get_optional_mesh("loss")
            state = {"model": Params(model), "optim": optim, "progress": progress}
            constructed = time.time()
            with Replicas(store, replica=replica, replicas=replicas, state=state) as grow:
                while True:
                    decision = grow.boundary()
                    stop = store.get(STOP) if store.check([STOP]) else None
                    if stop is not None and progress.step >= int(stop) and grow.size == replicas:
                        if grow.finish():  # every replica ends on this step
                            break
                        continue  # a member redid the last step: boundary() re-syncs
                    optim.zero_grad()
                    tokens = tokens_of(replica, progress.step)
                    if batch is not None:  # FSDP2: each rank its part of the replica's batch
                        tokens = tokens.chunk(batch.size())[batch.get_local_rank()]
                    loss = loss_of(model, tokens)
                    loss.backward()  # FSDP2: the replica's mean gradient, this rank's shard
                    shown = loss.detach().reshape(1).clone()
                    if loss_mesh is not None:  # the replica's mean loss
                        dist.all_reduce(shown, group=loss_mesh.get_group())
                        shown /= loss_mesh.size()
                    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
                    if grow.all_reduce_([*grads, shown]):  # the contributors' mean
                        optim.step()
                        progress.history.append((progress.step, grow.contributors, float(shown)))
                        progress.step += 1
                        commits.append(
                            (time.time(), decision.epoch, decision.size, len(grow.contributors))
                        )
                        if decision.source == replica and coordinate == 0:
                            store.set(STEP, str(progress.step))
                    time.sleep(pace)
                members = grow.decision.replicas if grow.decision else ()
                transfers = [(t.epoch, t.role, t.nbytes, t.seconds) for t in grow.transfers]
                entered = list(grow.entered)
            full = {k: v.detach().full_tensor() for k, v in model.named_parameters()}
            return {
                "digest": digest(
                    {"model": Params(model).state_dict(), "optim": optim.state_dict()}
                ),
                "history": progress.history,
                "replicas": members,
                "transfers": transfers,
                "entered": entered,
                "started": started,
                "constructed": constructed,
                "commits": commits,
                "full": full,
            }


# ------------------------------------------------------------------ the replay


def replay(
    history: list[tuple[int, tuple[int, ...], float]], chunks: int = 1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``history`` in one process, unsharded: each step, the mean of the contributors'
    losses (each on its own batch), AdamW on the mean of their gradients; the losses and
    the final weights.

    The sums run in the job's order: each replica's batch in ``chunks`` parts (FSDP2's
    ranks: each its part, the replica's gradient their sum over ``chunks``), then the
    sum over the contributors in their order, over their count."""
    model = build(None)
    params = list(model.parameters())
    optim = torch.optim.AdamW(params, lr=LR, foreach=False)
    losses = []
    for step, members, _ in history:
        grads = [torch.zeros_like(p) for p in params]
        loss = torch.zeros(())
        for r in members:
            mine = [torch.zeros_like(p) for p in params]
            part = torch.zeros(())
            for tokens in tokens_of(r, step).chunk(chunks):
                value = loss_of(model, tokens)
                for total, grad in zip(mine, torch.autograd.grad(value, params)):
                    total += grad
                part += value.detach()
            for total, grad in zip(grads, mine):
                total += grad / chunks
            loss += part / chunks
        for param, grad in zip(params, grads):
            param.grad = grad / len(members)
        optim.step()
        losses.append(float(loss / len(members)))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# ------------------------------------------------------------------ the launcher


def run(
    replicas: int = 3,
    local_ranks: int = 2,
    *,
    tp: bool = False,
    pace: float = 0.0,
    after: int = 5,
    warm_steps: int = 3,
    bound: float = 600.0,
    rng: random.Random | None = None,
) -> dict[str, Any]:
    """Start the job; once whole and ``warm_steps`` in, SIGKILL a random rank of a random
    replica at a random moment; once whole again, stop ``after`` steps later. Returns the
    ranks' results, the victim, the kill's and restart's times, the restarts."""
    from scopedmesh import job_view
    from scopedmesh.testing.replicas import ReplicaJob

    rng = rng or random.Random()
    job = ReplicaJob(
        train, replicas=replicas, local=local_ranks, args=(replicas, tp, pace), max_restarts=3
    )
    deadline = time.monotonic() + bound

    def until(what: str, condition: Any) -> None:
        while not condition():
            job.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {bound:g} s for {what}; failures: {job.failures[-2:]}")
            time.sleep(0.01)

    def whole(token: str | None = None) -> bool:
        view = job_view(job.store)
        if view is None or view.decision.size != replicas:
            return False
        return token is None or view.decision.token(victim[0]) != token

    def step() -> int:
        return int(job.store.get(STEP)) if job.store.check([STEP]) else 0

    job.start()
    try:
        victim = (rng.randrange(replicas), rng.randrange(local_ranks))
        until("the first epoch", whole)
        until(f"{warm_steps} steps", lambda: step() >= warm_steps)
        time.sleep(rng.uniform(0.0, 1.0))  # a random moment: in a step, a collective, a sleep
        view = job_view(job.store)
        token = view.decision.token(victim[0]) if view is not None else None
        if job.kill(*victim) is None:
            raise RuntimeError(f"replica {victim[0]} coordinate {victim[1]} was not running")
        killed = time.time()
        until("the restart", lambda: bool(job.restarts))
        until("the full shape again", lambda: whole(token))
        job.store.set(STOP, str(step() + after))
        until("every rank to finish", lambda: job.done)
    finally:
        job.stop()
    return {
        "results": dict(job.results),
        "victim": victim,
        "killed": killed,
        "restarts": list(job.restarts),
        "failures": list(job.failures),
        "tp": tp,
    }


def schedule(
    history: list[tuple[int, tuple[int, ...], float]],
) -> list[tuple[tuple[int, ...], int]]:
    """The membership schedule: each run of steps with one set of contributors, and its length."""
    runs: list[tuple[tuple[int, ...], int]] = []
    for _, members, _ in history:
        if runs and runs[-1][0] == members:
            runs[-1] = (members, runs[-1][1] + 1)
        else:
            runs.append((members, 1))
    return runs


def check(out: dict[str, Any], replicas: int, local_ranks: int, do_replay: bool) -> dict[str, Any]:
    """What issue 39 asks, as facts (the test asserts them; main prints them)."""
    results = out["results"]
    history = results[(0, 0)]["history"]
    facts: dict[str, Any] = {
        "ranks": sorted(results),
        "whole": all(r["replicas"] == tuple(range(replicas)) for r in results.values()),
        "same_state": all(
            r["digest"] == results[(0, c)]["digest"] for (_, c), r in results.items()
        ),
        "same_history": all(r["history"] == history for r in results.values()),
        "steps": [s for s, _, _ in history],
        "schedule": schedule(history),
        "restarted": [r for r, _ in out["restarts"]],
    }
    if do_replay:
        losses, weights = replay(history, 1 if out["tp"] else local_ranks)
        recorded = torch.tensor([x for _, _, x in history])
        facts["recorded"] = recorded.tolist()
        facts["replayed"] = losses
        facts["loss_diff"] = float((recorded - torch.tensor(losses)).abs().max())
        facts["weight_diff"] = max(
            float((r["full"][k] - v).abs().max())
            for r in results.values()
            for k, v in weights.items()
        )
        facts["weights_bitwise"] = all(
            torch.equal(r["full"][k], results[(0, 0)]["full"][k])
            for r in results.values()
            for k in weights
        )
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tp", action="store_true", help="tp=2 inside a replica (else FSDP2)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--after", type=int, default=5, help="steps at full shape after the rejoin")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds slept per step")
    parser.add_argument("--no-replay", action="store_true", help="skip the one-process replay")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # killed peers' gloo errors
    out = run(args.replicas, 2, tp=args.tp, pace=args.pace, after=args.after)
    facts = check(out, args.replicas, 2, not args.no_replay)
    inside = "tp=2" if args.tp else "FSDP2 dp_shard=2"
    print(f"{args.replicas} replicas x 2 ranks ({inside}), llama3 debug model, gloo")
    print(
        f"killed replica {out['victim'][0]} coordinate {out['victim'][1]}; restarted {facts['restarted']}"
    )
    print(f"schedule (contributors, steps): {facts['schedule']}")
    print(f"back to {args.replicas} replicas: {facts['whole']}")
    print(f"weights and optimizer state bit-identical across replicas: {facts['same_state']}")
    if "loss_diff" in facts:
        print(f"losses:   {facts['recorded']}")
        print(f"replayed: {facts['replayed']}")
        print(
            f"max |loss - replay| {facts['loss_diff']:.3g}, max |weight - replay| {facts['weight_diff']:.3g}"
        )
    sys.exit(0 if facts["whole"] and facts["same_state"] else 1)


if __name__ == "__main__":
    main()
