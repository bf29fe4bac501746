"""The liveness watch's store protocol and its shared state, without a world.

Store doubles stand in for a client whose process dies between two writes, and
count what the clean-up deletes; a hook stands in for the other thread at the
one moment a race needs it. Counts and sets are asserted, never a time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from scopedmesh.c10d.store import WatchKeys
from scopedmesh.fault.liveness import LivenessWatch
from scopedmesh.fault.liveness.agreement import Agreement
from scopedmesh.fault.liveness.deaths import CLOSED, DeathRecord

WRITES = frozenset({"set", "add", "append", "compare_set", "multi_set", "delete_key"})


def _is_write(name: str, args: tuple[Any, ...]) -> bool:
    """Whether a request writes: ``add(key, 0)`` and ``compare_set(key, x, x)`` only read."""
    if name == "add":
        return args[1] != 0
    if name == "compare_set":
        return args[1] != args[2]
    return name in WRITES


class DyingStore:
    """A client whose process dies after ``writes`` writes: that request and every later
    one raises, as a store client of a SIGKILLed process never answers again."""

    def __init__(self, store: Any, writes: int) -> None:
        self.store, self.writes, self.dead = store, writes, False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        def call(*args: Any) -> Any:
            if not self.dead and _is_write(name, args):
                if self.writes == 0:
                    self.dead = True
                else:
                    self.writes -= 1
            if self.dead:
                raise ConnectionError(f"the client died before {name}")
            return attr(*args)

        return call


def _decide(
    store: Any,
    members: list[int],
    rank: int,
    lost: frozenset[int],
    polls: int = 40,
    keys: Any = None,
) -> frozenset[int] | None:
    """What ``rank`` decides within ``polls`` polls (it checked in already), or None."""
    agreement = Agreement(store, keys or _keys(), members, rank)
    for _ in range(polls):
        decision = agreement.poll(lost, lambda: lost)
        if decision is not None:
            return decision
    return None


def _keys() -> Any:
    return WatchKeys("w").agreement("t")


@pytest.mark.parametrize("writes", [0, 1, 2, 3])
def test_a_member_that_dies_while_checking_in_is_decided_lost(writes: int) -> None:
    """Rank 3 dies after ``writes`` of its check-in's writes; the survivors learn its death
    and must decide {3} in a bounded number of polls, never wait for a short counter."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    try:
        Agreement(DyingStore(store, writes), _keys(), members, 3).check_in()
    except ConnectionError:
        pass
    for rank in (0, 1, 2):
        Agreement(store, _keys(), members, rank).check_in()
    lost = frozenset({3})
    assert [_decide(store, members, rank, lost) for rank in (0, 1, 2)] == [lost] * 3


@pytest.mark.parametrize("writes", [0, 1, 2, 3])
def test_a_survivor_that_dies_while_accounting_a_death_is_decided_lost_too(writes: int) -> None:
    """Rank 3 is lost; rank 2 accounts for it and dies after ``writes`` writes; ranks 0
    and 1 learn both deaths and must decide in a bounded number of polls: {2, 3}, or
    {3} where rank 2 wrote that decision before it died."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    for rank in (0, 1, 2):
        Agreement(store, _keys(), members, rank).check_in()
    dying = DyingStore(store, writes)
    try:
        _decide(dying, members, 2, frozenset({3}), polls=1)
    except ConnectionError:
        pass
    both = frozenset({2, 3})
    first, second = (_decide(store, members, rank, both) for rank in (0, 1))
    assert first == second and first in (both, frozenset({3})), (first, second)


def test_a_member_one_survivor_accounted_lost_is_in_the_decision() -> None:
    """Rank 2 saw rank 3 die and accounted for it, but the store's list of deaths never
    got it (the declaring write was lost): the decision must still hold rank 3."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    for rank in (0, 1, 2):
        Agreement(store, _keys(), members, rank).check_in()
    Agreement(store, _keys(), members, 2).poll(frozenset({3}), frozenset)
    seen = {0: frozenset(), 1: frozenset(), 2: frozenset({3})}  # what each has learned
    decisions = [_decide(store, members, rank, seen[rank]) for rank in (0, 1, 2)]
    assert decisions == [frozenset({3})] * 3


