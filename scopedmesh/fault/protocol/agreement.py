"""The survivors' agreement on lost ranks, as a generator: store answers in, requests out.

:func:`agreement` yields what it needs done (:class:`Append`, :class:`Add`,
:class:`Get`, :class:`CompareSet`, :class:`Wake`, :class:`ReadGone`,
:class:`KnownGone`, :class:`Sleep`, :class:`Now`) and is sent each answer; it
returns an :class:`Outcome`. It owns no store, clock or thread: the liveness
watch drives it over a real store (:mod:`~scopedmesh.fault.liveness.agreement`),
the simulation in the tests over a simulated one, one request at a time,
interleaved with every other member's.

>>> steps = agreement(Keys("a"), [0], 0, committed=3, limit=1.0, tag="t")
>>> next(steps)
KnownGone()
>>> steps.send(frozenset())
Append(key='a/in', value='0:alive/3,')

(``Keys`` is :class:`~scopedmesh.c10d.store.AgreementKeys`, the layout of an
agreement's keys in the store.)
>>> steps.send(None), steps.send(1)
(Add(key='a/appended', amount=1), Now())

One rule decides: the first proposal written (``compare_set`` on an empty key)
is every survivor's decision, and a proposal is written only once the
entries, with the members listed gone, account for every member. A *gone*
member is one that died or departed (its watch closed): nobody waits for it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

from scopedmesh.c10d.store import AgreementKeys as Keys

__all__ = [
    "LOOK_AT_MOST",
    "LOOK_EVERY",
    "Action",
    "Add",
    "Append",
    "CompareSet",
    "Get",
    "Keys",
    "KnownGone",
    "Now",
    "Outcome",
    "ReadGone",
    "Sleep",
    "Wake",
    "accounted",
    "agreement",
    "agreement_name",
    "answer",
    "committed_in",
    "committed_of",
    "decision_of",
    "free_line",
    "holds",
    "line_key",
    "line_of",
    "members_key",
    "proposal",
]

LOOK_EVERY = 0.25  # seconds before a member first looks at a stalled agreement (then doubled)
LOOK_AT_MOST = 4.0  # seconds: the longest wait between two looks


# ------------------------------------------------------------------ the requests


@dataclass(frozen=True)
class Append:
    """Append ``value`` to ``key`` (one atomic request); answered None."""

    key: str
    value: str


@dataclass(frozen=True)
class Add:
    """Add ``amount`` to the counter ``key``; answered with its new value."""

    key: str
    amount: int


@dataclass(frozen=True)
class Get:
    """Read ``key``; answered with its text, or None where it does not exist."""

    key: str


@dataclass(frozen=True)
class CompareSet:
    """Set ``key`` to ``desired`` where it holds ``expected`` (empty: missing); answered
    with what it holds after."""

    key: str
    expected: str
    desired: str


@dataclass(frozen=True)
class Wake:
    """Wake ``ranks`` (their watches read the news); answered None."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ReadGone:
    """Read the store's lists of gone members (dead or departed; one request); answered
    with every gone rank known after it."""


@dataclass(frozen=True)
class KnownGone:
    """The members this process knows are gone, asking nobody; answered with them."""


@dataclass(frozen=True)
class Now:
    """The time (seconds, monotonic); answered with it."""


@dataclass(frozen=True)
class Sleep:
    """Sleep until news (a wake-up, a death learned) or time ``until``; answered with
    whether news came."""

    until: float


Action = Append | Add | Get | CompareSet | Wake | ReadGone | KnownGone | Now | Sleep


def agreement_name(key: str, tag: str) -> str:
    """The name of the agreement ``tag`` among the members ``key`` (:func:`line_key`): its
    keys carry both, so that a decision is read only by the members it was made for.

    >>> agreement_name(members_key([2, 3]), "event0")
    'm2.2-3/event0'
    """
    return f"{key}/{tag}"


def members_key(members: Iterable[int]) -> str:
    """A short name for a set of members, the same on every member: its size and its
    ranks, as runs (``m4.0-3``), or a digest where the runs are long.

    >>> members_key([0, 1, 2, 3]), members_key([2, 3, 7])
    ('m4.0-3', 'm3.2-3_7')
    >>> members_key(range(0, 4096, 2))
    'm2048.e190a7e647798086'
    """
    ranks = sorted(set(members))
    runs: list[str] = []
    start = previous = None
    for rank in [*ranks, None]:
        if rank is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    text = "_".join(runs)
    if len(text) > 32:
        import hashlib

        text = hashlib.sha1(text.encode()).hexdigest()[:16]
    return f"m{len(ranks)}.{text}"


