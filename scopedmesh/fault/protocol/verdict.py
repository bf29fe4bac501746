"""A step's verdict, as a generator: what the step saw in, what to do out.

:func:`verdict` runs at a guarded step's end (:class:`~scopedmesh.fault.liveness.step.Step`
drives it; so does the simulation in the tests). It yields requests
(:class:`IsAborted`, :class:`AwaitAbort`, :class:`PostStop`, :class:`AbortMesh`,
:class:`Vote`, :class:`Commit`, :class:`Ask`, :class:`FirstStop`,
:class:`Departed`, :class:`Agreed`, and the agreement's own) and returns a
:class:`Verdict`. The :class:`Ledger` is one watch's memory of the steps, per
set of members: how many agreements they held (the attempt), how many steps
they committed, and the attempts this rank answered for while its step ran.

The rules:

1. A member whose block raised, or that cannot vote, posts a *stop* (every
   member's mesh is aborted) unless its mesh is aborted already.
2. The vote is the MAX of every member's flag (0: fine here). Completed, with
   no abort since and no answer given for this attempt: the step committed
   (all flags 0) or failed, alike on every member; a failed step is then
   agreed on, so that every member re-forms and counts its attempts alike.
3. **Doubt.** A member whose vote did not complete asks the others to answer
   (their watches' threads check in with their counts of committed steps, so
   nobody waits on a peer's compute; an answer *fences* the attempt: that
   member's vote of it no longer commits) and agrees. It commits the step if
   and only if a member committed it: the highest count is one above its own.
4. After an agreement the step raises where it must: a
   :class:`~scopedmesh.errors.StepError` where a member the agreement lost had
   left the job after an exception (its type and message in the error; before
   any re-forming, which would be pointless); this rank's own
   non-``RuntimeError`` exception; and a ``RuntimeError`` raised by this
   rank's step in two attempts in a row, with nobody lost, where this rank
   stopped the step first (a bug, never redone for ever).

>>> ledger = Ledger()
>>> ledger.fence(("m2.0-1", 0), [("m2.0-1", 0)]), ledger.commit("m2.0-1", 0)
(True, False)
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from scopedmesh.fault.protocol.agreement import Action as AgreementAction
from scopedmesh.fault.protocol.agreement import (
    Get,
    Keys,
    agreement,
    agreement_name,
    answer,
    committed_of,
    decision_of,
    line_key,
    line_of,
)
from scopedmesh.layout.mesh_layout import MeshLayout
from scopedmesh.layout.survivors import shrink

__all__ = [
    "FAILED",
    "OK",
    "STOP_GRACE",
    "AbortMesh",
    "Agreed",
    "Ask",
    "AwaitAbort",
    "Commit",
    "Departed",
    "Fence",
    "FirstStop",
    "IsAborted",
    "Ledger",
    "Lineup",
    "PostStop",
    "RaisedAgain",
    "Steps",
    "Verdict",
    "Vote",
    "answer_ask",
    "doubt_commits",
    "stopped",
    "verdict",
]

OK, FAILED = 0, 1  # a member's flag in the vote
STOP_GRACE = 0.25  # seconds a collective's error waits for the watch to learn of a death
NONE, RUNTIME, OTHER = "none", "runtime", "other"  # what the block raised


@dataclass(frozen=True)
class IsAborted:
    """Whether the mesh was aborted (answered with a bool)."""


@dataclass(frozen=True)
class AwaitAbort:
    """Wait up to ``seconds`` for the mesh to be aborted; answered with whether it was."""

    seconds: float


@dataclass(frozen=True)
class PostStop:
    """Tell every member this rank's step raised in ``attempt`` (their meshes abort)."""

    attempt: int


@dataclass(frozen=True)
class AbortMesh:
    """Abort this rank's mesh, saying ``why``."""

    why: str


@dataclass(frozen=True)
class Vote:
    """Take part in the vote with ``flag``; answered with the MAX of every member's flag,
    or None where the vote did not complete here (a death or an abort cut it short)."""

    flag: int


@dataclass(frozen=True)
class Commit:
    """Count the step as committed unless this rank answered for ``attempt`` already
    (:meth:`Ledger.commit`); answered with whether it counted."""

    attempt: int


@dataclass(frozen=True)
class Ask:
    """An agreement on ``attempt`` begins here (this rank's count there is final: the
    ledger counts it answered for); in ``doubt`` (the vote did not settle the step here),
    every member is asked to answer: their watches check in with their counts."""

    attempt: int
    doubt: bool = True


@dataclass(frozen=True)
class FirstStop:
    """The rank whose stop of ``attempt`` was posted first, or None."""

    attempt: int