@pytest.mark.parametrize("counts", [(7, 7, 7), (7, 8, 7), (8, 8, 7), (8, 7, None), (None, 7, 8)])
def test_a_steps_agreement_decides_the_highest_count_of_committed_steps(
    counts: tuple[int, int, int | None],
) -> None:
    """Each survivor of a failed step checks in with its count of committed steps (a member
    whose vote was cut short is one behind); every survivor reads the highest, once, even
    where a member checked in with no count (a plain agreement) or another was lost."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    agreements = [
        Agreement(store, _keys(), members, rank, committed=count)
        for rank, count in enumerate(counts)
    ]
    for agreement in agreements:
        agreement.check_in()
    lost = frozenset({3})
    for agreement in agreements:
        decision = None
        for _ in range(40):
            decision = agreement.poll(lost, lambda: lost)
            if decision is not None:
                break
        assert decision == lost
    highest = max(count for count in counts if count is not None)
    assert [a.committed for a in agreements] == [highest] * 3


@pytest.mark.parametrize("writes", [1, 2])
def test_a_death_declared_by_dying_watchers_reaches_every_watch(writes: int) -> None:
    """Both watchers of rank 3 declare it and die after ``writes`` writes each (at least
    one: a watcher that wrote nothing is declared by its own watcher, who then finds
    rank 3 dead as it relinks); a third watch must learn of rank 3 from the store
    within a bounded number of polls."""
    store, keys = dist.HashStore(), WatchKeys("w")
    for watcher in (0, 2):
        try:
            DeathRecord(keys, watcher, lambda new: None).declare(
                DyingStore(store, writes), 3, CLOSED
            )
        except ConnectionError:
            pass
    observer, seen = DeathRecord(keys, 1, lambda new: None), 0
    for _ in range(40):
        seen = observer.poll(store, seen)
    assert observer.lost == {3}


# ------------------------------------------------------------------ the clean-up


class CountingStore:
    """A client that counts ``delete_key`` calls (and keeps the keys it deleted)."""

    def __init__(self, store: Any) -> None:
        self.store, self.deleted = store, []  # type: list[str]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name != "delete_key":
            return attr

        def delete_key(key: str) -> Any:
            self.deleted.append(key)
            return attr(key)

        return delete_key


def _agree_then_close(members: int, dead: int) -> tuple[list[str], list[str], list[str]]:
    """``members`` watches agree once on their ``dead`` last ranks (declared by rank 0's
    watch), then the survivors close one by one, each the way ``close`` does.
    Returns what the last clean-up deleted, the keys before it, the keys after it."""
    store, keys, ranks = dist.HashStore(), WatchKeys("scopedmesh-watch/1"), list(range(members))
    survivors, lost = ranks[: members - dead], frozenset(ranks[members - dead :])
    for rank in ranks:  # each joins the ring, and its thread polls the death counter
        store.set(keys.addr(rank), "127.0.0.1:1")
        store.add(keys.deaths, 0)
    for rank in sorted(lost):
        DeathRecord(keys, 0, lambda new: None).declare(store, rank, CLOSED)
    for rank in survivors:  # agree(): the tag for the clean-up, then the check-in
        store.append(keys.tags, "event0\n")
        Agreement(store, keys.agreement("event0"), ranks, rank).check_in()
    agreement = keys.agreement("event0")  # the first and the last to decide write all there is
    ends = (survivors[0], survivors[-1])
    assert [_decide(store, ranks, rank, lost, keys=agreement) for rank in ends] == [lost] * 2
    before: list[str] = []
    counting = CountingStore(store)
    for rank in survivors:
        store.delete_key(keys.addr(rank))  # close() deletes its own address first
        shell: Any = object.__new__(LivenessWatch)
        shell._store, shell.keys, shell.ranks = counting, keys, tuple(ranks)
        if rank == survivors[-1]:
            before, counting.deleted = sorted(store.list_keys()), []
        shell._clean_up()
    return counting.deleted, before, sorted(store.list_keys())


@pytest.mark.skipif(not hasattr(dist.HashStore(), "list_keys"), reason="no Store.list_keys")
@pytest.mark.parametrize(("members", "dead"), [(8, 0), (8, 2), (1024, 0), (1024, 3)])
def test_the_clean_up_deletes_the_keys_written_each_once_and_leaves_none(
    members: int, dead: int
) -> None:
    """The last member to close deletes exactly the keys the watches wrote (those before
    its clean-up, and the ``closed`` counter it adds): O(keys written), whatever the
    number of members. It was 164 deletions for 8 members and ~2.1 million for 1,024."""
    deleted, before, after = _agree_then_close(members, dead)
    written = sorted({*before, WatchKeys("scopedmesh-watch/1").closed})
    print(f"{members} members, {dead} dead: {len(deleted)} deletions, {len(written)} keys")
    assert after == []
    assert sorted(deleted) == written, (len(deleted), len(written))
