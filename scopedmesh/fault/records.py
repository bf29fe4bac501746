"""A replicated job's membership records in its store: who announced itself, each
epoch's decision (written once), the clean-up of what older epochs left, and the
job's step as a launcher reads it (:func:`job_view`).

One :class:`Records` per slot, over the job's store; what the records mean
(:class:`~scopedmesh.fault.protocol.membership.Decision`,
:func:`~scopedmesh.fault.protocol.membership.propose`)
is pure and lives in :mod:`~scopedmesh.fault.protocol.membership`.

>>> import torch.distributed as dist
>>> from scopedmesh.c10d.store import ReplicaKeys
>>> store = dist.HashStore()
>>> records = Records(store, ReplicaKeys(), replicas=2, local=1, probes=None)
>>> records.decide(Decision(0, ((0, "a"),), 0, 1)), records.decide(Decision(0, (), 0, 2))
('members=0:a;source=0;joins=1', 'members=0:a;source=0;joins=1')
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.errors import JobMismatchError
from scopedmesh.fault.probes import SlotProbes
from scopedmesh.fault.protocol.membership import Decision, JobShape, complete_joiners

__all__ = [
    "REPORT_EVERY",
    "STEP_NAME",
    "JobView",
    "Records",
    "StepCount",
    "check_shape",
    "job_view",
    "with_step",
]

STEP_NAME = "scopedmesh.step"  # the registered state's name for the job's step count
REPORT_EVERY = 1.0  # seconds: the source writes the step at most this often between epochs


class StepCount:
    """The job's agreed steps, registered with the replica's state under :data:`STEP_NAME`,
    so that it travels with the state: a joiner (or, after a heal, every member) holds
    the source's count, the one that matches the weights it received."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = int(state["step"])


def with_step(state: dict[str, Any]) -> tuple[dict[str, Any], StepCount]:
    """``state`` with a :class:`StepCount` registered under :data:`STEP_NAME`; a
    ``ValueError`` if the loop's own state uses that name.

    >>> state, count = with_step({"model": None})
    >>> sorted(state), count.value
    (['model', 'scopedmesh.step'], 0)
    """
    if STEP_NAME in state:
        raise ValueError(
            f"state must not register the name {STEP_NAME!r}: Replicas registers the job's "
            f"step count under it"
        )
    count = StepCount()
    return {**state, STEP_NAME: count}, count


def check_shape(store: Any, keys: ReplicaKeys, mine: JobShape) -> JobShape:
    """The job's shape: ``mine`` if this slot is the job's first to start (it writes it,
    ``compare_set``), else the one the store holds; a :class:`JobMismatchError` naming
    both values if they differ (nothing written then).

    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> check_shape(store, ReplicaKeys(), JobShape(3, 2, replica=1))
    JobShape(replicas=3, local=2, replica=1)
    >>> check_shape(store, ReplicaKeys(), JobShape(4, 2, replica=0))
    Traceback (most recent call last):
    scopedmesh.errors.JobMismatchError: replica 0: replicas=4 differs from the job's replicas=3, set by replica 1. Every replica of a job starts with the same replicas= and the same number of ranks in its group; this one was refused before it took part, and a restart with these arguments will not help
    """
    value = store.compare_set(keys.shape, "", mine.text())
    job = JobShape.parse(value.decode() if isinstance(value, bytes) else str(value))
    refusal = mine.refusal(job)
    if refusal is not None:
        raise JobMismatchError(
            f"replica {mine.replica}: {refusal}. Every replica of a job starts with the same "
            f"replicas= and the same number of ranks in its group; this one was refused "
            f"before it took part, and a restart with these arguments will not help"
        )
    return job


