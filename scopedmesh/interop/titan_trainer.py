"""torchtitan's ``Trainer`` whose replicas grow back: config lines, no Python.

:class:`ReplicatedTrainer` is torchtitan 0.3.0's ``Trainer`` with a config section
of its own, ``scopedmesh`` (:class:`ReplicasSection`). Off (the default), it is
torchtitan's trainer, line for line. On, each torchrun world is one replica of a
job of ``replicas``; a :class:`~scopedmesh.Replicas` averages every rank's
gradient shard with the same shard of the other replicas and decides each step's
verdict, and a replica that dies restarts, is admitted at a step boundary and
caught up from a live one. Under ``scopedmesh replicas`` (the launcher) the
section's values come from the launcher's environment, so the user writes one
flag::

    scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- -m torchtitan.train \\
        --module scopedmesh.interop.titan_configs --config llama3_debugmodel \\
        --scopedmesh.enable

(:mod:`scopedmesh.interop.titan_configs` turns any of torchtitan's own config
functions into this trainer's.) What is registered is what torchtitan's
checkpoint holds: the model (its parameters as they are, :class:`Params`), the
optimizers, the LR schedulers, the train state (step, tokens seen, the data
position: :class:`DataStream`) and the RNG. A step that is not committed changes
none of them: gradient clipping, the optimizer and LR steps and the metrics run
after the verdict, on the contributors' mean, alike on every replica.

torchtitan's periodic checkpoint still works: one folder, written by the
epoch's source replica (every replica holds the same state), read by every
replica at its start, so a job that lost every replica restarts from it.

Where CUDA is absent the trainer carries what CPU and gloo need (:func:`run_on_cpu`):
torchtitan's device fallback, FlexAttention's missing CPU backward, FSDP2's
``PREMUL_SUM``; on CUDA it needs none of it.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from scopedmesh.errors import JobFinishedError, shown
from scopedmesh.fault.state_transfer import local
from scopedmesh.interop.torchtitan import check_torchtitan_version

__all__ = [
    "DataStream",
    "Params",
    "RandomState",
    "ReplicasSection",
    "ReplicatedTrainer",
    "TrainState",
    "local",
    "run_on_cpu",
]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]
IDLE_PACE = 0.1  # seconds: an idle step's pause (ReplicasSection.finish_wait)


@dataclass(kw_only=True, slots=True)
class ReplicasSection:
    """The ``scopedmesh`` section: ``--scopedmesh.enable`` and, outside the launcher,
    where this replica stands. An empty or negative value is read from the launcher's
    environment (``SCOPEDMESH_REPLICA``, ``SCOPEDMESH_REPLICAS``,
    ``SCOPEDMESH_JOB_STORE``, ``SCOPEDMESH_BACKEND``)."""

    enable: bool = False
    """Train as one replica of a replicated job that grows back."""
    replica: int = -1
    """This replica's index, 0..replicas-1 (-1: SCOPEDMESH_REPLICA)."""
    replicas: int = -1
    """How many replicas the job holds (-1: SCOPEDMESH_REPLICAS)."""
    job_store: str = ""
    """The job's store, HOST:PORT, which outlives every replica ("": SCOPEDMESH_JOB_STORE)."""
    backend: str = ""
    """The cross-replica groups' backend, gloo or nccl ("": SCOPEDMESH_BACKEND, else gloo)."""
    timeout: float = 60.0
    """Seconds any wait of the replicas may take (joining, a heal, a state transfer)."""
    overlap: bool = False
    """Start the cross-replica sum of each FSDP2 unit's gradients during the backward
    pass (FSDP2's all-reduce hook) instead of after it (:class:`Overlap`)."""
    finish_wait: float = 0.0
    """Seconds the job may wait at its last step for every replica to be back (idle
    steps of ``IDLE_PACE`` seconds that change nothing), so that a replica restarting
    then ends with the others (0: the job ends with the replicas it has)."""
    report_folder: str = ""
    """Where each rank writes, at the end, what it trained ("": nowhere): the steps and
    their contributors, a digest of its registered state, the first epoch's weights."""


# ------------------------------------------------------------------ registered state


