"""Workers of test_grow.py: a small replicated training job that grows back, and its
one-process reference.

Each replica has ``local`` ranks (its own WORLD, with a scoped mesh over them, as tp
would have inside a replica); rank ``c`` of every replica trains its own small
model ``c`` (a shard), Adam, on data drawn from (replica, c, step). The gradients
are averaged along the dp group of the epoch over the step's contributors (an
admitted joiner's first step contributes nothing); a loss all-reduce over the
replica's WORLD ties the replica's ranks into every step. The progress (step,
the history of (step, replicas, loss), RNG state) is registered state, so a
joiner receives it with the model and the optimizer.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d.store import read
from scopedmesh.fault.replicas import Replicas
from scopedmesh.mesh import ProcessGroupMesh

LR = 0.05
STOP, STEP = "test/stop", "test/step"  # with steps < 0: the step to stop at; the last step


def _debug(line: str) -> None:
    if os.environ.get("GROW_DEBUG"):
        os.write(2, f"{time.time():.3f} {line}\n".encode())


class Progress:
    """The loop's registered extras: step, the trajectory so far, the RNG state."""

    def __init__(self) -> None:
        self.step = 0
        self.history: list[tuple[int, tuple[int, ...], float]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "history": list(self.history), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.history = [
            (int(s), tuple(int(r) for r in m), float(v)) for s, m, v in state["history"]
        ]
        torch.set_rng_state(state["rng"])


def _going(store: Any, step: int, steps: int, whole: bool) -> bool:
    """Train ``steps`` steps, then on until the job is whole (agreed: the step and the
    epoch are the same on every member); with ``steps < 0``, until the step the test
    wrote under STOP, once whole."""
    if steps >= 0:
        return step < steps or (not whole and step < 50 * steps)
    stop = read(store, STOP)
    return stop is None or step < int(stop) or not whole


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def model_of(coordinate: int) -> torch.nn.Module:
    torch.manual_seed(1000 + coordinate)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(replica: int, coordinate: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(replica * 1_000_003 + coordinate * 10_007 + step)
    x = torch.randn(32, 4, generator=g)
    return x, (x.sum(dim=1, keepdim=True) * 0.5).sin()


def loss_of(model: torch.nn.Module, replica: int, coordinate: int, step: int) -> torch.Tensor:
    x, y = batch(replica, coordinate, step)
    device = next(model.parameters()).device
    return torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))


def accumulate(
    model: torch.nn.Module, grads: list[torch.Tensor], replica: int, coordinate: int, step: int
) -> torch.Tensor:
    """Add ``model``'s gradient of ``replica``'s loss at (``coordinate``, ``step``) to
    ``grads``; return the loss (for the one-process replays)."""
    model.zero_grad()
    loss = loss_of(model, replica, coordinate, step)
    loss.backward()
    for g, p in zip(grads, model.parameters()):
        g += p.grad
    return loss.detach()


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