def line_key(members: Iterable[int], line: str) -> str:
    """The key of ``members`` in the line ``line`` (a mesh a watch guarded and the meshes
    re-formed from it): their :func:`members_key` where that is the line's name (the
    first mesh a watch guarded over those ranks), else ``members~line`` (a mesh
    re-formed with fewer ranks, or a second line over the same ranks, named
    ``<members>#1``). So two meshes under one watch never share a key, nor their
    steps' counts, agreements or stops, even over the same ranks.

    >>> line_key([0, 1, 2, 3], "m4.0-3"), line_key([0, 1, 2], "m4.0-3")
    ('m4.0-3', 'm3.0-2~m4.0-3')
    >>> line_key([0, 1, 2, 3], "m4.0-3#1")
    'm4.0-3~m4.0-3#1'
    """
    key = members_key(members)
    return key if line in ("", key) else f"{key}~{line}"


def free_line(first: str, busy: Iterable[str]) -> str:
    """The line a mesh over the ranks ``first`` (their :func:`members_key`) begins, where
    the lines of ``busy`` have a mesh open: ``first`` itself where it is free, else
    ``first#1``, ``first#2``, ... (the first free). So meshes guarded one after another
    continue one line, and meshes open at once each have their own.

    >>> free_line("m4.0-3", []), free_line("m4.0-3", ["m4.0-3", "m2.0-1"])
    ('m4.0-3', 'm4.0-3#1')
    >>> free_line("m4.0-3", ["m4.0-3", "m4.0-3#2"])
    'm4.0-3#1'
    """
    taken = set(busy)
    line, count = first, 0
    while line in taken:
        count += 1
        line = f"{first}#{count}"
    return line


def line_of(key: str) -> str:
    """The line of the members' key ``key`` (:func:`line_key`).

    >>> line_of("m4.0-3"), line_of("m3.0-2~m4.0-3")
    ('m4.0-3', 'm4.0-3')
    """
    return key.partition("~")[2] or key


def holds(key: str, rank: int) -> bool | None:
    """Whether the members named ``key`` (:func:`members_key`, or :func:`line_key`) hold
    ``rank``; None where the key is a digest, which does not say.

    >>> holds("m3.2-3_7", 7), holds("m3.2-3_7", 4), holds("m2048.e190a7e647798086", 2)
    (True, False, None)
    >>> holds("m3.0-2~m4.0-3", 3)
    False
    """
    size, _, text = key.partition("~")[0].partition(".")
    parts = text.split("_")
    if not all(part.replace("-", "", 1).isdigit() for part in parts):
        return None  # a digest (or no key of runs)
    runs = [
        (int(first), int(last or first)) for first, _, last in (p.partition("-") for p in parts)
    ]
    if f"m{sum(last - first + 1 for first, last in runs)}" != size:
        return None  # a digest of decimal digits only: it names no ranks
    return any(first <= rank <= last for first, last in runs)


# ------------------------------------------------------------------ the texts


def accounted(text: str) -> dict[int, bool]:
    """The members an agreement's entries account for: rank -> whether any entry says lost.

    >>> accounted("0:alive,3:lost,1:alive/4,3:alive,0:lost,")
    {0: True, 3: True, 1: False}
    """
    found: dict[int, bool] = {}
    for rank, _, state in (item.partition(":") for item in text.split(",") if item):
        found[int(rank)] = found.get(int(rank), False) or state == "lost"
    return found


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


def proposal(
    text: str, members: Iterable[int], gone: Iterable[int], committed: int | None
) -> str | None:
    """The decision to propose from the entries ``text`` and the ``gone`` members, or None
    while a member is neither accounted for nor gone. It holds every member an entry
    marks lost or that is gone, and the highest count of committed steps checked in.

    >>> proposal("0:alive/4,1:alive/5,", [0, 1, 2], {2}, 4)
    'lost:2;committed:5'
    >>> proposal("0:alive,", [0, 1], (), None) is None
    True
    """
    members = list(members)
    entries = accounted(text)
    lost = {rank for rank, said_lost in entries.items() if said_lost}
    lost.update(set(gone).intersection(members))
    if any(rank not in entries and rank not in lost for rank in members):
        return None
    written = "lost:" + ",".join(str(r) for r in sorted(lost.intersection(members)))
    counts = [*committed_in(text), *([] if committed is None else [committed])]
    return written + (f";committed:{max(counts)}" if counts else "")


# ------------------------------------------------------------------ the machine


@dataclass(frozen=True)
class Outcome:
    """What an agreement decided: the ``lost`` members, the highest count of ``committed``
    steps checked in (None: none was), and whether this member ``wrote`` the decision."""

    lost: frozenset[int]
    committed: int | None
    wrote: bool


def check_in(keys: Keys, rank: int, committed: int | None) -> Generator[Action, Any, int]:
    """Account for ``rank`` as alive with its count of ``committed`` steps (one append),
    then count the entries (one add); the count."""
    state = "alive" if committed is None else f"alive/{committed}"
    yield Append(keys.entries, f"{rank}:{state},")
    return int((yield Add(keys.appended, 1)))


