"""A replicated job's membership records in its store: who announced itself, each
epoch's decision (written once), and the clean-up of what older epochs left.

One :class:`Records` per slot, over the job's store; what the records mean
(:class:`~scopedmesh.fault.membership.Decision`, :func:`~scopedmesh.fault.membership.propose`)
is pure and lives in :mod:`~scopedmesh.fault.membership`.

>>> import torch.distributed as dist
>>> from scopedmesh.c10d.store import ReplicaKeys
>>> store = dist.HashStore()
>>> records = Records(store, ReplicaKeys(), replicas=2, local=1, probes=None)
>>> records.decide(Decision(0, ((0, "a"),), 0, 1)), records.decide(Decision(0, (), 0, 2))
('members=0:a;source=0;joins=1', 'members=0:a;source=0;joins=1')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.fault.membership import Decision, complete_joiners
from scopedmesh.fault.probes import SlotProbes

__all__ = ["JobView", "Records", "job_view"]


class Records:
    """The membership records of a job of ``replicas`` replicas of ``local`` slots, in
    ``store``; ``probes`` tells a dead incarnation's announcement from a live one's."""

    def __init__(
        self, store: Any, keys: ReplicaKeys, replicas: int, local: int, probes: SlotProbes | None
    ) -> None:
        self._store, self._keys, self._probes = store, keys, probes
        self.replicas, self.local = replicas, local

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
    """A replicated job as its store shows it: the newest epoch formed, and whether the
    job finished (:meth:`Replicas.finish <scopedmesh.fault.replicas.Replicas.finish>`).

    ``decision`` holds the epoch, its members (replica, incarnation token), the
    source replica and the joins counted; what :meth:`Replicas.boundary` returns.
    """

    decision: Decision
    finished: bool

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
    epoch that formed, or None before the first; reads only (three requests), from any
    process.

    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> job_view(store) is None
    True
    >>> _ = Records(store, ReplicaKeys(), 2, 1, None).decide(Decision(0, ((0, "a"),), 0, 1))
    >>> store.set(ReplicaKeys().latest, "0")  # what the epoch's members write once formed
    >>> view = job_view(store)
    >>> view.epoch, view.replicas, view.finished
    (0, (0,), False)
    """
    keys = ReplicaKeys()
    latest = read(store, keys.latest)
    text = None if latest is None else read(store, keys.decision(int(latest)))
    if latest is None or text is None:
        return None
    finished = read(store, keys.finished)
    return JobView(Decision.parse(int(latest), finished or text), finished is not None)