class Records:
    """The membership records of a job of ``replicas`` replicas of ``local`` slots, in
    ``store``; ``probes`` tells a dead incarnation's announcement from a live one's."""

    def __init__(
        self, store: Any, keys: ReplicaKeys, replicas: int, local: int, probes: SlotProbes | None
    ) -> None:
        self._store, self._keys, self._probes = store, keys, probes
        self.replicas, self.local = replicas, local
        self._reported = -REPORT_EVERY  # when this slot last wrote the step (monotonic)

    def entered(self, epoch: int, step: int) -> None:
        """By the source's first slot, once an epoch formed: the newest epoch, and the
        step it starts at."""
        self._store.set(self._keys.step, str(step))
        self._store.set(self._keys.latest, str(epoch))
        self._reported = time.monotonic()

    def count(self, count: StepCount, reports: bool) -> Callable[[], None] | None:
        """An agreed step: one more in ``count``. If this slot ``reports`` (the source's
        first) and :data:`REPORT_EVERY` seconds passed since its last write, the write of
        the step to the store, for the caller to make (one request a second at most, by
        one slot of the job); else None."""
        count.value += 1
        now = time.monotonic()
        if not reports or now - self._reported < REPORT_EVERY:
            return None
        self._reported = now
        return functools.partial(self._store.set, self._keys.step, str(count.value))

    def finished(self, decision: Decision, step: int) -> None:
        """By the source's first slot, once every member agreed the job ended: its final
        step, then the end (the last epoch's decision)."""
        self._store.set(self._keys.step, str(step))
        self._store.set(self._keys.finished, decision.text())

    def joiners(self, current: Decision) -> dict[int, str]:
        """Replicas whose every slot announced one token that ``current`` does not hold,
        and whose slots are not dead (a dead incarnation's announcement stays)."""
        keys = [self._keys.join(r, c) for r in range(self.replicas) for c in range(self.local)]
        values = [read(self._store, k) for k in keys]
        announced = [
            (r, c, values[r * self.local + c])
            for r in range(self.replicas)
            for c in range(self.local)
        ]
        found = complete_joiners(announced, self.local)
        return {r: t for r, t in found.items() if current.token(r) != t and not self._gone(r, t)}

    def decide(self, proposal: Decision) -> str:
        """Write ``proposal`` unless an epoch's decision exists; return the one that stands."""
        value = self._store.compare_set(self._keys.decision(proposal.epoch), "", proposal.text())
        return value.decode() if isinstance(value, bytes) else str(value)

    def clean(self, decision: Decision) -> None:
        """Once per epoch, after its first agreed step: delete older epochs' keys."""
        store, keys = self._store, self._keys
        cleaned = int(read(store, keys.cleaned) or 0)
        if cleaned > decision.epoch:
            return
        current = set(decision.members)
        for epoch in range(cleaned, decision.epoch):
            text = read(store, keys.decision(epoch))
            old = Decision.parse(epoch, text).members if text is not None else ()
            for r, t in old:
                if (r, t) not in current:
                    for c in range(self.local):
                        store.delete_key(keys.address(r, c, t))
            for key in keys.epoch_keys(epoch, self.replicas, self.local):
                store.delete_key(key)
        formed = [keys.ready(decision.epoch, r, c) for r, c in self.slots()]
        formed += [
            keys.gloo_address(decision.epoch, c, m)
            for c in range(self.local)
            for m in range(decision.size)
        ]
        source = decision.index(decision.source)
        for c in range(self.local):  # an NCCL group's ids: its own, the catch-up's pairs
            formed.append(keys.nccl_id(decision.epoch, c))
            formed += [
                keys.nccl_id(decision.epoch, c, (source, decision.index(r))) for r in decision.fresh
            ]
        for key in formed:  # every member formed; its check-ins may still come
            store.delete_key(key)
        store.set(keys.cleaned, str(decision.epoch))  # its decision and check-ins stay

    def slots(self) -> list[tuple[int, int]]:
        return [(r, c) for r in range(self.replicas) for c in range(self.local)]

    def _gone(self, replica: int, token: str) -> bool:
        probes = self._probes
        return probes is not None and any(probes.gone(replica, c, token) for c in range(self.local))


@dataclass(frozen=True)
class JobView:
    """A replicated job as its store shows it: the newest epoch formed, whether the job
    finished (:meth:`Replicas.finish <scopedmesh.fault.replicas.Replicas.finish>`), and
    its step.

    ``decision`` holds the epoch, its members (replica, incarnation token), the
    source replica and the joins counted; what :meth:`Replicas.boundary` returns.
    ``step`` is the job's agreed steps (:attr:`Replicas.step
    <scopedmesh.fault.replicas.Replicas.step>`) as the source last wrote them: when
    an epoch formed, then at most once a second (:data:`REPORT_EVERY`) after an
    agreed step, and at the end (exact once ``finished``); so up to a second and a
    step behind while the job runs. None from a store no such source wrote to.
    """

    decision: Decision
    finished: bool
    step: int | None = None

    @property
    def epoch(self) -> int:
        """The newest epoch formed."""
        return self.decision.epoch

    @property
    def replicas(self) -> tuple[int, ...]:
        """The member replicas of that epoch, ascending."""
        return self.decision.replicas


def job_view(store: Any) -> JobView | None:
    """What a launcher or a dashboard reads of a replicated job in ``store``: the newest
    epoch that formed and the job's step, or None before the first epoch; reads only
    (four requests), from any process.

    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> job_view(store) is None
    True
    >>> _ = Records(store, ReplicaKeys(), 2, 1, None).decide(Decision(0, ((0, "a"),), 0, 1))
    >>> store.set(ReplicaKeys().latest, "0")  # what the epoch's members write once formed
    >>> store.set(ReplicaKeys().step, "12")  # and, at most once a second, the source
    >>> view = job_view(store)
    >>> view.epoch, view.replicas, view.finished, view.step
    (0, (0,), False, 12)
    """
    keys = ReplicaKeys()
    latest = read(store, keys.latest)
    text = None if latest is None else read(store, keys.decision(int(latest)))
    if latest is None or text is None:
        return None
    finished = read(store, keys.finished)
    step = read(store, keys.step)
    decision = Decision.parse(int(latest), finished or text)
    return JobView(decision, finished is not None, None if step is None else int(step))
