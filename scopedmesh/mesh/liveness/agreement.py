"""The agreement on lost ranks: every survivor returns the same set, bounded by liveness.

An agreement completes once every member has checked in or been declared
lost; the first decision written (``compare_set``) is the one every survivor
reads. A slow member is waited for, never declared lost.

>>> import torch.distributed as dist
>>> store = dist.HashStore()
>>> one = Agreement(store, AgreementKeys("t"), [0], 0)
>>> one.check_in(); one.poll(frozenset(), frozenset)
frozenset()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scopedmesh.c10d.store import AgreementKeys

__all__ = ["Agreement", "decision_of"]


class Agreement:
    """One agreement's store protocol: **two store requests per member per poll**.

    Every member is accounted for once, in the slot ``<base>/in/<rank>``
    (``compare_set``): by itself when it checks in, or, once it is known lost,
    by the first survivor to say so; whoever fills a slot adds 1 to the counter
    ``<base>/accounted``. A poll asks whether the decision is written (one
    ``check``) and reads the counter (one ``add`` of 0): 2 requests per member
    per interval, 16 for 8 members and 2,048 for 1,024, where checking each
    missing member cost up to N per member (8 x 8, 1,024 x 1,024). A lost
    member adds one ``compare_set`` per survivor that learns of it (and one
    ``add`` for the first), once; the decision costs the member that writes it
    a ``get`` of the deaths and a ``compare_set``, the others one ``get``.
    """

    def __init__(self, store: Any, keys: AgreementKeys, members: list[int], rank: int) -> None:
        self.store, self.keys, self.members, self.rank = store, keys, members, rank
        self._accounted: set[int] = set()  # members whose slot this rank tried to fill

    def _account(self, rank: int, value: str) -> str:
        """Fill ``rank``'s slot with ``value`` unless it is filled; the value it holds."""
        self._accounted.add(rank)
        held: str = self.store.compare_set(self.keys.slot(rank), "", value).decode()
        if held == value:
            self.store.add(self.keys.accounted, 1)
        return held

    def check_in(self) -> None:
        """Account for this rank as alive (a survivor that saw it lost may have been first)."""
        self._account(self.rank, "alive")

    def poll(
        self, lost: frozenset[int], read_deaths: Callable[[], frozenset[int]]
    ) -> frozenset[int] | None:
        """The decision, once every member is accounted for; None until then."""
        store = self.store
        if store.check([self.keys.decision]):
            return decision_of(store.get(self.keys.decision).decode())
        for rank in sorted(lost.intersection(self.members).difference(self._accounted)):
            self._account(rank, f"lost:{self.rank}")
        if int(store.add(self.keys.accounted, 0)) < len(self.members):
            return None
        # Every member is accounted for; a member another survivor accounted as lost is
        # in the store's deaths: read them, so that the proposal holds every one.
        known = read_deaths().intersection(self.members)
        proposal = "lost:" + ",".join(str(r) for r in sorted(known))
        return decision_of(store.compare_set(self.keys.decision, "", proposal).decode())

    def missing(self, lost: frozenset[int]) -> list[int]:
        """The members neither checked in nor known lost (one ``check`` each: for errors)."""
        return [
            r for r in self.members if r not in lost and not self.store.check([self.keys.slot(r)])
        ]

    def decide(
        self,
        lost: Callable[[], frozenset[int]],
        read_deaths: Callable[[], frozenset[int]],
        *,
        interval: float,
        limit: float,
        tag: str,
    ) -> frozenset[int]:
        """Check in, then poll every ``interval`` until the decision; at most ``limit`` seconds.

        ``lost`` answers the deaths known here (it raises if the watch broke),
        ``read_deaths`` those the store lists. Raises ``TimeoutError`` naming
        the members still unaccounted for.
        """
        self.check_in()
        deadline = time.monotonic() + limit
        while True:
            decision = self.poll(lost(), read_deaths)
            if decision is not None:
                return decision
            if time.monotonic() >= deadline:
                missing = self.missing(lost())
                raise TimeoutError(
                    f"agreement {tag!r}: ranks {missing} neither checked in nor were declared "
                    f"lost within {limit:g} s; they are alive (their sockets are open): every "
                    "survivor must call agree with the same tag"
                )
            time.sleep(interval)


def decision_of(text: str) -> frozenset[int]:
    """The lost set a decision holds (``"lost:3,5"``).

    >>> sorted(decision_of("lost:3,5")), decision_of("lost:")
    ([3, 5], frozenset())
    """
    return frozenset(int(r) for r in text.removeprefix("lost:").split(",") if r)