def _look(
    keys: Keys, members: list[int], known: frozenset[int], committed: int | None
) -> Generator[Action, Any, tuple[str, bool] | None]:
    """Read the entries and the store's gone members, and propose: the decision (this
    proposal or the one written first) and whether this one was written; while a
    member is missing here, the decision if one was written, else None."""
    text = (yield Get(keys.entries)) or ""
    gone = frozenset((yield ReadGone())).union(known)
    proposed = proposal(text, members, gone, committed)
    if proposed is None:  # a member is missing here; a decision may stand all the same
        written = yield Get(keys.decision)  # (its writer's wake-up lost, or this one slept)
        return (str(written), False) if written else None
    decided = str((yield CompareSet(keys.decision, "", proposed)))
    return decided, decided == proposed


def _complete_here(
    keys: Keys, members: list[int], known: frozenset[int]
) -> Generator[Action, Any, bool]:
    """Whether the entries counted (one request) and the gone members known here may
    account for every member (duplicates may overcount: then a look finds out)."""
    counted = int((yield Add(keys.appended, 0)))
    return counted + len(known.intersection(members)) >= len(members)


def agreement(
    keys: Keys,
    members: Iterable[int],
    rank: int,
    *,
    committed: int | None,
    limit: float,
    tag: str,
) -> Generator[Action, Any, Outcome]:
    """Check in, then sleep until the decision; no polling, at most ``limit`` seconds.

    Each member checks in (an append, then an add that counts the entries); one
    whose count and known gone members account for every member looks (reads the
    entries and the gone, writes the decision) and wakes the others, who read
    the decision once woken. A gone member learned while waiting costs one count,
    and one claim where the count now looks complete (the first claimer looks).
    While no decision is known, after :data:`LOOK_EVERY` seconds and then twice
    as long each time (up to :data:`LOOK_AT_MOST`), the lowest member not known
    gone looks whatever the count says (a writer that died between its append
    and its count left it short), and the others claim the one look once the
    count says everyone is in. Raises ``TimeoutError`` naming the members
    neither accounted for nor gone.
    """
    members = sorted(set(members))
    known = frozenset((yield KnownGone()))
    count = yield from check_in(keys, rank, committed)
    start = float((yield Now()))
    deadline, pause = start + limit, LOOK_EVERY
    look_at = start + pause
    woken = False
    while True:
        decided: tuple[str, bool] | None = None
        if count + len(known.intersection(members)) >= len(members):
            count = -len(members)  # one look per check-in
            decided = yield from _look(keys, members, known, committed)
        now_known = frozenset((yield KnownGone()))
        new = sorted(now_known.difference(known).intersection(members))
        known = now_known
        if decided is None and new and (yield from _complete_here(keys, members, known)):
            if int((yield Add(keys.claim(new[-1]), 1))) == 1:
                decided = yield from _look(keys, members, known, committed)
        now = float((yield Now()))
        if decided is None and now >= look_at:
            pause = min(2 * pause, LOOK_AT_MOST)
            look_at = now + pause
            lowest = min(set(members).difference(known), default=rank)
            if rank == lowest or (
                (yield from _complete_here(keys, members, known))
                and int((yield Add(keys.look, 1))) == 1
            ):
                decided = yield from _look(keys, members, known, committed)
        if decided is None and woken:
            written = yield Get(keys.decision)
            decided = (written, False) if written else None
        if decided is not None:
            text, wrote = decided
            if wrote:
                yield Wake(tuple(r for r in members if r != rank and r not in decision_of(text)))
            return Outcome(decision_of(text), committed_of(text), wrote)
        now = float((yield Now()))
        if now >= deadline:
            text = (yield Get(keys.entries)) or ""
            gone = frozenset((yield KnownGone()))
            entries = accounted(text)
            missing = [r for r in members if r not in gone and r not in entries]
            raise TimeoutError(
                f"agreement {tag!r}: ranks {missing} neither checked in nor left within "
                f"{limit:g} s, and no watch saw them die or leave: every member must "
                "agree with the same tag (a rank busy in a long computation checks in "
                "when it reaches the agreement)"
            )
        woken = bool((yield Sleep(min(deadline, look_at))))


def answer(
    keys: Keys, members: Iterable[int], rank: int, *, committed: int | None
) -> Generator[Action, Any, None]:
    """Check in for ``rank`` from outside the agreement (its watch answering a member in
    doubt, or its close); where that check-in accounts for every member, look, and wake
    the others once this decision is written.

    >>> steps = answer(Keys("a"), [0, 1], 1, committed=4)
    >>> next(steps), steps.send(frozenset())
    (KnownGone(), Append(key='a/in', value='1:alive/4,'))
    """
    members = sorted(set(members))
    known = frozenset((yield KnownGone()))
    count = yield from check_in(keys, rank, committed)
    if count + len(known.intersection(members)) < len(members):
        return
    decided = yield from _look(keys, members, known, committed)
    if decided is not None and decided[1]:
        lost = decision_of(decided[0])
        yield Wake(tuple(r for r in members if r != rank and r not in lost))