class Params:
    """The parameters of a model (or of torchtitan's ``model_parts``: names prefixed by
    the part's index) as registered state, by name, as they are (FSDP2's and TP's
    DTensors). torchtitan's model ``state_dict`` splits the fused ``wqkv`` with a
    collective on the replica's group; the parameters move between replicas of one
    layout without it.

    >>> sorted(Params(torch.nn.Linear(2, 1)).state_dict())
    ['bias', 'weight']
    >>> sorted(Params([torch.nn.Linear(2, 1)]).state_dict())
    ['0.bias', '0.weight']
    """

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module]) -> None:
        if isinstance(model, torch.nn.Module):
            self.model_parts, self._prefixed = [model], False
        elif isinstance(model, list) and all(isinstance(m, torch.nn.Module) for m in model):
            self.model_parts, self._prefixed = list(model), True
        else:
            raise TypeError(f"model must be a Module or a list of Modules, got {shown(model)}")

    def _named(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for index, part in enumerate(self.model_parts):
            for name, param in part.named_parameters():
                yield (f"{index}.{name}" if self._prefixed else name), param

    def state_dict(self) -> dict[str, Any]:
        return {name: param.detach() for name, param in self._named()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, param in self._named():
                value, mine = local(state[name]), local(param)
                if value.data_ptr() != mine.data_ptr():  # received in place: nothing to do
                    mine.copy_(value)


class RandomState:
    """torch's RNG (the CPU's, and this process's CUDA device's where there is one)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"].cpu())
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"].cpu())


class DataStream:
    """torchtitan's data loader as a position: the batches taken by committed steps.

    Every replica reads its own shard, the same number of batches per step, so the
    position (a count) is the same on every replica while the data is not. A step
    takes its batches with :meth:`take` and keeps them until :meth:`commit`: a step
    that is redone takes the same batches again. A replica that loads another
    position (a joiner, a checkpoint) replays its own shard from the start up to it:
    data loading, no compute.
    """

    def __init__(self, dataloader: Any, batches: Callable[[Any], Iterator[Batch]]) -> None:
        self._dataloader = dataloader
        self._batches = batches  # torchtitan's batch_generator
        self._initial = dataloader.state_dict()
        self._iterator: Iterator[Batch] | None = None
        self._pulled = 0  # batches the iterator yielded
        self._held: list[Batch] = []  # the current step's, from position onwards
        self.position = 0

    def take(self, count: int) -> list[Batch]:
        """The current step's ``count`` batches (the same ones until :meth:`commit`)."""
        if len(self._held) == count:
            return self._held
        if self._iterator is None or self._pulled > self.position:
            self._dataloader.load_state_dict(self._initial)
            self._iterator, self._pulled = self._batches(self._dataloader), 0
        while self._pulled < self.position:
            next(self._iterator)
            self._pulled += 1
        self._held = [next(self._iterator) for _ in range(count)]
        self._pulled += count
        return self._held

    def commit(self, count: int) -> None:
        self.position += count
        self._held = []

    def seek(self, position: int) -> None:
        """Take ``position`` (loaded state); the next :meth:`take` replays up to it."""
        if position != self.position or not self._held:
            self._held = []
            self.position = int(position)


class TrainState:
    """The trainer's counters as registered state: step, tokens seen, data position."""

    def __init__(self, trainer: ReplicatedTrainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, int]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.trainer.load_state_dict(state)


# ------------------------------------------------------------------ overlap


class Overlap:
    """The cross-replica sum of the gradients, started during the backward pass.

    FSDP2 calls each sharded parameter's post-accumulate-grad hooks once it wrote the
    parameter's gradient (reduced within the replica; autograd does the same for a
    parameter FSDP2 does not manage): there the gradient's sum along the epoch's dp
    group starts, while the backward pass goes on. :meth:`wait` waits for every
    sum. Off in an epoch's first step with joiners (their catch-up runs inside
    ``all_reduce_``, before any sum).
    """

    def __init__(self, model_parts: list[torch.nn.Module]) -> None:
        self._group: Any = None
        self._works: list[Any] = []
        self.failed: BaseException | None = None
        for part in model_parts:
            for param in part.parameters():
                register: Any = param.register_post_accumulate_grad_hook  # untyped in torch
                register(self._ready)

    def start(self, group: Any) -> None:
        """Sum along ``group`` in this step's backward pass (None: do nothing)."""
        self._group, self._works, self.failed = group, [], None

    def _ready(self, param: torch.Tensor) -> None:
        if self._group is None or param.grad is None or self.failed is not None:
            return
        try:
            self._works.append(self._group.allreduce([local(param.grad)]))
        except Exception as error:  # a dead peer: the verdict fails the step too
            self.failed = error

    def wait(self) -> bool:
        """Wait for every sum; False if one failed."""
        if self._group is None:
            return True
        for work in self._works:
            try:
                work.wait()
            except Exception as error:
                self.failed = self.failed or error
        self._group, self._works = None, []
        return self.failed is None


# ------------------------------------------------------------------ CPU and gloo


class _CpuDevice:
    """``torch.cpu`` with what torchtitan asks of a device module (a name, properties,
    memory statistics, ``set_device``): the CPU has none of those."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_properties(self, device: Any = None) -> Any:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("CpuProperties", (), {"total_memory": memory, "name": "cpu"})()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def set_device(self, device: Any) -> None:
        return None

    def synchronize(self, device: Any = None) -> None:
        return None


CPU_TARGETS = (
    ("torchtitan.tools.utils", ("device_type", "device_module", "get_local_device")),
    ("torchtitan.distributed.utils", ("device_type", "device_module", "get_local_device")),
    ("torchtitan.distributed.parallel_dims", ("device_type",)),
    ("torchtitan.components.metrics", ("device_type", "device_module")),
    ("torchtitan.tools.profiler", ("device_module",)),
    ("torchtitan.models.common.token_dispatcher", ("device_type", "device_module")),
)
"""The torchtitan 0.3.0 modules that copied its device at import, and what they copied."""


def run_on_cpu() -> list[str]:
    """Point torchtitan's device at the CPU (it picks ``"cuda"`` where it finds no
    accelerator, and ``torch.cpu`` has no ``get_device_name``): the module attributes
    its modules copied at import. Returns the attributes set. Only where CUDA is
    absent; the one place this module touches torchtitan's globals."""
    import importlib

    patched = []
    values: dict[str, Any] = {
        "device_type": "cpu",
        "device_module": _CpuDevice(),
        "get_local_device": lambda: torch.device("cpu"),
    }
    for module_name, names in CPU_TARGETS:
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                setattr(module, name, values[name])
                patched.append(f"{module_name}.{name}")
    return patched


def _causal_sdpa(config: Any) -> int:
    """FlexAttention (the language models' default) has no backward on CPU: causal SDPA
    computes the same attention for one document per sequence. Returns how many
    attention configs were swapped."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    swapped = 0
    model = config.model_spec.model
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        if parent is not None:
            setattr(parent, attr, ScaledDotProductAttention.Config())
            swapped += 1
    return swapped


def _sum_then_divide(model_parts: list[torch.nn.Module]) -> None:
    """gloo has neither AVG nor PREMUL_SUM: FSDP2 sums and divides."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


# ------------------------------------------------------------------ the section's values


def _resolved(section: ReplicasSection) -> ReplicasSection:
    """``section`` with every unset value read from the launcher's environment."""

    def env(name: str) -> str:
        value = os.environ.get(name)
        if value is None:
            raise ValueError(
                f"scopedmesh.{name.removeprefix('SCOPEDMESH_').lower()} is unset and so is "
                f"{name}: run under `scopedmesh replicas` or pass --scopedmesh.<field>"
            )
        return value

    def integer(value: int, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"scopedmesh.{name} must be an int, got {shown(value)}")
        if value >= 0:
            return value
        text = env(f"SCOPEDMESH_{name.upper()}")
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"SCOPEDMESH_{name.upper()} must be an int, got {text!r}") from None

    replica, replicas = integer(section.replica, "replica"), integer(section.replicas, "replicas")
    if replicas < 1:
        raise ValueError(f"scopedmesh.replicas must be at least 1, got {replicas}")
    if not 0 <= replica < replicas:
        raise ValueError(f"scopedmesh.replica must be in 0..{replicas - 1}, got {replica}")
    store = section.job_store or env("SCOPEDMESH_JOB_STORE")
    _address(store)
    backend = section.backend or os.environ.get("SCOPEDMESH_BACKEND") or "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"scopedmesh.backend must be 'gloo' or 'nccl', got {backend!r}")
    if not section.timeout > 0:
        raise ValueError(f"scopedmesh.timeout must be a positive number, got {section.timeout}")
    if not section.finish_wait >= 0:
        raise ValueError(f"scopedmesh.finish_wait must be >= 0, got {section.finish_wait}")
    return ReplicasSection(
        enable=section.enable,
        replica=replica,
        replicas=replicas,
        job_store=store,
        backend=backend,
        timeout=float(section.timeout),
        overlap=section.overlap,
        finish_wait=float(section.finish_wait),
        report_folder=section.report_folder,
    )


