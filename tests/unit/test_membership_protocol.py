"""The replicated job's membership rules (scopedmesh/fault/protocol/membership.py), pure:
the job's shape set by the first writer, the replicas that never announced, and "no
live replica", checked for every order in which the store's events can arrive."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scopedmesh.fault.protocol.membership import (
    Decision,
    JobShape,
    Joining,
    complete_joiners,
    never_announced,
    no_state_left,
    propose,
)

shapes = st.builds(JobShape, st.integers(1, 6), st.integers(1, 4), st.integers(0, 5))


class CompareSetStore:
    """A store's ``compare_set(key, "", value)``: the first writer's value stands."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        if key not in self.values and expected == "":
            self.values[key] = desired
        return self.values.get(key, expected)


@given(st.lists(shapes, min_size=1, max_size=8), st.randoms())
def test_every_replica_reads_the_first_writers_shape_whatever_the_order(
    started: list[JobShape], rng: object
) -> None:
    order = list(started)
    rng.shuffle(order)  # type: ignore[attr-defined]
    store = CompareSetStore()
    verdicts = []
    for mine in order:
        job = JobShape.parse(store.compare_set("shape", "", mine.text()))
        verdicts.append((mine, job, mine.refusal(job)))
    first = order[0]
    assert {job for _, job, _ in verdicts} == {first}  # one job shape, the first writer's
    for mine, job, refusal in verdicts:
        same = (mine.replicas, mine.local) == (job.replicas, job.local)
        assert (refusal is None) == same
        if mine.replicas != job.replicas:
            assert f"replicas={mine.replicas} differs from the job's replicas={job.replicas}" in (
                refusal or ""
            )
            assert f"set by replica {job.replica}" in (refusal or "")
        if mine.local != job.local:
            assert f"local={mine.local}" in (refusal or "")
            assert f"the job's local={job.local}" in (refusal or "")


@given(st.lists(shapes, min_size=2, max_size=8, unique_by=lambda s: (s.replicas, s.local)))
def test_the_verdicts_depend_only_on_which_shape_came_first(started: list[JobShape]) -> None:
    """The same replicas in two orders with the same first writer: the same verdicts."""
    first, rest = started[0], started[1:]
    for order in ([first, *rest], [first, *reversed(rest)]):
        job = JobShape.parse(CompareSetStore().compare_set("shape", "", order[0].text()))
        accepted = {(s.replicas, s.local) for s in order if s.refusal(job) is None}
        assert accepted == {(first.replicas, first.local)}


slots = st.tuples(st.integers(0, 4), st.integers(0, 2), st.sampled_from(["a", "b", None]))


@given(
    st.integers(1, 5), st.integers(1, 3), st.lists(slots, max_size=20, unique_by=lambda s: s[:2])
)
def test_never_announced_is_exactly_the_complement_of_the_complete_joiners(
    replicas: int, local: int, announced: list[tuple[int, int, str | None]]
) -> None:
    announced = [(r, c, t) for r, c, t in announced if r < replicas and c < local]
    missing = never_announced(announced, replicas, local)
    complete = complete_joiners(announced, local)
    assert set(missing) | set(complete) == set(range(replicas))
    assert not set(missing) & set(complete)
    assert list(missing) == sorted(missing)
    for r in range(replicas):  # complete: every slot announced, one token, none missing
        tokens = {t for rr, _, t in announced if rr == r}
        count = sum(1 for rr, _, _ in announced if rr == r)
        assert (r in complete) == (count == local and len(tokens) == 1 and None not in tokens)


@given(
    st.integers(1, 5),
    st.integers(1, 3),
    st.lists(slots, max_size=20, unique_by=lambda s: s[:2]),
    st.randoms(),
)
def test_a_joiner_names_the_same_missing_replicas_whatever_the_order_it_read(
    replicas: int, local: int, announced: list[tuple[int, int, str | None]], rng: object
) -> None:
    announced = [(r, c, t) for r, c, t in announced if r < replicas and c < local]
    shuffled = list(announced)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    views = []
    for events in (announced, shuffled):
        join = Joining(0, "z", replicas=replicas, local=local)
        for r, c, t in events:
            join.announced(r, c, t)
        views.append((join.never_announced, join.waiting_for(0)))
    assert views[0] == views[1]
    missing, message = views[0]
    assert missing == never_announced(announced, replicas, local)
    assert f"replicas {list(missing)} to announce themselves" in message


members = st.dictionaries(st.integers(0, 5), st.sampled_from(["a", "b", "c"]), min_size=1)