@dataclass(frozen=True)
class Departed:
    """Which of ``ranks`` left the job after an exception; answered ``{rank: "Type: message"}``."""

    ranks: frozenset[int]


@dataclass(frozen=True)
class RaisedAgain:
    """This rank's step raised a ``RuntimeError`` in ``attempt``, nobody lost; answered with
    whether it did in the attempt before too (:meth:`Ledger.raised_again`)."""

    attempt: int


@dataclass(frozen=True)
class Agreed:
    """The members agreed on ``attempt``: their count of committed steps is ``highest``,
    and ``lost`` are gone; the others go on as their :class:`Lineup` after the loss (the
    ledger moves there at once, so that an ask about the re-formed mesh finds this rank
    there)."""

    attempt: int
    highest: int
    lost: frozenset[int]


Action = (
    AgreementAction
    | IsAborted
    | AwaitAbort
    | PostStop
    | AbortMesh
    | Vote
    | Commit
    | Ask
    | FirstStop
    | Departed
    | RaisedAgain
    | Agreed
)


@dataclass(frozen=True)
class Verdict:
    """A step's verdict on this member: ``committed``; ``lost`` (agreed, empty when the vote
    decided); ``agreed`` (whether an agreement was held: the mesh is then re-formed,
    :attr:`reforms` says when);
    ``raise_own`` (raise the block's exception); ``error`` (a message to raise as
    :class:`~scopedmesh.errors.StepError`, or None)."""

    committed: bool
    lost: frozenset[int] = frozenset()
    agreed: bool = False
    raise_own: bool = False
    error: str | None = None

    @property
    def reforms(self) -> bool:
        """Whether the mesh is re-formed after this step: an agreed step that failed. One a
        member in doubt committed is re-formed after the next step, which fails at once (the
        members whose vote completed learn of the death only then): so every member re-forms
        a mesh after the same step.

        >>> Verdict(False, agreed=True).reforms, Verdict(True, agreed=True).reforms
        (True, False)
        """
        return self.agreed and not self.committed


@dataclass(frozen=True)
class Lineup:
    """The members of a mesh a rank steps on, as its ``layout``, and the ``axis`` its heals
    shrink: whom the survivors go on as (:func:`~scopedmesh.layout.survivors.shrink` drops
    every slice of ``axis`` that holds a lost rank, as ``reform`` does).

    >>> lineup = Lineup(MeshLayout((2, 2), names=("dp", "tp")), axis=0)
    >>> lineup.ranks, lineup.after({3}).ranks, lineup.after({1, 3})
    ([0, 1, 2, 3], [0, 1], None)
    >>> Lineup.of([2, 5, 7]).after({5}).ranks  # one rank a slice: the members minus the lost
    [2, 7]
    """

    layout: MeshLayout
    axis: int = 0

    @classmethod
    def of(cls, members: Iterable[int]) -> Lineup:
        """``members`` as one axis, each rank a slice of its own."""
        ranks = sorted(members)
        return cls(MeshLayout((len(ranks),), ranks=ranks))

    @cached_property
    def ranks(self) -> list[int]:
        """The members, in order."""
        return sorted(self.layout.ranks)

    def after(self, lost: Iterable[int]) -> Lineup | None:
        """The lineup the survivors go on as once ``lost`` are gone (ranks outside it do not
        count): itself where none is in it, None where every slice of the axis holds one."""
        hit = sorted({rank for rank in lost if rank in self.layout})
        if not hit:
            return self
        try:
            return Lineup(shrink(self.layout, hit, self.axis), self.axis)
        except ValueError:  # every slice hit: nobody goes on
            return None