# ------------------------------------------------------------------ the trainer


class ReplicatedTrainer(Trainer):  # type: ignore[misc]  # torchtitan ships no types
    """torchtitan's ``Trainer``; with ``--scopedmesh.enable``, one replica of a job that
    grows back (the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):  # type: ignore[misc]
        scopedmesh: ReplicasSection = field(default_factory=ReplicasSection)

    def __init__(self, config: ReplicatedTrainer.Config) -> None:
        check_torchtitan_version()
        section = config.scopedmesh
        self.cpu_shims: list[str] = []
        if section.enable and not torch.cuda.is_available():
            self.cpu_shims = run_on_cpu()
            if _causal_sdpa(config):
                self.cpu_shims.append("FlexAttention -> causal SDPA")
        self.section = _resolved(section) if section.enable else section
        super().__init__(config)
        if not section.enable:
            return
        if not torch.cuda.is_available():
            _sum_then_divide(self.model_parts)
            self.cpu_shims.append("FSDP2 sums and divides")
        self._rebuild_dataloader()
        self.data = DataStream(self.dataloader, self.batch_generator)
        self.history: list[tuple[int, tuple[int, ...], float]] = []
        self.idle_steps = 0  # agreed idle steps at the end (finish_wait)
        self.overlap = Overlap(self.model_parts) if self.section.overlap else None
        self._summed_epoch = -1  # the epoch of this rank's last committed step
        self.step_times: list[float] = []  # when each committed step ended
        self.batches_per_step = (
            self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        )

    # ---------------------------------------------------------------- data and state

    def _rebuild_dataloader(self) -> None:
        """Each replica reads its own shard: the replica's batch ranks, after the
        replicas before it. The checkpoint keeps the position (train state), not
        the loader's own state (which differs per replica)."""
        config, parallel_dims = self.config, self.parallel_dims
        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            degree, rank = batch_mesh.size(), batch_mesh.get_local_rank()
        else:
            degree, rank = 1, 0
        self.dataloader = config.dataloader.build(
            dp_world_size=degree * self.section.replicas,
            dp_rank=self.section.replica * degree + rank,
            tokenizer=self.tokenizer,
            seq_len=config.training.seq_len,
            local_batch_size=(
                config.parallelism.pipeline_parallel_microbatch_size
                if parallel_dims.pp_enabled
                else config.training.local_batch_size
            ),
        )
        states = getattr(self.checkpointer, "states", None)
        if states is not None:
            states.pop("dataloader", None)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "ntokens_seen": self.ntokens_seen}
        if self.config.scopedmesh.enable:
            state["data_position"] = self.data.position
            state["idle_steps"] = self.idle_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])
        if self.config.scopedmesh.enable:
            default = self.step * self.batches_per_step
            self.data.seek(int(state_dict.get("data_position", default)))
            self.idle_steps = int(state_dict.get("idle_steps", 0))

    def registered(self) -> dict[str, Any]:
        """What a joiner receives: what torchtitan's checkpoint holds, and the RNG."""
        state: dict[str, Any] = {"model": Params(self.model_parts)}
        for index, optimizer in enumerate(self.optimizers.optimizers):
            state[f"optimizer{index}"] = optimizer
        state["lr_schedulers"] = self.lr_schedulers
        state["train_state"] = TrainState(self)
        state["rng"] = RandomState()
        return state

    # ---------------------------------------------------------------- the loop

    def train(self) -> None:
        if not self.config.scopedmesh.enable:
            super().train()
            return
        from scopedmesh.fault.replicas import Replicas

        config, section = self.config, self.section
        self.checkpointer.load(step=config.checkpoint.load_step)
        logger.info(
            f"scopedmesh: replica {section.replica} of {section.replicas}, step {self.step}"
            + (f"; on CPU: {', '.join(self.cpu_shims)}" if self.cpu_shims else "")
        )
        host, port = _address(section.job_store)
        store = dist.TCPStore(  # type: ignore[attr-defined]  # the launcher's job store
            host, port, is_master=False, timeout=timedelta(seconds=section.timeout)
        )
        state = self.registered()
        started = time.time()
        with (
            Replicas(
                store,
                replica=section.replica,
                replicas=section.replicas,
                state=state,
                backend=section.backend,
                timeout=section.timeout,
            ) as grow,
            config.profiler.build(
                global_step=self.step,
                base_folder=config.dump_folder,
                leaf_folder=f"replica_{section.replica}",
            ) as profiler,
        ):
            if not self._loop(grow, profiler):
                return
            if section.report_folder:
                self._report(Path(section.report_folder), grow, state, started)
        logger.info("Training completed")

    def _loop(self, grow: Any, profiler: Any) -> bool:
        """Train until every replica agreed to end (True), or until this replica finds
        the job finished before it was admitted (False: nothing to rejoin)."""
        config, section = self.config, self.section
        first = True
        while True:
            try:
                decision = grow.boundary()
            except JobFinishedError as error:
                logger.info(f"scopedmesh: {error}")
                return False
            if first and section.report_folder and decision.source == section.replica:
                if not self.step:  # the weights every replica starts from
                    self._report_weights(Path(section.report_folder))
            first = False
            self.gc_handler.run(self.step + 1)
            if self.step >= config.training.steps:
                waits = math.ceil(section.finish_wait / IDLE_PACE)
                if grow.size < section.replicas and self.idle_steps < waits:
                    self._replicated_step(grow, idle=True)  # an admission may come
                elif grow.finish():
                    return True
                continue
            if not self._replicated_step(grow):
                continue
            if decision.source == section.replica:  # one copy of the job's state
                self.checkpointer.save(self.step, last_step=(self.step == config.training.steps))
            if config.validator.enable and self.validator.should_validate(self.step):
                self.validator.validate(self.model_parts, self.step)
            profiler.step()

    def _replicated_step(self, grow: Any, *, idle: bool = False) -> bool:
        """One step; True if it was committed. Until the verdict nothing registered
        moves but the tokens seen, put back if the step is not committed.

        ``idle``: the job is done and waits for a replica (``finish_wait``): zeros
        instead of gradients, nothing applied. A joiner caught up by an idle
        source finds the step count at its end and applies nothing either.
        """
        tokens_before = self.ntokens_seen  # the forward adds this step's
        params = [p for part in self.model_parts for p in part.parameters()]
        if idle:
            tensors = [torch.zeros_like(local(p)) for p in params]
            if grow.all_reduce_([*tensors, torch.zeros(2, device=self.device)]):
                self.idle_steps += 1
            time.sleep(IDLE_PACE)
            return False
        parallel_dims = self.parallel_dims
        decision = grow.decision
        overlap = self.overlap
        if overlap is not None and decision.fresh and self._summed_epoch != decision.epoch:
            overlap.start(None)  # a catch-up step: the gradients go through all_reduce_
            overlap = None
        if overlap is not None:
            overlap.start(grow.dp_group)
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        batches = self.data.take(self.batches_per_step)
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _, labels in batches:
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
        global_valid_tokens = local_valid_tokens.to(self.device)
        if parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(
                global_valid_tokens, parallel_dims.get_mesh("batch")
            )
        accumulated = torch.zeros((), device=self.device)
        per = self.num_pipeline_parallel_microbatches
        for start in range(0, len(batches), per):
            group = batches[start : start + per]
            inputs = [{k: _to(v, self.device) for k, v in d.items()} for d, _ in group]
            targets = [lab.to(self.device) for _, lab in group]
            loss = self.forward_backward_step(
                input_dict=inputs if parallel_dims.pp_enabled else inputs[0],
                labels=targets if parallel_dims.pp_enabled else targets[0],
                global_valid_tokens=global_valid_tokens,
            )
            accumulated += loss.detach().reshape(()).to(accumulated.dtype)
        local_avg = accumulated * global_valid_tokens / local_valid_tokens.to(self.device)
        shown_losses = torch.stack([accumulated, local_avg.reshape(())]).float()
        for p in params:
            if p.grad is None:  # every member sends the same tensors
                p.grad = torch.zeros_like(p)
        # The counters a joiner receives are those before the step (the step's tokens
        # are the same on every replica): they move on commit.
        tokens, self.ntokens_seen = self.ntokens_seen - tokens_before, tokens_before
        summed = True
        if overlap is not None:  # the gradients' sums ran in the backward pass: the verdict's alone
            summed = overlap.wait()  # False: a peer died (the verdict fails too)
            tensors = [shown_losses]
        else:
            tensors = [*(local(p.grad) for p in params), shown_losses]
        if not grow.all_reduce_(tensors):
            return False
        if overlap is not None:
            if not summed:  # the others' sums went through, this rank's did not: restart it
                raise RuntimeError(f"a gradient sum failed here alone: {overlap.failed}")
            for p in params:
                local(p.grad).div_(len(grow.contributors))
        self._summed_epoch = decision.epoch
        if self.step >= self.config.training.steps:  # caught up by an idle source
            self.idle_steps += 1
            return False
        self.step += 1
        self.ntokens_seen += tokens
        self.step_times.append(time.time())
        self.data.commit(self.batches_per_step)
        grad_norm = dist_utils.clip_grad_norm_(
            params,
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self._log(grow, shown_losses, grad_norm, lr_metrics)
        return True

    def _log(
        self, grow: Any, losses: torch.Tensor, grad_norm: torch.Tensor, lr: dict[str, Any]
    ) -> None:
        """torchtitan's metrics, from the contributors' mean: alike on every replica."""
        parallel_dims = self.parallel_dims
        loss_mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims.dp_cp_enabled else None
        if loss_mesh is not None:
            avg = dist_utils.dist_sum(losses[0], loss_mesh)
            high = dist_utils.dist_max(losses[1], loss_mesh)
        else:
            avg, high = float(losses[0]), float(losses[1])
        self.history.append((self.step - 1, tuple(grow.contributors), float(avg)))
        if not self.metrics_processor.should_log(self.step):
            return
        tokens: Any = self.ntokens_seen
        if loss_mesh is not None:
            seen = torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device)
            tokens = dist_utils.dist_sum(seen, loss_mesh)
        extra = {"n_tokens_seen": tokens, **lr}
        self.metrics_processor.log(
            self.step, avg, high, float(grad_norm.item()), extra_metrics=extra
        )

    # ---------------------------------------------------------------- the report

    def _report_weights(self, folder: Path, name: str = "initial_weights.pt") -> None:
        """The weights, gathered (a collective on the replica's group, on the loop's
        thread): at the first epoch's source, what every replica starts from."""
        from torch.distributed.tensor import DTensor

        full = {}
        for key, value in Params(self.model_parts).state_dict().items():
            full[key] = value.full_tensor() if isinstance(value, DTensor) else value.clone()
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(full, folder / name)

    def _report(self, folder: Path, grow: Any, state: dict[str, Any], started: float) -> None:
        if grow.decision is not None and grow.decision.source == self.section.replica:
            self._report_weights(folder, "final_weights.pt")
        buffer = io.BytesIO()
        torch.save(local({k: v.state_dict() for k, v in state.items()}), buffer)
        record = {
            "replica": self.section.replica,
            "coordinate": dist.get_rank(),
            "digest": hashlib.sha256(buffer.getvalue()).hexdigest(),
            "parts": {
                k: hashlib.sha256(_saved(local(v.state_dict()))).hexdigest()
                for k, v in state.items()
            },
            "train_state": self.state_dict(),
            "lr": self.lr_schedulers.schedulers[0].get_last_lr(),
            "history": [[s, list(c), x] for s, c, x in self.history],
            "replicas": list(grow.decision.replicas) if grow.decision else [],
            "entered": [[e, t, list(r)] for e, t, r in grow.entered],
            "transfers": [[t.epoch, t.role, t.nbytes, t.seconds] for t in grow.transfers],
            "started": started,
            "step_times": self.step_times,
            "overlap": self.section.overlap,
            "pid": os.getpid(),
        }
        folder.mkdir(parents=True, exist_ok=True)
        name = f"rank-r{self.section.replica}c{dist.get_rank()}-{os.getpid()}.json"
        (folder / name).write_text(json.dumps(record))


def _address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (the launcher's ``SCOPEDMESH_JOB_STORE``) as ``(host, port)``."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"scopedmesh.job_store must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
