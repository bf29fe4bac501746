"""The agreement's I/O: runs the protocol's generators over a real store and death record.

The decisions live in :mod:`scopedmesh.fault.protocol.agreement` (and
:mod:`~scopedmesh.fault.protocol.verdict`), which yield requests; :class:`Driver`
carries each out on a store client, and sleeps on the watch's
:class:`~scopedmesh.fault.liveness.deaths.DeathRecord` until it is woken.

>>> import torch.distributed as dist
>>> from scopedmesh.c10d.store import WatchKeys
>>> from scopedmesh.fault.liveness.deaths import DeathRecord
>>> from scopedmesh.fault.protocol.agreement import Keys, agreement
>>> record = DeathRecord(WatchKeys("w"), 0, lambda new: None, ranks=(0,))
>>> driver = Driver(dist.HashStore(), record)
>>> driver.run(agreement(Keys("a"), [0], 0, committed=3, limit=5, tag="t"))
Outcome(lost=frozenset(), committed=3, wrote=True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from scopedmesh.c10d.store import read
from scopedmesh.fault.liveness.deaths import LEFT, DeathRecord
from scopedmesh.fault.protocol import verdict as rules
from scopedmesh.fault.protocol.agreement import (
    Add,
    Append,
    CompareSet,
    Get,
    KnownGone,
    Now,
    ReadGone,
    Sleep,
    Wake,
    line_key,
    line_of,
)

__all__ = ["Driver", "StepDriver", "ledger_requests"]

T = TypeVar("T")


class Driver:
    """Carries out a protocol generator's requests on ``store`` and ``record``; requests it
    does not know go to ``other`` (a step's: its vote, its mesh)."""

    def __init__(
        self, store: Any, record: DeathRecord, other: Callable[[Any], Any] | None = None
    ) -> None:
        self.store, self.record, self.other = store, record, other
        self._heard = record.heard  # news counted before the first request: none is missed

    def run(self, steps: Generator[Any, Any, T]) -> T:
        """Run ``steps`` to its end; its result (or what it raised)."""
        answer: Any = None
        while True:
            try:
                request = steps.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            answer = self.do(request)

    def do(self, request: Any) -> Any:
        """Carry out one request; its answer."""
        store, record = self.store, self.record
        if isinstance(request, Append):
            return store.append(request.key, request.value)
        if isinstance(request, Add):
            return int(store.add(request.key, request.amount))
        if isinstance(request, Get):
            return read(store, request.key)
        if isinstance(request, CompareSet):
            return store.compare_set(request.key, request.expected, request.desired).decode()
        if isinstance(request, Wake):
            return record.wake(store, request.ranks)
        if isinstance(request, ReadGone):
            return record.read(store)
        if isinstance(request, KnownGone):
            return record.lost
        if isinstance(request, Now):
            return time.monotonic()
        if isinstance(request, Sleep):
            heard = record.wait_for_news(self._heard, request.until - time.monotonic())
            woken, self._heard = heard != self._heard, heard
            return woken
        if self.other is None:
            raise TypeError(f"no one carries out {request!r}")
        return self.other(request)


class StepDriver:
    """Carries out a step verdict's own requests (:mod:`~scopedmesh.fault.protocol.verdict`)
    for the members ``lineup``, keyed ``key`` (:func:`~scopedmesh.fault.protocol.
    agreement.line_key`), on ``mesh``: its abort, the watch's lists of stops and asks, its
    :class:`~scopedmesh.fault.protocol.verdict.Ledger` (under ``lock``); ``vote`` takes
    part in the step's vote, ``note`` notes the agreement's name for the clean-up,
    ``stepped`` maps each key this rank steps on to its lineup."""

    def __init__(
        self,
        store: Any,
        record: DeathRecord,
        ledger: rules.Ledger,
        lock: threading.Lock,
        mesh: Any,
        lineup: rules.Lineup,
        *,
        key: str,
        vote: Callable[[int], int | None],
        note: Callable[[], None],
        stepped: dict[str, rules.Lineup],
    ) -> None:
        self.store, self.record, self.ledger, self.lock = store, record, ledger, lock
        self.mesh, self.lineup, self.members, self.key = mesh, lineup, lineup.ranks, key
        self.vote, self.note, self.stepped = vote, note, stepped

    def __call__(self, request: Any) -> Any:
        store, record, ledger, key = self.store, self.record, self.ledger, self.key
        if isinstance(request, rules.IsAborted):
            return self.mesh.aborted
        if isinstance(request, rules.AwaitAbort):
            deadline = time.monotonic() + request.seconds
            while not self.mesh.aborted and time.monotonic() < deadline:
                time.sleep(0.005)
            return self.mesh.aborted
        if isinstance(request, rules.PostStop):
            return record.stop(store, key, request.attempt)
        if isinstance(request, rules.AbortMesh):
            return self.mesh.abort(request.why)
        if isinstance(request, rules.Vote):
            return self.vote(request.flag)
        if isinstance(request, rules.Ask):
            self.note()
            with self.lock:  # past its vote: its own agreement answers for it
                ledger.answered.add((key, request.attempt))
            if request.doubt:
                record.ask(store, key, request.attempt, self.members)
            return None
        if isinstance(request, rules.FirstStop):
            return record.first_stop(store, key, request.attempt)
        if isinstance(request, rules.Departed):
            return {
                r: record.why[r].removeprefix(LEFT)
                for r in request.ranks
                if record.why.get(r, "").startswith(LEFT)
            }
        with self.lock:
            if isinstance(request, rules.Commit):
                return ledger.commit(key, request.attempt)
            if isinstance(request, rules.RaisedAgain):
                return ledger.raised_again(key, request.attempt)
            if isinstance(request, rules.Agreed):
                ledger.agreed(key, request.highest)
                after = self.lineup.after(request.lost)  # its re-formed mesh's, as reform's
                if after is not None and self.record.rank in after.layout:
                    moved = line_key(after.ranks, line_of(key))
                    self.stepped[moved] = after
                    ledger.moved(key, moved)
                return None
        raise TypeError(f"no one carries out {request!r}")


def ledger_requests(
    ledger: rules.Ledger,
    lock: threading.Lock,
    members: dict[str, rules.Lineup],
    on_fence: Callable[[tuple[tuple[str, int], ...]], None] = lambda chain: None,
) -> Callable[[Any], Any]:
    """Carries out an answer's requests of the ledger (:class:`~scopedmesh.fault.protocol.
    verdict.Steps`, :class:`~scopedmesh.fault.protocol.verdict.Fence`), under ``lock``;
    ``members`` maps each set of members stepped on to its lineup; ``on_fence`` is handed
    each chain fenced (the meshes of those attempts are settled without this rank)."""

    def do(request: Any) -> Any:
        with lock:
            if isinstance(request, rules.Steps):
                return ledger.steps(members)
            fenced = isinstance(request, rules.Fence) and ledger.fence(
                request.start, request.chain, request.count
            )
        if isinstance(request, rules.Fence):
            if fenced:  # None: answered already
                on_fence(request.chain)
            return fenced
        raise TypeError(f"no one carries out {request!r}")

    return do