@given(
    st.lists(members, min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["a", "b", "c"])), max_size=12),
    st.randoms(),
)
def test_no_live_replica_holds_exactly_when_every_member_of_the_newest_epoch_died(
    epochs: list[dict[int, str]], deaths: list[tuple[int, str]], rng: object
) -> None:
    decisions = [Decision(e, tuple(sorted(m.items())), min(m), 0) for e, m in enumerate(epochs)]
    events: list[tuple[str, object]] = [("decided", d) for d in decisions]
    events += [("died", death) for death in deaths]
    rng.shuffle(events)  # type: ignore[attr-defined]
    join = Joining(9, "new", replicas=10, local=1)
    for kind, value in events:
        if kind == "decided":
            join.decided(value)  # type: ignore[arg-type]
        else:
            join.died(*value)  # type: ignore[misc]
    newest = decisions[-1]
    assert join.newest == newest  # an older decision read late never replaces a newer one
    live = [r for r, t in newest.members if (r, t) not in set(deaths)]
    assert list(join.live_members) == live
    assert join.no_live_replica == (not live)
    if not live:
        message = join.no_live_message()
        assert message.startswith("no live replica:")
        assert f"epoch ({newest.epoch}, replicas {list(newest.replicas)})" in message
        assert "restart the job from a checkpoint" in message
    else:
        assert f"replicas {live}, admit a joiner" in join.waiting_for(newest.epoch + 1)


def test_an_admitted_joiner_is_never_told_there_is_no_live_replica() -> None:
    join = Joining(1, "b2", replicas=2, local=1)
    join.decided(Decision(2, ((0, "a"), (1, "b2")), 0, 3))
    join.died(0, "a")
    assert join.admitted is not None and not join.no_live_replica


def test_before_any_epoch_there_is_no_verdict_of_death() -> None:
    join = Joining(0, "a", replicas=3, local=2)
    join.died(1, "b")
    assert join.newest is None and not join.no_live_replica
    assert join.waiting_for(0).startswith("replicas [0, 1, 2] to announce themselves")


@pytest.mark.parametrize(
    ("mine", "job", "expected"),
    [
        (JobShape(4, 1, 2), JobShape(3, 1, 0), "replicas=4 differs from the job's replicas=3, set by replica 0"),
        (JobShape(3, 2, 2), JobShape(3, 1, 1), "local=2 (this replica's ranks) differs from the job's local=1, set by replica 1"),
    ],
)  # fmt: skip
def test_a_refusal_names_both_values(mine: JobShape, job: JobShape, expected: str) -> None:
    assert mine.refusal(job) == expected


@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.lists(slots, max_size=12, unique_by=lambda s: s[:2]),
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["a", "b"])), max_size=6),
)
def test_a_dead_incarnations_announcement_counts_for_nothing(
    replicas: int,
    local: int,
    announced: list[tuple[int, int, str | None]],
    deaths: list[tuple[int, str]],
) -> None:
    announced = [(r, c, t) for r, c, t in announced if r < replicas and c < local]
    join = Joining(0, "z", replicas=replicas, local=local)
    for r, c, t in announced:
        join.announced(r, c, t)
    for death in deaths:
        join.died(*death)
    alive = [(r, c, t) for r, c, t in announced if t is not None and (r, t) not in set(deaths)]
    assert join.never_announced == never_announced(alive, replicas, local)


@given(
    st.frozensets(st.integers(0, 6), max_size=5),
    st.frozensets(st.integers(0, 6), max_size=5),
    st.integers(0, 100),
)
def test_no_state_is_left_exactly_when_every_survivor_is_still_catching_up(
    alive: frozenset[int], behind: frozenset[int], epoch: int
) -> None:
    why = no_state_left(alive, behind, epoch)
    assert (why is None) == (not alive or bool(alive - behind))
    if why is not None:
        assert why.startswith("no live replica holds the job's state")
        assert f"replicas {sorted(alive)} caught up from them in epoch {epoch}" in why
        assert why.endswith("restart the job from a checkpoint")


# ------------------------------------------------------------------ the rules, explored


