"""The liveness watch's store protocol and its shared state, without a world.

Store doubles stand in for a client whose process dies between two writes, and
count what the clean-up deletes; a hook stands in for the other thread at the
one moment a race needs it. Counts and sets are asserted, never a time.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from scopedmesh.c10d.store import WatchKeys
from scopedmesh.fault.liveness import LivenessWatch
from scopedmesh.fault.liveness.agreement import Driver, ledger_requests
from scopedmesh.fault.liveness.deaths import CLOSED, DeathRecord
from scopedmesh.fault.protocol import agreement as protocol
from scopedmesh.fault.protocol import verdict as rules
from scopedmesh.fault.protocol.agreement import Keys, KnownGone, Now, ReadGone, Sleep, Wake
from scopedmesh.layout.mesh_layout import MeshLayout

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


def _check_in(store: Any, members: list[int], rank: int, committed: int | None = None) -> int:
    """``rank``'s check-in (an append, then the count), as its agreement makes it."""
    record = DeathRecord(WatchKeys("w"), rank, lambda new: None)
    return Driver(store, record).run(protocol.check_in(_keys(), rank, committed))


def _decide(
    store: Any,
    members: list[int],
    rank: int,
    lost: frozenset[int],
    keys: Any = None,
    committed: int | None = None,
) -> protocol.Outcome | None:
    """What ``rank``'s agreement decides where it knows ``lost`` and the store's list says
    the same, on a clock that jumps to the end of each sleep; None where it times out."""
    clock = [0.0]
    record = DeathRecord(WatchKeys("w"), rank, lambda new: None)

    def do(request: Any) -> Any:
        if isinstance(request, (KnownGone, ReadGone)):
            return lost
        if isinstance(request, Now):
            return clock[0]
        if isinstance(request, Sleep):
            clock[0] = request.until
            return False
        if isinstance(request, Wake):
            return None
        return Driver(store, record).do(request)

    steps = protocol.agreement(
        keys or _keys(), members, rank, committed=committed, limit=30, tag="t"
    )
    answer: Any = None
    try:
        while True:
            answer = do(steps.send(answer))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except TimeoutError:
        return None


def _lost(outcome: protocol.Outcome | None) -> frozenset[int] | None:
    return None if outcome is None else outcome.lost


def _keys() -> Any:
    return Keys(WatchKeys("w").agreement("t").base)


@pytest.mark.parametrize("writes", [0, 1, 2, 3])
def test_a_member_that_dies_while_checking_in_is_decided_lost(writes: int) -> None:
    """Rank 3 dies after ``writes`` of its check-in's writes; the survivors learn its death
    and must decide {3} in a bounded number of polls, never wait for a short counter."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    try:
        _check_in(DyingStore(store, writes), members, 3)
    except ConnectionError:
        pass
    for rank in (0, 1, 2):
        _check_in(store, members, rank)
    lost = frozenset({3})
    assert [_lost(_decide(store, members, rank, lost)) for rank in (0, 1, 2)] == [lost] * 3


@pytest.mark.parametrize("writes", [0, 1, 2, 3])
def test_a_survivor_that_dies_while_accounting_a_death_is_decided_lost_too(writes: int) -> None:
    """Rank 3 is lost; rank 2 accounts for it and dies after ``writes`` writes; ranks 0
    and 1 learn both deaths and must decide in a bounded number of polls: {2, 3}, or
    {3} where rank 2 wrote that decision before it died."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    for rank in (0, 1):
        _check_in(store, members, rank)
    dying = DyingStore(store, writes)
    try:
        _decide(dying, members, 2, frozenset({3}))
    except ConnectionError:
        pass
    both = frozenset({2, 3})
    first, second = (_lost(_decide(store, members, rank, both)) for rank in (0, 1))
    assert first == second and first in (both, frozenset({3})), (first, second)


