"""The death record: which members a watch has learned are dead, and why; declared in the store.

A death is declared by one atomic write, whoever sees it: an entry
``rank:reason,`` appended to the list ``<prefix>/lost`` (the first entry of a
rank gives its reason; a second watcher's entry is a harmless duplicate).
The first declarer of a rank (a counter per rank says which) then wakes every
member: one ``multi_set`` of the members' *wake* keys, on each of which one
member's watch blocks in a server-side ``wait``. Nobody polls: an idle job
asks nothing of the store, whatever its size. A woken member deletes its
wake key and reads both lists in one request (:meth:`DeathRecord.take`).
A declarer that dies between its writes leaves its death listed but nobody
woken; its own death is then declared by its watchers, and that wake-up
makes everyone read the list. Learning a death (from a socket or from the
store) records when and why, and hands the new deaths to whoever must act on
them (the guard).

A member whose own step raised posts a *stop* the same way: an entry
``rank:members/attempt,`` appended to ``<prefix>/stops``, then the same
wake-up. Every watch hands each stop it learns, once, to whoever aborts the
meshes of those members that hold that rank, without counting the rank as
lost: its step fails everywhere, and nobody waits for its collectives'
timeout (:class:`~scopedmesh.fault.liveness.step.Step`). A member in doubt
about a step posts an *ask* (``members/attempt,`` on ``<prefix>/asks``): each
member's watch answers it for its rank (:mod:`~scopedmesh.fault.protocol.verdict`).

A member that **leaves** (its watch closed after an exception, ``SystemExit``
or ``KeyboardInterrupt``) is listed like a death, with the reason ``left:``
and the exception's type and message: every agreement and formation counts it
gone at once, and the survivors' step names what it raised.

>>> parse_deaths("3:closed,5:unreachable,2:left:ValueError: bad shape,")
{3: 'closed', 5: 'unreachable', 2: 'left:ValueError: bad shape'}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from scopedmesh.c10d.store import WatchKeys, read

__all__ = [
    "CLOSED",
    "LEFT",
    "UNREACHABLE",
    "DeathRecord",
    "departure",
    "parse_asks",
    "parse_deaths",
    "parse_stops",
]

CLOSED = "closed"  # why a rank is lost: its connection closed without a goodbye
UNREACHABLE = "unreachable"  # why a rank is lost: its host stopped answering
LEFT = "left:"  # why a rank is gone: it left after an exception (its type and message follow)


def departure(error: BaseException) -> str:
    """The reason a member that leaves after ``error`` is listed with (one line, no comma).

    >>> departure(ValueError("bad, shape"))
    'left:ValueError: bad; shape'
    """
    text = f"{type(error).__name__}: {error}".replace(",", ";").replace("\n", " ")
    return LEFT + text[:300]


def parse_deaths(text: str) -> dict[int, str]:
    """The store's list of deaths (``"3:closed,5:unreachable,"``) as rank -> reason; the
    first entry of a rank gives its reason."""
    found: dict[int, str] = {}
    for rank, _, reason in (item.partition(":") for item in text.split(",") if item):
        found.setdefault(int(rank), reason)
    return found


def parse_stops(text: str) -> list[tuple[int, str, int]]:
    """The store's list of stops (``"3:m4.0-3/0,"``) as (rank, members, attempt), in
    posting order.

    >>> parse_stops("3:m4.0-3/0,1:m2.0-1/2,")
    [(3, 'm4.0-3', 0), (1, 'm2.0-1', 2)]
    """
    stops = []
    for rank, _, where in (item.partition(":") for item in text.split(",") if item):
        members, _, attempt = where.rpartition("/")
        stops.append((int(rank), members, int(attempt)))
    return stops


def parse_asks(text: str) -> list[tuple[str, int]]:
    """The store's list of asks (``"m4.0-3/2,"``) as (members, attempt), in posting order.

    >>> parse_asks("m4.0-3/2,m2.0-1/0,")
    [('m4.0-3', 2), ('m2.0-1', 0)]
    """
    return [
        (members, int(attempt))
        for members, _, attempt in (item.rpartition("/") for item in text.split(",") if item)
    ]


class DeathRecord:
    """The deaths one watch has learned: ``lost`` (never shrinks), why and when.

    ``on_new`` is called with each set of newly learned deaths (the guard
    aborts the meshes they hit); ``ranks`` are the members a declaration wakes.
    :meth:`wait_for_news` lets a caller (an agreement) sleep until the store
    woke this member or a death was learned, asking the store nothing meanwhile.

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
        on_stop: Callable[[set[tuple[int, str, int]]], None] | None = None,
        ranks: tuple[int, ...] = (),
        on_ask: Callable[[list[tuple[str, int]]], None] | None = None,
    ) -> None:
        self.keys, self.rank, self.on_new, self.ranks = keys, rank, on_new, ranks
        self.on_stop = on_stop  # handed each new stop as (rank, members, attempt)
        self.on_ask = on_ask  # handed each new ask as (members, attempt)
        self._stops_seen = 0  # entries of the stops list handed over already
        self._asks_seen = 0  # entries of the asks list handed over already
        self.lost: frozenset[int] = frozenset()
        self.why: dict[int, str] = {}  # rank -> CLOSED or UNREACHABLE, as its watcher saw it
        self.learned: dict[int, float] = {}  # rank -> time.time() this process learned it died
        self._lock = threading.Lock()  # the threads learn: no update may overwrite another
        self._news = threading.Condition()  # notified at each wake-up and each death learned
        self.heard = 0  # how many times it was notified (wait_for_news compares)

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
        self.notify()

    def notify(self) -> None:
        """Wake whoever waits for news (:meth:`wait_for_news`)."""
        with self._news:
            self.heard += 1
            self._news.notify_all()

    def wait_for_news(self, heard: int, timeout: float) -> int:
        """Sleep until :attr:`heard` passes ``heard`` or ``timeout`` seconds pass; the count."""
        with self._news:
            self._news.wait_for(lambda: self.heard != heard, max(0.0, timeout))
            return self.heard

    def wake(self, store: Any, ranks: Iterable[int] | None = None) -> None:
        """Wake ``ranks`` (default: every member not known lost) through their wake keys:
        one ``multi_set``, whatever their number."""
        targets = [r for r in (self.ranks if ranks is None else ranks) if r not in self.lost]
        if targets:
            store.multi_set([self.keys.wake(r) for r in targets], ["1"] * len(targets))

    def declare(self, store: Any, rank: int, reason: str) -> None:
        """Write ``rank``'s death and ``reason`` to the store (one append) and, as its first
        declarer, wake the members (a count, then one ``multi_set``); then learn it here,
        even if the store failed."""
        try:
            store.append(self.keys.lost, f"{rank}:{reason},")
            if int(store.add(self.keys.declared(rank), 1)) == 1:
                self.wake(store, [r for r in self.ranks if r not in (rank, self.rank)])
        finally:
            self.learn({rank: reason})

    def depart(self, store: Any, reason: str) -> None:
        """List this rank as gone for ``reason`` (:func:`departure`) and wake the members:
        it is leaving, so it learns nothing itself."""
        store.append(self.keys.lost, f"{self.rank}:{reason},")
        if int(store.add(self.keys.declared(self.rank), 1)) == 1:
            self.wake(store, [r for r in self.ranks if r != self.rank])

    def read(self, store: Any) -> frozenset[int]:
        """Learn every death the store lists (one request); the lost set after."""
        self.learn(parse_deaths(read(store, self.keys.lost) or ""))
        return self.lost

    def stop(self, store: Any, members: str, attempt: int) -> None:
        """Post that this rank's step on ``members`` raised in ``attempt`` (one append, then
        the members' wake-up)."""
        store.append(self.keys.stops, f"{self.rank}:{members}/{attempt},")
        self.wake(store)

    def first_stop(self, store: Any, members: str, attempt: int) -> int | None:
        """The rank whose stop of ``attempt`` on ``members`` was posted first, or None."""
        stops = parse_stops(read(store, self.keys.stops) or "")
        return next((r for r, m, a in stops if (m, a) == (members, attempt)), None)

    def ask(self, store: Any, members: str, attempt: int, ranks: Iterable[int]) -> None:
        """Ask ``ranks`` to answer for ``attempt`` on ``members`` (one append, one wake-up)."""
        store.append(self.keys.asks, f"{members}/{attempt},")
        self.wake(store, [r for r in ranks if r != self.rank])

    def take(self, deaths: str, stops: str, asks: str = "") -> None:
        """Learn the store's lists of ``deaths``, ``stops`` and ``asks`` (read together at a
        wake-up): the new deaths, then the stops and asks posted since the last take (to
        ``on_stop`` and ``on_ask``, each once)."""
        self.learn(parse_deaths(deaths))
        posted, asked = parse_stops(stops), parse_asks(asks)
        with self._lock:
            new, self._stops_seen = posted[self._stops_seen :], max(self._stops_seen, len(posted))
            questions, self._asks_seen = asked[self._asks_seen :], max(self._asks_seen, len(asked))
        if new and self.on_stop is not None:
            self.on_stop(set(new))
        if questions and self.on_ask is not None:
            self.on_ask(questions)
        self.notify()
