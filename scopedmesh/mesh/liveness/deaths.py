"""The death record: which members a watch has learned are dead, and why; declared in the store.

A death is declared once, by whoever sees it first: ``compare_set`` on
``<prefix>/lost/<rank>``, then an entry ``rank:reason,`` on the list
``<prefix>/lost`` and an ``add`` on the counter ``<prefix>/deaths``, which
every watch polls. Learning a death (from a socket or from the store) records
when and why, and hands the new deaths to whoever must act on them (the guard).

>>> parse_deaths("3:closed,5:unreachable,")
{3: 'closed', 5: 'unreachable'}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scopedmesh.c10d.store import WatchKeys, read

__all__ = ["CLOSED", "UNREACHABLE", "DeathRecord", "parse_deaths"]

CLOSED = "closed"  # why a rank is lost: its connection closed without a goodbye
UNREACHABLE = "unreachable"  # why a rank is lost: its host stopped answering


def parse_deaths(text: str) -> dict[int, str]:
    """The store's list of deaths (``"3:closed,5:unreachable,"``) as rank -> reason."""
    entries = (item.partition(":") for item in text.split(",") if item)
    return {int(rank): reason for rank, _, reason in entries}


class DeathRecord:
    """The deaths one watch has learned: ``lost`` (never shrinks), why and when.

    ``on_new`` is called with each set of newly learned deaths (the guard
    aborts the meshes they hit).

    >>> record = DeathRecord(WatchKeys("w"), 0, lambda new: print(sorted(new)))
    >>> record.learn({3: CLOSED}); record.learn({3: CLOSED}); record.lost
    [3]
    frozenset({3})
    """

    def __init__(self, keys: WatchKeys, rank: int, on_new: Callable[[set[int]], None]) -> None:
        self.keys, self.rank, self.on_new = keys, rank, on_new
        self.lost: frozenset[int] = frozenset()
        self.why: dict[int, str] = {}  # rank -> CLOSED or UNREACHABLE, as its watcher saw it
        self.learned: dict[int, float] = {}  # rank -> time.time() this process learned it died

    def learn(self, dead: dict[int, str]) -> None:
        """Learn the deaths in ``dead`` (rank -> reason); hand the new ones to ``on_new``."""
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
        """Write ``rank``'s death and ``reason`` to the store (once, whoever sees it first),
        so that the others learn it first; then learn it here, even if the store failed."""
        me = f"{self.rank}:{reason}"
        try:
            if store.compare_set(self.keys.lost_of(rank), "", me).decode() == me:
                store.append(self.keys.lost, f"{rank}:{reason},")
                store.add(self.keys.deaths, 1)
        finally:
            self.learn({rank: reason})

    def read(self, store: Any) -> frozenset[int]:
        """Learn every death the store lists (one request); the lost set after."""
        self.learn(parse_deaths(read(store, self.keys.lost) or ""))
        return self.lost

    def poll(self, store: Any, seen: int) -> int:
        """Learn the store's deaths if its counter moved from ``seen``; the counter's value."""
        count = int(store.add(self.keys.deaths, 0))
        if count != seen:
            self.learn(parse_deaths(store.get(self.keys.lost).decode()))
        return count