def test_a_member_one_survivor_accounted_lost_is_in_the_decision() -> None:
    """Rank 2 saw rank 3 die and accounted for it, but the store's list of deaths never
    got it (the declaring write was lost): the decision must still hold rank 3."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    seen = {0: frozenset(), 1: frozenset(), 2: frozenset({3})}  # what each has learned
    for rank in (0, 1):
        _check_in(store, members, rank)
    decisions = [_lost(_decide(store, members, rank, seen[rank])) for rank in (2, 0, 1)]
    assert decisions == [frozenset({3})] * 3


@pytest.mark.parametrize("counts", [(7, 7, 7), (7, 8, 7), (8, 8, 7), (8, 7, None), (None, 7, 8)])
def test_a_steps_agreement_decides_the_highest_count_of_committed_steps(
    counts: tuple[int, int, int | None],
) -> None:
    """Each survivor of a failed step checks in with its count of committed steps (a member
    whose vote was cut short is one behind); every survivor reads the highest, once, even
    where a member checked in with no count (a plain agreement) or another was lost."""
    store, members = dist.HashStore(), [0, 1, 2, 3]
    for rank, count in enumerate(counts[:2]):
        _check_in(store, members, rank, count)
    lost = frozenset({3})
    outcomes = [_decide(store, members, rank, lost, committed=counts[rank]) for rank in (2, 0, 1)]
    highest = max(count for count in counts if count is not None)
    assert [(o.lost, o.committed) for o in outcomes if o is not None] == [(lost, highest)] * 3


@pytest.mark.parametrize("writes", [1, 2])
def test_a_death_declared_by_dying_watchers_reaches_every_watch(writes: int) -> None:
    """Both watchers of rank 3 (ranks 2 and 4) declare it and die after ``writes`` writes
    each (its entry appended; with 2, its declaration counted too), so neither wakes the
    members. Their own deaths are then declared by their watchers (ranks 1 and 5): that
    wake-up must reach rank 0, and its one read of the lists must teach it rank 3 too."""
    store, keys, ranks = dist.HashStore(), WatchKeys("w"), tuple(range(6))
    for listed in (keys.lost, keys.stops, keys.asks):
        store.append(listed, "")
    for watcher in (2, 4):
        try:
            DeathRecord(keys, watcher, lambda new: None, ranks=ranks).declare(
                DyingStore(store, writes), 3, CLOSED
            )
        except ConnectionError:
            pass
    assert not store.check([keys.wake(0)]), "a dying declarer woke the members"
    DeathRecord(keys, 1, lambda new: None, ranks=ranks).declare(store, 2, CLOSED)
    DeathRecord(keys, 5, lambda new: None, ranks=ranks).declare(store, 4, CLOSED)
    assert store.check([keys.wake(0)])
    observer = DeathRecord(keys, 0, lambda new: None, ranks=ranks)
    deaths, stops, asks = store.multi_get([keys.lost, keys.stops, keys.asks])
    observer.take(deaths.decode(), stops.decode(), asks.decode())
    assert observer.lost == {2, 3, 4}


def test_only_a_deaths_first_declarer_wakes_the_members_and_never_the_dead() -> None:
    """Two watchers declare rank 3: one ``multi_set`` wakes every member but rank 3 and
    the declarer (it learned it already); the second declarer appends, and wakes nobody."""
    store, keys, ranks = dist.HashStore(), WatchKeys("w"), tuple(range(5))
    counting = CountingStore(store)
    DeathRecord(keys, 2, lambda new: None, ranks=ranks).declare(counting, 3, CLOSED)
    woken = [rank for rank in ranks if store.check([keys.wake(rank)])]
    assert woken == [0, 1, 4]
    for rank in woken:
        store.delete_key(keys.wake(rank))
    DeathRecord(keys, 4, lambda new: None, ranks=ranks).declare(store, 3, CLOSED)
    assert [rank for rank in ranks if store.check([keys.wake(rank)])] == []
    assert store.get(keys.lost) == b"3:closed,3:closed,"


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
    for rank in ranks:  # each joins the ring, and makes the lists a wake-up reads
        store.set(keys.addr(rank), "127.0.0.1:1")
        store.append(keys.lost, "")
        store.append(keys.stops, "")
    for rank in sorted(lost):
        DeathRecord(keys, 0, lambda new: None, ranks=tuple(ranks)).declare(store, rank, CLOSED)
    agreement = Keys(keys.agreement("event0").base)
    for rank in survivors:  # agree(): the tag for the clean-up, then the check-in
        store.append(keys.tags, "event0\n")
        Driver(store, DeathRecord(keys, rank, lambda new: None)).run(
            protocol.check_in(agreement, rank, None)
        )
    ends = (survivors[0], survivors[-1])  # the first and the last to decide write all there is
    decided = [_lost(_decide(store, ranks, rank, lost, keys=agreement)) for rank in ends]
    assert decided == [lost] * 2
    before: list[str] = []
    counting = CountingStore(store)
    for rank in survivors:
        store.delete_key(keys.addr(rank))  # close() deletes its own address first
        store.set(keys.wake(rank), "closing")  # and wakes its own store thread to stop
        shell: Any = object.__new__(LivenessWatch)
        shell._store, shell.keys, shell.ranks, shell.rank = counting, keys, tuple(ranks), rank
        if rank == survivors[-1]:
            before, counting.deleted = sorted(store.list_keys()), []
        shell._clean_up()
    return counting.deleted, before, sorted(store.list_keys())


@pytest.mark.skipif(not hasattr(dist.HashStore(), "list_keys"), reason="no Store.list_keys")
@pytest.mark.parametrize(("members", "dead"), [(8, 0), (8, 2), (1024, 0), (1024, 3)])
def test_the_clean_up_deletes_the_keys_written_each_once_and_leaves_none(
    members: int, dead: int
) -> None:
    """The last member to close deletes every key the watches wrote (those before its
    clean-up, and the ``closed`` counter it adds), each once: O(keys written), whatever
    the number of members. It was 164 deletions for 8 members and ~2.1 million for
    1,024. Besides, at most two keys per dead member that may not exist (its wake key:
    a wake-up skips a member known lost; an agreement's claim of it), one per
    agreement (the claim of its one look), and the list of asks (none was made)."""
    deleted, before, after = _agree_then_close(members, dead)
    written = {*before, WatchKeys("scopedmesh-watch/1").closed}
    print(f"{members} members, {dead} dead: {len(deleted)} deletions, {len(written)} keys")
    assert after == []
    assert len(deleted) == len(set(deleted))
    assert written <= set(deleted), sorted(written.difference(deleted))[:5]
    assert len(deleted) - len(written) <= 2 * dead + 2, (len(deleted), len(written))


# ------------------------------------------------------------------ an agreement at scale


class Requests:
    """A client that counts every request made through it."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.requests += 1
            return attr(*args)

        return counted


@pytest.mark.parametrize("dead", [0, 1, 2, 8])
def test_an_agreement_of_1024_members_asks_each_a_handful_of_requests(
    dead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,024 members agree, ``dead`` of them (a node's 8 at most) known dead already, each
    in a thread of its own: every survivor decides the dead set, and asks the store
    three requests, whatever the number of members or deaths: its check-in (an append
    and the count) and, once woken, the decision's read. The one member whose count
    accounts for everyone instead reads the entries and the deaths, and writes the
    decision: five. (Looks at a stalled agreement, which a slow machine may start, are
    put off here so that the counts do not depend on time; the store thread's own
    wake-up, a wait, a delete and one read of both lists, is not counted here.)"""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(protocol, "LOOK_EVERY", 600.0)
    members = list(range(1024))
    lost = frozenset(members[len(members) - dead :])
    survivors = [rank for rank in members if rank not in lost]
    store, keys = dist.HashStore(), WatchKeys("w")
    store.append(keys.lost, "".join(f"{rank}:closed," for rank in sorted(lost)))
    records = {r: DeathRecord(keys, r, lambda new: None, ranks=tuple(members)) for r in members}
    for record in records.values():  # a wake-up reaches the woken record directly
        record.learn({rank: CLOSED for rank in lost})
        record.wake = lambda store, ranks=None: [records[r].notify() for r in ranks or ()]  # type: ignore[method-assign]
    clients = {rank: Requests(store) for rank in survivors}

    def agree(rank: int) -> frozenset[int]:
        steps = protocol.agreement(
            Keys(keys.agreement("t").base), members, rank, committed=None, limit=120, tag="t"
        )
        return Driver(clients[rank], records[rank]).run(steps).lost

    with ThreadPoolExecutor(max_workers=len(survivors)) as pool:
        decisions = set(pool.map(agree, survivors))
    assert decisions == {lost}
    per_member = sorted(client.requests for client in clients.values())
    print(f"{dead} dead: requests per member {per_member[0]}..{per_member[-1]}")
    assert per_member == [3] * (len(survivors) - 1) + [5]


def test_a_rank_declared_dead_that_closes_is_counted_once_at_the_clean_up() -> None:
    """Rank 2 was declared dead (its host unreachable a while) but is alive, and closes its
    watch; then rank 0 closes. Rank 1 has not: nothing may be deleted yet. (It was: the
    closed counter and the list of deaths each counted rank 2, so rank 0 cleaned up under
    rank 1's feet.) Once rank 1 closes, every key goes."""
    store, keys, ranks = dist.HashStore(), WatchKeys("scopedmesh-watch/1"), (0, 1, 2)
    for listed in (keys.lost, keys.stops, keys.asks, keys.tags):
        store.append(listed, "")
    store.append(keys.lost, "2:unreachable,")
    for rank in (2, 0):
        shell: Any = object.__new__(LivenessWatch)
        shell._store, shell.keys, shell.ranks, shell.rank = store, keys, ranks, rank
        shell._clean_up()
    assert store.check([keys.lost]), "cleaned up before rank 1 closed"
    shell._store, shell.rank = store, 1
    shell._clean_up()
    assert not store.check([keys.lost]) and not store.check([keys.closed])


def _runs(members: set[int]) -> str:
    """The reference text of a set as runs, written out here: ``0-3_7``."""
    ranks, runs = sorted(members), []
    while ranks:
        first = last = ranks.pop(0)
        while ranks and ranks[0] == last + 1:
            last = ranks.pop(0)
        runs.append(str(first) if first == last else f"{first}-{last}")
    return "_".join(runs)


@given(
    members=st.sets(st.integers(0, 5000), min_size=1, max_size=64),
    rank=st.integers(0, 5000),
)
def test_a_members_key_says_whether_it_holds_a_rank(members: set[int], rank: int) -> None:
    """``holds`` reads the key back: whether the members hold the rank, wherever the key
    lists them as runs; None (never a wrong answer) where it is a digest."""
    key = protocol.members_key(members)
    listed = len(_runs(members)) <= 32
    assert protocol.holds(key, rank) == ((rank in members) if listed else None), key


@pytest.mark.parametrize("digest", ["0123456789012345", "e190a7e647798086"])
def test_a_digest_names_no_ranks(digest: str) -> None:
    """A digest of decimal digits only is not read as a run of ranks."""
    assert protocol.holds(f"m2048.{digest}", 123) is None


@pytest.mark.parametrize(
    ("shape", "rank", "answers"),
    [
        ((2, 2), 1, True),  # 2 x 2 (dp, tp) loses rank 3: [0, 1] go on; rank 1 answers there
        ((2, 2), 2, False),  # rank 2 shared the dropped slice [2, 3]: it goes on no further
        ((4, 1), 1, False),  # one rank a slice: [0, 1, 2] go on, not the asked-about [0, 1]
    ],
)
def test_an_answer_follows_a_heal_that_drops_a_slice(
    shape: tuple[int, int], rank: int, answers: bool
) -> None:
    """A rank still computing the step that lost rank 3 is asked about the re-formed mesh's
    first attempt: it replays the decision and checks in there, where the survivors are
    those ``reform`` keeps (whole slices of dp), not the members minus the lost."""
    old = protocol.members_key(range(4))
    new = protocol.line_key([0, 1], old)  # the key of the mesh reform makes on (2, 2)
    store, ledger, lock = dist.HashStore(), rules.Ledger(), threading.Lock()
    ledger.committed[old], ledger.attempts[old] = 5, 2  # at attempt 2, 5 steps committed
    stepped = {old: rules.Lineup(MeshLayout(shape, names=("dp", "tp")), 0)}
    decided = protocol.proposal("0:alive/6,1:alive/6,2:alive/6,3:lost,", range(4), (), 5)
    assert decided == "lost:3;committed:6"
    old_keys = Keys(f"p/agree/{protocol.agreement_name(old, 'event2')}")
    store.set(old_keys.decision, decided)

    record = DeathRecord(WatchKeys("w"), rank, lambda new: None)
    other = ledger_requests(ledger, lock, stepped)
    Driver(store, record, other).run(rules.answer_ask(rank=rank, prefix="p", key=new, attempt=0))

    new_keys = Keys(f"p/agree/{protocol.agreement_name(new, 'event0')}")
    checked_in = store.check([new_keys.entries]) and store.get(new_keys.entries).decode()
    assert checked_in == (f"{rank}:alive/6," if answers else False)
    assert ((old, 2) in ledger.answered, (new, 0) in ledger.answered) == (answers, answers)
