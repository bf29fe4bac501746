"""Workers of test_grow_verdict.py (issue 37): one verdict per step for ``Replicas``.

``stateful``: a model with BatchNorm and dropout, a samples counter and the RNG
registered, every replica fed the same batch at each step (so BatchNorm's
running statistics and the dropout masks stay equal across replicas: what a
joiner must hold after its catch-up is exactly its source's). ``faulty``: a
replica whose state cannot move (a name the source lacks, a value
``weights_only`` refuses, an object pickle refuses) after its first heal.
``finishing``: a loop that ends with ``finish()``, one member of which treats
the last step's verdict as failed while its peer commits it (a death during
the verdict's MAX looks so from one side).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d.store import read
from scopedmesh.fault.replicas import Replicas

STOP, STEP = "test/stop", "test/step"


class Progress:
    """The loop's registered extras: the step, the samples seen, the RNG state, and
    (``extra``) whatever a faulty case puts there."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0
        self.extra: Any = None

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "samples": self.samples, "rng": torch.get_rng_state()}
        if self.extra is not None:
            state["extra"] = self.extra
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        torch.set_rng_state(state["rng"])


def model_of() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Dropout(0.5),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """A digest of every registered value, by dotted name (tensors by their bytes)."""
    found: dict[str, str] = {}
    for name, obj in state.items():
        for key, value in _leaves(obj.state_dict(), name):
            buffer = io.BytesIO()
            torch.save(value, buffer)
            found[key] = hashlib.sha256(buffer.getvalue()).hexdigest()[:16]
    return found


def _leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    if isinstance(value, list | tuple):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{prefix}.{i}")]
    return [(prefix, value)]


def _store(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]


def _step(model: torch.nn.Module, progress: Progress) -> list[torch.Tensor]:
    """The loop's work before the all-reduce: consumes the RNG (dropout), moves the
    counter and BatchNorm's running statistics."""
    x, y = _batch(progress.step)
    progress.samples += len(x)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def stateful(replica: int, coordinate: int, port: int, replicas: int) -> dict[str, Any]:
    """Train until the test's stop step, once whole; report every registered value."""
    store = _store(port)
    model = model_of()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    progress = Progress()
    state = {"model": model, "optim": optim, "progress": progress}
    caught_up = 0
    with Replicas(store, replica=replica, replicas=replicas, state=state, timeout=60) as grow:
        while True:
            decision = grow.boundary()
            stop = read(store, STOP)
            if stop is not None and progress.step >= int(stop) and decision.size == replicas:
                break
            caught_up += grow.catching_up
            grads = _step(model, progress)
            if grow.all_reduce_(grads):
                optim.step()
                progress.step += 1
                if decision.source == replica:
                    store.set(STEP, str(progress.step))
            time.sleep(0.02)
        received = [t.epoch for t in grow.transfers if t.role == "received"]
    return {"digests": _digests(state), "step": progress.step, "caught_up": caught_up,
            "received": received}  # fmt: skip


def faulty(
    replica: int, coordinate: int, port: int, replicas: int, case: str, steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps. Replica 1's restart (``case`` ``names``) registers a name the
    source lacks; replica 0's coordinate 0 puts a value in its state once it trained
    alone (``datetime``: refused by ``weights_only``; ``lock``: refused by pickle).
    Report what each call returned or raised, instead of raising."""
    store = _store(port)
    incarnation = store.add(f"test/starts/{replica}/{coordinate}", 1)
    model = model_of()
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    progress = Progress()
    state: dict[str, Any] = {"model": model, "optim": optim, "progress": progress}
    if case == "names" and replica == 1 and coordinate == 0 and incarnation > 1:
        state["extra"] = torch.nn.Linear(1, 1)
    events: list[tuple[int, str, str]] = []  # (step, what, detail) but for plain commits
    alone = False
    try:
        with Replicas(store, replica=replica, replicas=replicas, state=state, timeout=60) as grow:
            while progress.step < steps:
                decision = grow.boundary()
                alone = alone or decision.size < replicas
                if alone and replica == 0 and coordinate == 0 and progress.extra is None:
                    if case == "datetime":
                        progress.extra = datetime.datetime(2026, 11, 27)
                    elif case == "lock":
                        progress.extra = threading.Lock()
                grads = _step(model, progress)
                if grow.all_reduce_(grads):
                    optim.step()
                    progress.step += 1
                else:
                    events.append((progress.step, "redo", str(grow.failure)))
                time.sleep(0.02)
    except Exception as error:  # the outcome this test looks at
        cause = error.__cause__
        detail = f"{type(error).__name__}: {error}"
        if cause is not None:
            detail += f" <- {type(cause).__name__}: {cause}"
        events.append((progress.step, type(error).__name__, detail))
    return {"events": events, "step": progress.step, "incarnation": incarnation}


class _Splitting(Replicas):
    """A member that sees the verdict of step ``split_at`` as failed while its peers see it
    succeed, as when a peer dies during the verdict's MAX (test hook)."""

    split_at = -1
    step = 0

    def _agree(self, flags: torch.Tensor, ok: bool) -> bool:  # type: ignore[override]
        ok = super()._agree(flags, ok)  # type: ignore[misc]
        if ok and self.step == self.split_at:
            self.split_at = -1
            self._pg = None  # as a MAX cut short here: the peers' next collective fails
            flags[0] = 1
            return False
        return ok


def finishing(
    replica: int, coordinate: int, port: int, replicas: int, steps: int, split: int
) -> dict[str, Any]:
    """Train ``steps`` steps and ``finish()``; replica ``split`` sees the last step's verdict
    fail while its peers commit it. Then a new incarnation of this replica starts after
    the end: what its first boundary says."""
    store = _store(port)
    model = model_of()
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    progress = Progress()
    state = {"model": model, "optim": optim, "progress": progress}
    unfinished = 0
    with _Splitting(store, replica=replica, replicas=replicas, state=state, timeout=60) as grow:
        grow.split_at = steps - 1 if replica == split else -1
        while True:
            grow.boundary()
            if progress.step >= steps:
                if grow.finish():
                    break
                unfinished += 1
                continue
            grow.step = progress.step
            grads = _step(model, progress)
            if grow.all_reduce_(grads):
                optim.step()
                progress.step += 1
    later = "no error"
    try:
        with Replicas(store, replica=replica, replicas=replicas, state=state, timeout=60) as again:
            again.boundary()
    except Exception as error:
        later = f"{type(error).__name__}: {error}"
    return {"digests": _digests(state), "step": progress.step, "unfinished": unfinished,
            "later": later}  # fmt: skip