@dataclass
class Ledger:
    """One watch's steps per set of members (named by :func:`~scopedmesh.fault.protocol.
    agreement.members_key`): agreements held, steps committed, attempts answered for, and
    the attempt whose step last raised a ``RuntimeError`` here. Pure: the watch holds a
    lock around it (its store thread answers while the caller's thread steps).

    >>> ledger = Ledger()
    >>> ledger.commit("m2.0-1", 0), ledger.committed["m2.0-1"]
    (True, 1)
    >>> [(key, lineup.ranks, at, count) for key, lineup, at, count in ledger.steps(
    ...     {"m2.0-1": Lineup.of([0, 1])})]
    [('m2.0-1', [0, 1], 0, 1)]
    """

    attempts: dict[str, int] = field(default_factory=dict)
    committed: dict[str, int] = field(default_factory=dict)
    answered: set[tuple[str, int]] = field(default_factory=set)
    raised: dict[str, int] = field(default_factory=dict)

    def attempt(self, key: str) -> int:
        """The attempt the members ``key`` are at: how many agreements they held."""
        return self.attempts.get(key, 0)

    def commit(self, key: str, attempt: int) -> bool:
        """Count a step of ``key`` whose vote committed, unless this rank answered for
        ``attempt`` (its count was given: the step is then settled by the agreement)."""
        if (key, attempt) in self.answered:
            return False
        self.committed[key] = self.committed.get(key, 0) + 1
        return True

    def steps(self, members: dict[str, Lineup]) -> list[tuple[str, Lineup, int, int]]:
        """Where this rank is on each set of members it steps on now: ``(key, lineup,
        attempt, committed)`` (:class:`Steps`)."""
        return [
            (key, members[key], self.attempt(key), count)
            for key, count in self.committed.items()
            if key in members
        ]

    def agreed(self, key: str, highest: int) -> None:
        """The members ``key`` agreed: one attempt more; their count is ``highest``."""
        self.attempts[key] = self.attempt(key) + 1
        self.committed[key] = highest

    def moved(self, key: str, new: str) -> None:
        """The members ``key`` go on as ``new`` (re-formed around lost ranks): the count
        moves with them; ``new`` keeps its own count of attempts (its keys are its own)."""
        if new != key:
            self.committed[new] = self.committed.pop(key, 0)
            self.attempts.setdefault(new, 0)

    def fence(
        self, start: tuple[str, int], chain: Iterable[tuple[str, int]], count: int = 0
    ) -> bool | None:
        """Fence every attempt of ``chain`` (this rank answers for them: no vote of its own
        there commits), where the ledger is still at ``start`` with ``count`` committed
        steps there (a step that committed meanwhile makes the answer stale); whether it
        was, or None where every one was answered for already (nothing to answer again).

        >>> ledger = Ledger()
        >>> ledger.fence(("m2.0-1", 0), [("m2.0-1", 0), ("m2.0-1", 1)]), ledger.commit("m2.0-1", 0)
        (True, False)
        """
        key, attempt = start
        chain = list(chain)
        if all(link in self.answered for link in chain):
            return None
        if self.attempt(key) != attempt or self.committed.get(key, 0) != count:
            return False
        self.answered.update(chain)
        return True

    def raised_again(self, key: str, attempt: int) -> bool:
        """Note that the step raised here in ``attempt``; whether it did in the one before."""
        again = self.raised.get(key) == attempt - 1
        self.raised[key] = attempt
        return again

    def total(self) -> int:
        """Every step committed, over every set of members."""
        return sum(self.committed.values())


def stopped(stops: Iterable[tuple[int, str, int]], key: str, since: int) -> set[int]:
    """The ranks whose stops, ``(rank, members, attempt)``, abort a mesh of the members
    ``key`` guarded at attempt ``since``: those of its members, from that attempt on (a
    stop read late never aborts the mesh re-formed after it, nor a mesh of other members).

    >>> sorted(stopped([(1, "m2.0-1", 0), (2, "m2.2-3", 1), (0, "m2.0-1", 1)], "m2.0-1", 1))
    [0]
    """
    return {rank for rank, members, attempt in stops if members == key and attempt >= since}


def doubt_commits(mine: int, highest: int, flag: int) -> bool:
    """Whether a member in doubt commits its step: a peer committed it (the highest count
    is one above its own; then every flag was OK). Any other gap breaks the vote's rule.

    >>> doubt_commits(4, 5, OK), doubt_commits(4, 4, OK)
    (True, False)
    """
    if highest > mine + 1 or (highest == mine + 1 and flag != OK) or highest < mine:
        raise RuntimeError(
            f"the members' counts of committed steps ({highest} against {mine} here, whose "
            f"flag was {flag}) break the step's vote"
        )
    return highest == mine + 1


