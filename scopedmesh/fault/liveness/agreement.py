"""The agreement on lost ranks: every survivor returns the same set, bounded by liveness.

An agreement completes once every member has checked in or been declared
lost; the first decision written (``compare_set``) is the one every survivor
reads. A slow member is waited for, never declared lost. Every write is one
atomic request, so no death between two of them can leave the agreement
short of a member or its decision short of a death.

>>> import torch.distributed as dist
>>> store = dist.HashStore()
>>> one = Agreement(store, AgreementKeys("t"), [0], 0)
>>> one.check_in(), one.poll(frozenset(), frozenset)
(1, frozenset())

An agreement on a failed step carries each survivor's count of committed
steps (``rank:alive/12``); the decision then holds the highest one
(``lost:3;committed:12``), which a survivor left in doubt about its last step
reads (:class:`~scopedmesh.fault.liveness.step.Step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scopedmesh.c10d.store import AgreementKeys, read

__all__ = [
    "LOOK_AT_MOST",
    "LOOK_EVERY",
    "REREAD_EVERY",
    "Agreement",
    "accounted",
    "committed_of",
    "decision_of",
]


REREAD_EVERY = 8  # polls: how often a poll reads the entries whatever the hint says
LOOK_EVERY = 0.25  # seconds before a member first looks at a stalled agreement (then doubled)
LOOK_AT_MOST = 4.0  # seconds: the longest wait between two looks


def accounted(text: str) -> dict[int, bool]:
    """The members an agreement's entries account for: rank -> whether any entry says lost.

    >>> accounted("0:alive,3:lost,1:alive/4,3:alive,0:lost,")
    {0: True, 3: True, 1: False}
    """
    found: dict[int, bool] = {}
    for rank, _, state in (item.partition(":") for item in text.split(",") if item):
        found[int(rank)] = found.get(int(rank), False) or state == "lost"
    return found


class Agreement:
    """One agreement's store protocol: **one ``append`` is the only write that counts**.

    A member is accounted for by an entry on the list ``<base>/in``: ``rank:alive``
    appended by itself when it checks in, or ``rank:lost`` appended by a
    survivor that knows it is lost and finds no entry for it. An ``append`` is one atomic request, so
    whatever dies (a member, a survivor, the store's connection), an entry is
    either on the list or not: never half-written. Entries are never removed;
    duplicates are harmless (a member is accounted for by any of its entries).

    Whoever appends then adds 1 to the counter ``<base>/appended``: a hint, which
    may fall short when a writer dies between the two. A poll reads the hint
    (one request); it reads the list too (one more) once the hint reaches the
    number of members, when it knows of a lost member it has not accounted
    for, and every :data:`REREAD_EVERY` polls whatever the hint says, so a
    short hint costs a few intervals, never the timeout. Requests per member
    per poll while waiting: 1, and 2 every eighth poll (9 per 8 polls, against
    16 before); the list read is O(members) bytes, the hint O(1).

    Once the list accounts for every member, a member proposes the ranks it
    marks lost together with the store's deaths (``read_deaths``) and writes the
    proposal with ``compare_set``: the first one written is every survivor's
    decision, and it holds every member any survivor accounted as lost.
    """

    def __init__(
        self,
        store: Any,
        keys: AgreementKeys,
        members: list[int],
        rank: int,
        *,
        committed: int | None = None,
    ) -> None:
        self.store, self.keys, self.members, self.rank = store, keys, members, rank
        self.committed = committed  # steps this rank committed; the decision's highest, after
        self._accounted: set[int] = set()  # members this rank found or appended an entry for
        self._polls = 0
        self.wrote = False  # whether this rank's proposal is the decision (it wakes the others)

    def _append(self, rank: int, state: str) -> int:
        """Account for ``rank`` as ``state`` (one atomic append), then bump the hint; its value."""
        self._accounted.add(rank)
        self.store.append(self.keys.entries, f"{rank}:{state},")
        return int(self.store.add(self.keys.appended, 1))

    def check_in(self) -> int:
        """Account for this rank as alive (a survivor that saw it lost may have been first);
        the number of entries appended so far, this one included."""
        state = "alive" if self.committed is None else f"alive/{self.committed}"
        return self._append(self.rank, state)

    def poll(
        self, lost: frozenset[int], read_deaths: Callable[[], frozenset[int]]
    ) -> frozenset[int] | None:
        """The decision, once every member is accounted for; None until then."""
        self._polls += 1
        hint = int(self.store.add(self.keys.appended, 0))
        pending = lost.intersection(self.members).difference(self._accounted)
        if hint < len(self.members) and not pending and self._polls % REREAD_EVERY:
            return None
        text = read(self.store, self.keys.entries) or ""
        entries = accounted(text)
        for rank in sorted(pending):
            if rank not in entries:  # a member with an entry is accounted for already
                self._append(rank, "lost")
                entries[rank] = True
        self._accounted.update(pending)
        return self._propose(text, entries, read_deaths)

    def _propose(
        self, text: str, entries: dict[int, bool], read_deaths: Callable[[], frozenset[int]]
    ) -> frozenset[int] | None:
        """Write the decision once ``entries`` account for every member (``compare_set``:
        the first written stands); the decision, or None while a member is missing."""
        if any(rank not in entries for rank in self.members):
            return None
        marked = {rank for rank, said_lost in entries.items() if said_lost}
        known = read_deaths().union(marked).intersection(self.members)
        proposal = "lost:" + ",".join(str(r) for r in sorted(known))
        counts = [*committed_in(text), *([] if self.committed is None else [self.committed])]
        if counts:  # whoever writes the decision, it holds the highest count checked in
            proposal += f";committed:{max(counts)}"
        decision = self.store.compare_set(self.keys.decision, "", proposal).decode()
        self.wrote = decision == proposal
        self.committed = committed_of(decision)
        return decision_of(decision)

    def missing(self, lost: frozenset[int]) -> list[int]:
        """The members neither accounted for nor known lost (one read: for errors)."""
        entries = accounted(read(self.store, self.keys.entries) or "")
        return [r for r in self.members if r not in lost and r not in entries]

    def _complete_here(self, lost: frozenset[int]) -> bool:
        """Whether the entries counted (one request) and the deaths known here may account
        for every member, so that a look at the list is worth it (duplicates may overcount)."""
        counted = int(self.store.add(self.keys.appended, 0))
        return counted + len(lost.intersection(self.members)) >= len(self.members)

    def _look(
        self, lost: frozenset[int], read_deaths: Callable[[], frozenset[int]]
    ) -> frozenset[int] | None:
        """Read the entries and the store's deaths (a member listed dead is accounted for as
        lost), and propose: the decision, or None while a member is missing."""
        text = read(self.store, self.keys.entries) or ""
        entries = accounted(text)
        deaths = read_deaths().union(lost)
        for rank in deaths.intersection(self.members).difference(entries):
            entries[rank] = True
        return self._propose(text, entries, lambda: deaths)

    def _read_decision(self) -> frozenset[int] | None:
        """The decision if one was written (one request), else None."""
        text = read(self.store, self.keys.decision)
        if not text:
            return None
        self.committed = committed_of(text)
        return decision_of(text)

    def await_decision(
        self,
        lost: Callable[[], frozenset[int]],
        read_deaths: Callable[[], frozenset[int]],
        news: Any,
        wake: Callable[[list[int]], None],
        *,
        limit: float,
        tag: str,
    ) -> frozenset[int]:
        """Check in, then sleep until the decision; no polling, at most ``limit`` seconds.

        A member listed dead in the store is accounted for as lost: nobody writes
        an entry for it. Each member checks in (an append, then an ``add`` that
        counts the entries); one whose count and known deaths account for every
        member reads the list and the deaths, and writes the decision, then wakes
        the others (``wake``). They sleep on ``news`` (:meth:`DeathRecord.wait_for_news
        <scopedmesh.fault.liveness.deaths.DeathRecord.wait_for_news>`) and, once
        woken, read the decision; a death learned meanwhile costs a member one
        request (the count), and one claim (an ``add``) where the count and the
        deaths now account for everyone: the first claimer looks. A handful of
        requests per member, whatever the number of members or deaths. While no
        decision is known, after :data:`LOOK_EVERY` seconds and then twice as long
        each time (up to :data:`LOOK_AT_MOST`), the lowest surviving member looks
        whatever the count says (a writer that died between its append and its
        count left it short), and the others read the count: the first to claim
        the agreement's one look, once the count says everyone is in, looks (a
        closed watch's last check-in counts no one in).
        Raises ``TimeoutError`` naming the members unaccounted for.
        """
        heard = news.heard
        known = lost()
        count = self.check_in()
        deadline = time.monotonic() + limit
        pause = LOOK_EVERY
        look_at = time.monotonic() + pause
        woken = False
        while True:
            decision = None
            if count + len(known.intersection(self.members)) >= len(self.members):
                count = -len(self.members)  # one look per check-in
                decision = self._look(known, read_deaths)
            now_known = lost()
            new = sorted(now_known.difference(known).intersection(self.members))
            known = now_known
            if decision is None and new and self._complete_here(known):
                if int(self.store.add(self.keys.claim(new[-1]), 1)) == 1:
                    decision = self._look(known, read_deaths)
            if decision is None and time.monotonic() >= look_at:
                pause = min(2 * pause, LOOK_AT_MOST)
                look_at = time.monotonic() + pause
                if self.rank == min(set(self.members).difference(known)) or (
                    self._complete_here(known) and int(self.store.add(self.keys.look, 1)) == 1
                ):
                    decision = self._look(known, read_deaths)
            if decision is None and woken:
                decision = self._read_decision()
            if decision is not None:
                if self.wrote:
                    wake([r for r in self.members if r != self.rank and r not in decision])
                return decision
            if time.monotonic() >= deadline:
                missing = self.missing(lost())
                raise TimeoutError(
                    f"agreement {tag!r}: ranks {missing} neither checked in nor were declared "
                    f"lost within {limit:g} s; they are alive (their sockets are open): every "
                    "survivor must call agree with the same tag"
                )
            wait = min(deadline, look_at) - time.monotonic()
            now_heard = news.wait_for_news(heard, wait)
            woken, heard = now_heard != heard, now_heard


def decision_of(text: str) -> frozenset[int]:
    """The lost set a decision holds (``"lost:3,5"``, or ``"lost:3,5;committed:7"``).

    >>> sorted(decision_of("lost:3,5;committed:7")), decision_of("lost:")
    ([3, 5], frozenset())
    """
    lost = text.partition(";")[0].removeprefix("lost:")
    return frozenset(int(r) for r in lost.split(",") if r)


def committed_of(text: str) -> int | None:
    """The highest count of committed steps a decision holds, or None if it holds none.

    >>> committed_of("lost:3;committed:7"), committed_of("lost:3")
    (7, None)
    """
    _, _, committed = text.partition(";committed:")
    return int(committed) if committed else None


def committed_in(text: str) -> list[int]:
    """The counts of committed steps the check-ins on an agreement's list carry.

    >>> committed_in("0:alive/7,3:lost,1:alive/8,2:alive,")
    [7, 8]
    """
    counts = []
    for item in text.split(","):
        _, _, state = item.partition(":")
        if state.startswith("alive/"):
            counts.append(int(state.removeprefix("alive/")))
    return counts