class MembershipMachine(RuleBasedStateMachine):
    """Replicas of one slot start (some with another ``replicas=``), announce, die and
    restart; epochs are decided by the rules the library runs (:class:`JobShape`'s
    first writer, :func:`propose`, :func:`complete_joiners`), over a simulated
    ``compare_set`` store; a starting incarnation's :class:`Joining` is fed what the
    store holds and which incarnations are dead, in a shuffled order. After every
    event: one job shape, held by every accepted incarnation; a refused incarnation
    wrote nothing; "no live replica" is said exactly when no member of the newest
    epoch lives, and a waiting replica names exactly the replicas without a live,
    complete announcement."""

    REPLICAS = 3

    def __init__(self) -> None:
        super().__init__()
        self.store = CompareSetStore()
        self.first: JobShape | None = None  # the shape of the first start (the job's)
        self.live: dict[str, int] = {}  # token -> replica, accepted and alive
        self.dead: set[tuple[int, str]] = set()
        self.refused = 0
        self.count = 0
        self.shapes: dict[str, JobShape] = {}  # token -> the shape it started with, accepted

    def _decisions(self) -> list[Decision]:
        found, epoch = [], 0
        while f"decision/{epoch}" in self.store.values:
            found.append(Decision.parse(epoch, self.store.values[f"decision/{epoch}"]))
            epoch += 1
        return found

    def _announced(self) -> list[tuple[int, int, str | None]]:
        return [(r, 0, self.store.values.get(f"join/{r}")) for r in range(self.REPLICAS)]

    @rule(replica=st.integers(0, REPLICAS - 1), other=st.booleans())
    def start(self, replica: int, other: bool) -> None:
        replicas = self.REPLICAS + 1 if other else self.REPLICAS
        mine = JobShape(replicas, 1, replica)
        self.first = self.first or mine
        keys = dict(self.store.values)
        job = JobShape.parse(self.store.compare_set("shape", "", mine.text()))
        if mine.refusal(job) is not None:  # refused: nothing written, nothing announced
            assert self.store.values == keys
            self.refused += 1
            return
        self.count += 1
        token = f"t{self.count}"
        self.shapes[token] = mine
        self.live[token] = replica
        self.store.values[f"join/{replica}"] = token

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(sorted(self.live)))
        self.dead.add((self.live.pop(token), token))

    @rule()
    def decide(self) -> None:
        """The next epoch, by a live member of the newest (or, first, a live joiner)."""
        decisions = self._decisions()
        joiners = {
            r: t
            for r, t in complete_joiners(self._announced(), 1).items()
            if (r, t) not in self.dead
        }
        if not decisions:
            if len(joiners) == self.REPLICAS and self.live:
                self.store.compare_set("decision/0", "", propose(0, {}, joiners, 0).text())
            return
        newest = decisions[-1]
        survivors = {r: t for r, t in newest.members if (r, t) not in self.dead}
        if not survivors:
            return  # nobody can decide: what a joiner must be told
        joiners = {r: t for r, t in joiners.items() if newest.token(r) != t}
        nxt = propose(newest.epoch + 1, survivors, joiners, 0, catch_up=True)
        self.store.compare_set(f"decision/{nxt.epoch}", "", nxt.text())

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def look(self, data: st.DataObject) -> None:
        """A live incarnation's view, from the store's events in any order."""
        token = data.draw(st.sampled_from(sorted(self.live)))
        replica = self.live[token]
        decisions = self._decisions()
        events: list[tuple[str, Any]] = [("decided", d) for d in decisions]
        events += [("died", d) for d in self.dead]
        events += [("announced", a) for a in self._announced()]
        order = data.draw(st.permutations(events))
        join = Joining(replica, token, replicas=self.REPLICAS, local=1)
        for kind, value in order:
            if kind == "decided":
                join.decided(value)
            elif kind == "died":
                join.died(*value)
            else:
                join.announced(*value)
        newest = decisions[-1] if decisions else None
        assert join.newest == newest
        if newest is None:
            live = {
                r
                for r, t in complete_joiners(self._announced(), 1).items()
                if (r, t) not in self.dead
            }
            assert set(join.never_announced) == set(range(self.REPLICAS)) - live
            assert not join.no_live_replica
            return
        admitted = newest.token(replica) == token
        assert (join.admitted is not None) == admitted
        alive = [r for r, t in newest.members if (r, t) not in self.dead]
        assert join.no_live_replica == (not admitted and not alive)

    @invariant()
    def one_job_shape(self) -> None:
        if self.first is None:
            return
        job = JobShape.parse(self.store.values["shape"])
        assert job == self.first
        for shape in self.shapes.values():  # every accepted start matches the job
            assert (shape.replicas, shape.local) == (job.replicas, job.local)
        for decision in self._decisions():  # only accepted incarnations are ever members
            assert all(r < job.replicas for r in decision.replicas)

    @invariant()
    def members_were_live_announcers(self) -> None:
        tokens = set(self.live) | {t for _, t in self.dead}
        for decision in self._decisions():
            assert {t for _, t in decision.members} <= tokens


TestMembershipMachine = MembershipMachine.TestCase
TestMembershipMachine.settings = settings(max_examples=300, stateful_step_count=30)
