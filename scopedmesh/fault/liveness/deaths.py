"""The death record: which members a watch has learned are dead, and why; declared in the store.

A death is declared by one atomic write, whoever sees it: an entry
``rank:reason,`` appended to the list ``<prefix>/lost`` (the first entry of a
rank gives its reason; a second watcher's entry is a harmless duplicate).
The declarer then adds 1 to the counter ``<prefix>/deaths``, a hint that every
watch polls (one request an interval) and that tells it to read the list. A
declarer that dies between its two writes leaves the hint short: every watch
also reads the list every :data:`REREAD_EVERY` polls, so the death is learned
a few intervals later, never lost. Learning a death (from a socket or from
the store) records when and why, and hands the new deaths to whoever must act
on them (the guard).

A member whose own step raised posts a *stop* the same way: an entry
``rank:attempt,`` appended to ``<prefix>/stops``, then the same hint. Every watch
hands each stop it learns, once, to whoever aborts the meshes holding that
rank, without counting the rank as lost: its step fails everywhere, and
nobody waits for its collectives' timeout (:class:`~scopedmesh.fault.liveness.step.Step`).

>>> parse_deaths("3:closed,5:unreachable,")
{3: 'closed', 5: 'unreachable'}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from scopedmesh.c10d.store import WatchKeys, read

__all__ = ["CLOSED", "REREAD_EVERY", "UNREACHABLE", "DeathRecord", "parse_deaths", "parse_stops"]

CLOSED = "closed"  # why a rank is lost: its connection closed without a goodbye
UNREACHABLE = "unreachable"  # why a rank is lost: its host stopped answering
REREAD_EVERY = 25  # polls: how often the list of deaths is read whatever its counter says


def parse_deaths(text: str) -> dict[int, str]:
    """The store's list of deaths (``"3:closed,5:unreachable,"``) as rank -> reason; the
    first entry of a rank gives its reason."""
    found: dict[int, str] = {}
    for rank, _, reason in (item.partition(":") for item in text.split(",") if item):
        found.setdefault(int(rank), reason)
    return found


def parse_stops(text: str) -> list[tuple[int, int]]:
    """The store's list of stops (``"3:0,1:2,"``) as (rank, attempt), in posting order.

    >>> parse_stops("3:0,1:2,")
    [(3, 0), (1, 2)]
    """
    return [
        (int(rank), int(attempt))
        for rank, _, attempt in (item.partition(":") for item in text.split(",") if item)
    ]


class DeathRecord:
    """The deaths one watch has learned: ``lost`` (never shrinks), why and when.

    ``on_new`` is called with each set of newly learned deaths (the guard
    aborts the meshes they hit).

    >>> record = DeathRecord(WatchKeys("w"), 0, lambda new: print(sorted(new)))
    >>> record.learn({3: CLOSED}); record.learn({3: CLOSED}); record.lost
    [3]
    frozenset({3})
    """

    def __init__(
        self,
        keys: WatchKeys,
        rank: int,
        on_new: Callable[[set[int]], None],
        on_stop: Callable[[set[tuple[int, int]]], None] | None = None,
    ) -> None:
        self.keys, self.rank, self.on_new = keys, rank, on_new
        self.on_stop = on_stop  # handed each new stop as (rank, attempt)
        self._stops_seen = 0  # entries of the stops list handed over already
        self.lost: frozenset[int] = frozenset()
        self.why: dict[int, str] = {}  # rank -> CLOSED or UNREACHABLE, as its watcher saw it
        self.learned: dict[int, float] = {}  # rank -> time.time() this process learned it died
        self._polls = 0
        self._lock = threading.Lock()  # both threads learn: no update may overwrite another

    def learn(self, dead: dict[int, str]) -> None:
        """Learn the deaths in ``dead`` (rank -> reason); hand the new ones to ``on_new``.

        Safe from both threads: the lost set is read and replaced under a lock,
        and each death is handed over once.
        """
        with self._lock:
            new = set(dead).difference(self.lost)
            if not new:
                return
            now = time.time()
            for rank in new:
                self.learned[rank] = now
                self.why[rank] = dead[rank]
            self.lost = self.lost | new
        self.on_new(new)

    def declare(self, store: Any, rank: int, reason: str) -> None:
        """Write ``rank``'s death and ``reason`` to the store (one append), so that the
        others learn it first; then learn it here, even if the store failed."""
        try:
            store.append(self.keys.lost, f"{rank}:{reason},")
            store.add(self.keys.deaths, 1)
        finally:
            self.learn({rank: reason})

    def read(self, store: Any) -> frozenset[int]:
        """Learn every death the store lists (one request); the lost set after."""
        self.learn(parse_deaths(read(store, self.keys.lost) or ""))
        return self.lost

    def stop(self, store: Any, count: int) -> None:
        """Post that this rank's step raised in attempt ``count`` (one append, then the hint)."""
        store.append(self.keys.stops, f"{self.rank}:{count},")
        store.add(self.keys.deaths, 1)

    def first_stop(self, store: Any, count: int) -> int | None:
        """The rank whose stop of ``count`` was posted first, or None (one request)."""
        stops = parse_stops(read(store, self.keys.stops) or "")
        return next((rank for rank, attempt in stops if attempt == count), None)

    def read_stops(self, store: Any) -> None:
        """Hand the stops posted since the last read to ``on_stop`` (one request)."""
        stops = parse_stops(read(store, self.keys.stops) or "")
        with self._lock:
            new, self._stops_seen = stops[self._stops_seen :], max(self._stops_seen, len(stops))
        if new and self.on_stop is not None:
            self.on_stop(set(new))

    def poll(self, store: Any, seen: int) -> int:
        """Learn the store's deaths if its counter moved from ``seen`` (one request; one
        more then, and every :data:`REREAD_EVERY` polls); the counter's value."""
        self._polls += 1
        count = int(store.add(self.keys.deaths, 0))
        if count != seen:
            self.read_stops(store)
        if count != seen or self._polls % REREAD_EVERY == 0:
            self.read(store)
        return count