def digest(state: dict[str, Any]) -> str:
    """The state's bytes' hash, wherever its tensors live (a GPU's index is no part of it)."""
    buffer = io.BytesIO()
    torch.save(_on_cpu(state), buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def train(
    replica: int,
    coordinate: int,
    job_port: int,
    replicas: int,
    steps: int,
    pace: float,
    backend: str = "gloo",
    finish: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """One rank of one replica: join (or rejoin), train ``steps`` steps, report. With
    ``finish``, the job ends by ``Replicas.finish`` (else each replica leaves its loop);
    the model and its gradients live on ``device``."""
    started = time.time()
    if os.environ.get("GROW_DEBUG"):
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1)
    store = dist.TCPStore("127.0.0.1", job_port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    model = model_of(coordinate).to(device)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    progress = Progress()
    state = {"model": model, "optim": optim, "progress": progress}
    first_full: float | None = None
    samples: list[tuple[int, int, int, int]] = []  # epoch, size, open fds, threads at its 1st step
    local = dist.get_world_size()
    inside_sums: set[float] = set()  # what the replica's own scoped mesh summed, every step
    skipped = 0  # steps this rank skipped while catching up
    with (
        Replicas(
            store, replica=replica, replicas=replicas, state=state, timeout=60, backend=backend
        ) as grow,
        ProcessGroupMesh(local, names=("tp",), timeout=60) as inside,  # the replica's WORLD
    ):
        tp = inside.get_group_along_axis("tp")
        while True:
            decision = grow.boundary()  # first: a pending heal or admission counts
            # Whole: at full shape, and the last agreed step trained there (the same on all).
            whole = decision.size == replicas and bool(progress.history)
            whole = whole and len(progress.history[-1][1]) == replicas
            if not _going(store, progress.step, steps, whole):
                if not finish or grow.finish():
                    break
                continue
            _debug(
                f"r{replica}c{coordinate} step {progress.step} epoch {decision.epoch} {decision.replicas}"
            )
            optim.zero_grad()
            if grow.catching_up and coordinate == 0:  # may skip what the catch-up discards
                skipped += 1
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                shown = torch.zeros(1, device=device)
            else:  # coordinate 1 computes on its stale state: its tensors are zeroed
                loss = loss_of(model, replica, coordinate, progress.step)
                loss.backward()
                shown = loss.detach().reshape(1).clone()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            ok = grow.all_reduce_([*grads, shown])
            if not ok:
                _debug(f"r{replica}c{coordinate} failed: {grow.failure}")
            if ok:
                optim.step()
                progress.history.append((progress.step, grow.contributors, float(shown[0])))
                progress.step += 1
                if first_full is None and decision.size == replicas:
                    first_full = time.time()
                if not samples or samples[-1][0] != decision.epoch:
                    samples.append(
                        (decision.epoch, decision.size, _fds(), threading.active_count())
                    )
                if steps < 0 and decision.source == replica and coordinate == 0:
                    store.set(STEP, str(progress.step))
                mark = torch.tensor([float(coordinate + 1)])
                dist.all_reduce(mark, group=tp)  # the replica's ranks meet every step
                inside_sums.add(float(mark[0]))
            time.sleep(pace)
        keys_left = store.num_keys()
        result = {
            "dp_group": grow.dp_group is not None,  # the last epoch's, along this coordinate
            "digest": digest({"model": model.state_dict(), "optim": optim.state_dict()}),
            "history": progress.history,
            "epoch": grow.decision.epoch if grow.decision else None,
            "size": grow.size,
            "replicas": grow.decision.replicas if grow.decision else (),
            "transfers": [(t.epoch, t.role, t.nbytes, t.seconds) for t in grow.transfers],
            "entered": list(grow.entered),
            "started": started,
            "first_full": first_full,
            "keys_left": keys_left,
            "inside": {"sums": sorted(inside_sums), "ranks": inside.get_ranks_in_group(tp)},
            "samples": samples,
            "skipped": skipped,
            "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "step": grow.step,
            "pointers": _pointers(model, optim),
        }
    return result


def _pointers(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[int]:
    """The storage addresses of the registered tensors (parameters, optimizer state)."""
    tensors = list(model.state_dict().values())
    for per_parameter in optim.state.values():
        tensors += [v for v in per_parameter.values() if isinstance(v, torch.Tensor)]
    return sorted(t.data_ptr() for t in tensors)


def train_on_nccl_stand_in(
    replica: int, coordinate: int, job_port: int, replicas: int, steps: int, pace: float
) -> dict[str, Any]:
    """:func:`train` with ``backend="nccl"``, ``ProcessGroupNCCL`` replaced by the CPU
    stand-in (tests/world/_nccl_double.py) and the dp groups' device by the CPU; the
    stand-in's records join the report."""
    import _nccl_double

    from scopedmesh.fault import dp_groups

    events: list[tuple[Any, ...]] = []
    dist.ProcessGroupNCCL = _nccl_double.nccl_stand_in(events)  # type: ignore[misc]
    dist.is_nccl_available = lambda: True
    dp_groups.nccl_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # else Replicas refuses NCCL
    result = train(replica, coordinate, job_port, replicas, steps, pace, "nccl", True)
    result["events"] = list(events)
    return result


def kill_and_rejoin(fn: Any, replicas: int, bound: float) -> tuple[Any, Any, list[int], Any]:
    """Launcher's side: ``replicas`` replicas of one rank run ``fn`` (``train`` with
    ``steps=-1`` and ``finish``); once the job trained 5 steps, replica 1 is SIGKILLed at
    a random moment and restarted at once; 5 steps after the job is whole again it
    finishes. Returns the results, the final job view, the replicas restarted, and the
    job's store (its server lives on in this process)."""
    from scopedmesh import job_view
    from scopedmesh.testing.replicas import ReplicaJob

    job = ReplicaJob(fn, replicas=replicas, local=1, args=(replicas, -1, 0.01), max_restarts=2)
    deadline = time.monotonic() + bound

    def until(what: str, condition: Any) -> None:
        while not condition():
            job.poll()
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"waited {bound:g} s for {what}; failures: {job.failures[-2:]}"
                )
            time.sleep(0.01)

    def whole(token: str | None) -> bool:
        view = job_view(job.store)
        if view is None or view.decision.size != replicas:
            return False
        return token is None or view.decision.token(1) != token

    job.start()
    try:
        until("the full shape", lambda: whole(None))
        until("a few steps", lambda: int(read(job.store, STEP) or 0) >= 5)
        view = job_view(job.store)
        token = None if view is None else view.decision.token(1)
        time.sleep(torch.rand(()).item() * 0.2)  # a random moment: a collective, a sleep
        if job.kill(1, 0) is None:
            raise AssertionError("replica 1 was not running when it was to be killed")
        until("the full shape again", lambda: whole(token))
        job.store.set(STOP, str(int(read(job.store, STEP) or 0) + 5))
        until("every replica to finish", lambda: job.done)
        return job.results, job_view(job.store), [r for r, _ in job.restarts], job.store
    finally:
        job.stop()


def reference(
    history: list[tuple[int, tuple[int, ...], float]], coordinate: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Replay ``history``'s schedule of contributors in one process: losses and final weights."""
    model = model_of(coordinate)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step, members, _ in history:
        optim.zero_grad()
        total = torch.zeros(())
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in members:
            total = total + accumulate(model, grads, r, coordinate, step)
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(members)
        optim.step()
        losses.append(float(total / len(members)))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