def verdict(
    *,
    rank: int,
    members: list[int],
    keys: Keys,
    attempt: int,
    mine: int,
    raised: str,
    can_vote: bool,
    limit: float,
    tag: str,
) -> Generator[Action, Any, Verdict]:
    """The verdict of ``rank``'s step on ``members`` at ``attempt`` (its ``mine`` committed
    steps so far; ``raised``: what its block raised, ``"none"``, ``"runtime"`` (a
    ``RuntimeError``) or ``"other"``; ``can_vote``: whether its vote's group formed)."""
    if raised == RUNTIME:  # a collective's error: is a death behind it?
        yield AwaitAbort(STOP_GRACE)
    if (raised != NONE or not can_vote) and not (yield IsAborted()):
        yield PostStop(attempt)  # before this rank's sockets close, so that it is first
        why = "could not form the step's vote" if raised == NONE else "raised"
        yield AbortMesh(f"when rank {rank}'s step {why}")
    flag = FAILED if raised != NONE or (yield IsAborted()) else OK
    outcome = (yield Vote(flag)) if can_vote else None
    known = outcome is not None and not (yield IsAborted())
    if known and outcome == OK and (yield Commit(attempt)):
        return Verdict(committed=True)
    # A failed step is agreed on by every member (so they re-form and count attempts
    # alike); a member whose vote did not settle it asks the others to answer.
    yield Ask(attempt, doubt=not known or outcome == OK)
    decided = yield from agreement(keys, members, rank, committed=mine, limit=limit, tag=tag)
    highest = mine if decided.committed is None else decided.committed
    committed = doubt_commits(mine, highest, flag)
    yield Agreed(attempt, highest, decided.lost)
    departed = dict((yield Departed(decided.lost))) if decided.lost else {}
    error = None
    if departed:
        error = "; ".join(
            f"rank {r} left the job after {why}" for r, why in sorted(departed.items())
        )
    raise_own = raised == OTHER
    if raised == RUNTIME and not decided.lost and (yield RaisedAgain(attempt)):
        # Raised here in two attempts in a row, and this rank stopped the step first: a bug
        # of its own, never redone for ever. (A peer's error that a stop explains does not
        # repeat so; where that peer's loop lets its error out, it leaves: see above.)
        raise_own = (yield FirstStop(attempt)) == rank
    return Verdict(committed, decided.lost, True, raise_own, error)


# ------------------------------------------------------------------ answering a member in doubt


@dataclass(frozen=True)
class Steps:
    """This rank's steps: answered with ``[(key, lineup, attempt, committed), ...]``, one
    per set of members it stepped on (read from the :class:`Ledger` under its lock)."""


@dataclass(frozen=True)
class Fence:
    """Fence ``chain`` (the attempts this rank answers for, from ``start`` on), unless the
    ledger moved from ``start`` (its attempt, or ``count``, its committed steps there)
    meanwhile; answered with whether it fenced, or None where it had answered for them
    all already (:meth:`Ledger.fence`)."""

    start: tuple[str, int]
    chain: tuple[tuple[str, int], ...]
    count: int


def answer_ask(*, rank: int, prefix: str, key: str, attempt: int) -> Generator[Any, Any, None]:
    """Answer a member in doubt about ``attempt`` of the members ``key``: check in for this
    rank with its count of committed steps, without waiting for its compute.

    Where this rank is at that attempt, its count is its ledger's. Where it is behind
    (still computing an earlier attempt that the others settled without it, which
    it answered for then), the decisions written since say what its count will be:
    each one it replays (the members go on as their :class:`Lineup` after the loss,
    the highest count is its own) until the attempt asked about. Every attempt on
    the way is fenced, so that no vote of its own there commits; its main thread
    reads those decisions when it gets there. Where a decision on the way is not
    written yet, or leaves this rank out (lost, or in a dropped slice), it does not
    answer (the asker is answered by its own agreement).

    A step this rank commits between the read of its ledger and the fence makes the
    answer stale: it is worked out again. That ends, for each retry follows a move of this
    rank's ledger, and once the ledger is past ``attempt`` there is nothing to answer.
    """
    while (yield from _answer_once(rank=rank, prefix=prefix, key=key, attempt=attempt)) is None:
        pass


def _answer_once(
    *, rank: int, prefix: str, key: str, attempt: int
) -> Generator[Any, Any, bool | None]:
    """One try of :func:`answer_ask`: True once answered, False where it must not answer,
    None where the ledger moved meanwhile (try again)."""
    for start_key, lineup, at, count in (yield Steps()):
        if line_of(start_key) != line_of(key):  # a line's decisions never lead to another's
            continue
        start = (start_key, at, count)
        chain = [(start_key, at)]
        while (start_key, at) != (key, attempt) and len(chain) < 64:
            name = agreement_name(start_key, f"event{at}")
            text = yield Get(f"{prefix}/agree/{name}/decision")
            if not text:
                break
            lost = decision_of(text)
            highest = committed_of(text)
            count = count if highest is None else highest
            after = lineup.after(lost)
            if after is lineup:  # nobody of these members lost: their next attempt
                at += 1
            elif after is None or rank not in after.layout:  # it goes on no further
                return False
            else:
                lineup = after
                start_key, at = line_key(lineup.ranks, line_of(start_key)), 0
            chain.append((start_key, at))
        if (start_key, at) != (key, attempt):
            continue
        fenced = yield Fence(start[:2], tuple(chain), start[2])
        if fenced is None:  # answered already (or agreeing there itself)
            return False
        if not fenced:
            return None
        keys = Keys(f"{prefix}/agree/{agreement_name(key, f'event{attempt}')}")
        yield from answer(keys, lineup.ranks, rank, committed=count)
        return True
    return False
