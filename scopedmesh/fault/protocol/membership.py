"""A replicated job's membership as pure rules: which incarnation of each replica is
in an epoch, the job's shape, and what a starting replica waits for.

No socket, thread, clock or store here: :class:`~scopedmesh.fault.replicas.Replicas`
reads the job's store and hands in what it holds (the job's shape, the
announcements, the decided epochs, the incarnations found dead), and these rules
say what follows. A :class:`Decision` is what the store holds for one epoch
(written once, by ``compare_set``); :func:`propose` is the rule every proposer
applies, so that whichever proposal wins, it is one of the same kind;
:class:`JobShape` is the job's ``replicas`` and ``local``, set by the first
replica to start (``compare_set`` as well); :class:`Joining` is a starting
incarnation's view of the job until an epoch admits it.

>>> d = Decision(epoch=4, members=((0, "a"), (2, "c")), source=0, joins=7)
>>> Decision.parse(4, d.text())  == d
True
>>> d.text()
'members=0:a,2:c;source=0;joins=7'
>>> d.index(2), d.size, d.token(1) is None
(1, 2, True)
>>> Decision(5, ((0, "a"), (1, "b2")), 0, 8, fresh=(1,)).text()
'members=0:a,1:b2;source=0;joins=8;fresh=1'
>>> print(JobShape(4, 2, replica=3).refusal(JobShape(3, 2, replica=0)))
replicas=4 differs from the job's replicas=3, set by replica 0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "Decision",
    "JobShape",
    "Joining",
    "complete_joiners",
    "never_announced",
    "no_state_left",
    "propose",
]


@dataclass(frozen=True)
class Decision:
    """Epoch ``epoch``: the ``members`` (replica, incarnation token) in replica order, the
    ``source`` replica whose state every member takes, and the ``joins`` counter it saw.

    ``fresh``: the joiners an admission lets in that catch up in the background
    (the source sends them its state during the epoch's first step, to which
    they contribute nothing); empty after a heal, where every member takes the
    source's state before the first step.
    """

    epoch: int
    members: tuple[tuple[int, str], ...]
    source: int
    joins: int
    fresh: tuple[int, ...] = ()

    @property
    def replicas(self) -> tuple[int, ...]:
        """The member replicas, ascending."""
        return tuple(r for r, _ in self.members)

    @property
    def size(self) -> int:
        """How many replicas (the size of each dp group of the epoch)."""
        return len(self.members)

    def token(self, replica: int) -> str | None:
        """The admitted incarnation of ``replica``, or None if it is not a member."""
        return dict(self.members).get(replica)

    def index(self, replica: int) -> int:
        """``replica``'s rank in the epoch's dp groups."""
        return self.replicas.index(replica)

    def text(self) -> str:
        """The store's form of the decision."""
        members = ",".join(f"{r}:{t}" for r, t in self.members)
        text = f"members={members};source={self.source};joins={self.joins}"
        return text + (f";fresh={','.join(map(str, self.fresh))}" if self.fresh else "")

    @staticmethod
    def parse(epoch: int, text: str) -> Decision:
        """The decision of ``epoch`` from its store text (:meth:`text`)."""
        fields = dict(part.partition("=")[::2] for part in text.split(";"))
        members = tuple(
            (int(r), t) for r, _, t in (m.partition(":") for m in fields["members"].split(",") if m)
        )
        fresh = tuple(int(r) for r in fields.get("fresh", "").split(",") if r)
        return Decision(epoch, members, int(fields["source"]), int(fields["joins"]), fresh)


def propose(
    epoch: int,
    survivors: Mapping[int, str],
    joiners: Mapping[int, str],
    joins: int,
    *,
    catch_up: bool = False,
    behind: Iterable[int] = (),
) -> Decision:
    """The next epoch: the ``survivors`` (replica -> token) and the complete ``joiners``.

    A joiner replaces a survivor's incarnation of the same replica only when the
    survivor is not counted among the survivors (its old incarnation died). The
    source is the lowest surviving replica not ``behind`` (a joiner not yet
    caught up): it holds live state. With no such survivor, the lowest
    survivor; with no survivor (the job's first epoch), the lowest joiner.
    ``catch_up`` (an admission, every survivor in step): the admitted joiners
    are ``fresh``.

    >>> propose(5, {0: "a", 2: "c"}, {1: "b2", 2: "c2"}, 9).text()
    'members=0:a,1:b2,2:c;source=0;joins=9'
    >>> propose(5, {0: "a", 2: "c"}, {1: "b2"}, 9, catch_up=True, behind=[0]).text()
    'members=0:a,1:b2,2:c;source=2;joins=9;fresh=1'
    >>> propose(0, {}, {0: "a", 1: "b"}, 2).source
    0
    """
    members = dict(joiners)
    members.update(survivors)
    if not members:
        raise ValueError("propose needs at least one survivor or joiner")
    current = set(survivors) - set(behind)
    source = min(current or survivors or members)
    fresh = tuple(sorted(set(members) - set(survivors))) if catch_up and survivors else ()
    return Decision(epoch, tuple(sorted(members.items())), source, joins, fresh)


def no_state_left(alive: Iterable[int], behind: Iterable[int], epoch: int) -> str | None:
    """After deaths in ``epoch``: why none of the ``alive`` member replicas holds the job's
    state (each is a joiner still catching up, ``behind``), or None if one does.

    >>> no_state_left([1, 2], [1], 6) is None
    True
    >>> print(no_state_left([1], [1], 6))
    no live replica holds the job's state: every replica in step died while replicas [1] caught up from them in epoch 6; restart the job from a checkpoint
    """
    alive = sorted(set(alive))
    if not alive or set(alive) - set(behind):
        return None
    return (
        f"no live replica holds the job's state: every replica in step died while "
        f"replicas {alive} caught up from them in epoch {epoch}; restart the job from a "
        f"checkpoint"
    )


def complete_joiners(
    announced: Iterable[tuple[int, int, str | None]], local: int
) -> dict[int, str]:
    """Replicas whose ``local`` slots all announced the same token: replica -> token.

    >>> complete_joiners([(1, 0, "x"), (1, 1, "x"), (2, 0, "y"), (2, 1, None)], 2)
    {1: 'x'}
    """
    tokens: dict[int, set[str | None]] = {}
    counts: dict[int, int] = {}
    for replica, _, token in announced:
        tokens.setdefault(replica, set()).add(token)
        counts[replica] = counts.get(replica, 0) + 1
    return {
        r: next(iter(t))  # type: ignore[misc]  # one non-None token, checked just below
        for r, t in tokens.items()
        if len(t) == 1 and None not in t and counts[r] == local
    }


def never_announced(
    announced: Iterable[tuple[int, int, str | None]], replicas: int, local: int
) -> tuple[int, ...]:
    """The replicas of ``0..replicas-1`` that have not announced one incarnation from
    every one of their ``local`` slots (:func:`complete_joiners`' complement).

    >>> never_announced([(0, 0, "a"), (0, 1, "a"), (1, 0, "b"), (2, 1, None)], 3, 2)
    (1, 2)
    """
    complete = complete_joiners(announced, local)
    return tuple(r for r in range(replicas) if r not in complete)


@dataclass(frozen=True)
class JobShape:
    """A replicated job's shape: ``replicas`` replicas of ``local`` ranks each, as the
    ``replica`` whose slot first wrote it to the job's store was started.

    >>> shape = JobShape(3, 2, replica=1)
    >>> shape.text(), JobShape.parse(shape.text()) == shape
    ('replicas=3;local=2;replica=1', True)
    >>> JobShape(3, 2, replica=2).refusal(shape) is None
    True
    """

    replicas: int
    local: int
    replica: int = 0

    def text(self) -> str:
        """The store's form of the shape."""
        return f"replicas={self.replicas};local={self.local};replica={self.replica}"

    @staticmethod
    def parse(text: str) -> JobShape:
        """The shape from its store text (:meth:`text`)."""
        fields = dict(part.partition("=")[::2] for part in text.split(";"))
        return JobShape(int(fields["replicas"]), int(fields["local"]), int(fields["replica"]))

    def refusal(self, job: JobShape) -> str | None:
        """Why a replica started with this shape cannot be a replica of ``job`` (each
        value that differs, next to the job's), or None if the shapes agree.

        >>> print(JobShape(3, 4, replica=1).refusal(JobShape(2, 2, replica=0)))
        replicas=3 differs from the job's replicas=2, set by replica 0; local=4 (this replica's ranks) differs from the job's local=2
        """
        differ = []
        if self.replicas != job.replicas:
            differ.append(
                f"replicas={self.replicas} differs from the job's replicas={job.replicas}, "
                f"set by replica {job.replica}"
            )
        if self.local != job.local:
            by = "" if differ else f", set by replica {job.replica}"
            differ.append(
                f"local={self.local} (this replica's ranks) differs from the job's "
                f"local={job.local}{by}"
            )
        return "; ".join(differ) or None


class Joining:
    """A starting incarnation (``token``) of ``replica``, waiting for an epoch that admits
    it, in a job of ``replicas`` replicas of ``local`` slots: events in (what the job's
    store holds), a verdict out.

    Events: :meth:`announced` (a slot's announcement, or None), :meth:`decided` (an
    epoch's decision), :meth:`died` (an incarnation found dead: a slot of it refused
    a probe). Verdicts: :attr:`admitted`, :meth:`waiting_for` (what it waits for, by
    name), :attr:`no_live_replica` (every member of the newest epoch is dead: no
    replica holds the job's state, and none will admit it).

    >>> join = Joining(1, "b2", replicas=2, local=1)
    >>> join.announced(0, 0, "a"); join.announced(1, 0, "b2")
    >>> join.waiting_for(0)
    "replicas [] to announce themselves (the job's first epoch needs all 2; announced: [0, 1])"
    >>> join.died(0, "a")  # its announcement stays, but it is dead: it counts for nothing
    >>> join.waiting_for(0)
    "replicas [0] to announce themselves (the job's first epoch needs all 2; announced: [1])"
    >>> join.decided(Decision(3, ((0, "a2"), (1, "b")), 0, 2))
    >>> join.admitted is None, join.waiting_for(4)
    (True, 'an epoch that admits replica 1 (from epoch 4): the members of epoch 3, replicas [0, 1], admit a joiner at their next step')
    >>> join.died(0, "a2"); join.died(1, "b")
    >>> join.no_live_replica
    True
    """

    def __init__(self, replica: int, token: str, *, replicas: int, local: int) -> None:
        self.replica, self.token = replica, token
        self.replicas, self.local = replicas, local
        self._announced: dict[tuple[int, int], str | None] = {}
        self._dead: set[tuple[int, str]] = set()
        self.newest: Decision | None = None  # the newest decision seen

    # ------------------------------------------------------------------ events

    def announced(self, replica: int, coordinate: int, token: str | None) -> None:
        """Slot (``replica``, ``coordinate``) holds the announcement ``token`` (None: none)."""
        self._announced[(replica, coordinate)] = token

    def decided(self, decision: Decision) -> None:
        """Epoch ``decision.epoch`` was decided so (an older one than the newest is ignored)."""
        if self.newest is None or decision.epoch >= self.newest.epoch:
            self.newest = decision

    def died(self, replica: int, token: str) -> None:
        """Incarnation ``token`` of ``replica`` is dead (for good)."""
        self._dead.add((replica, token))

    # ------------------------------------------------------------------ verdicts

    @property
    def admitted(self) -> Decision | None:
        """The newest decision, if it holds this incarnation."""
        newest = self.newest
        return newest if newest is not None and newest.token(self.replica) == self.token else None

    @property
    def never_announced(self) -> tuple[int, ...]:
        """The replicas without a complete announcement (:func:`never_announced`) by an
        incarnation not known dead (a dead one's announcement stays in the store)."""
        slots = [
            (r, c, None if (r, t) in self._dead else t)
            for (r, c), t in self._announced.items()
            if t is not None
        ]
        return never_announced(slots, self.replicas, self.local)

    @property
    def live_members(self) -> tuple[int, ...]:
        """The newest epoch's member replicas whose incarnation is not known dead."""
        if self.newest is None:
            return ()
        return tuple(r for r, t in self.newest.members if (r, t) not in self._dead)

    @property
    def no_live_replica(self) -> bool:
        """Whether an epoch was decided and every member of the newest is dead."""
        return self.newest is not None and self.admitted is None and not self.live_members

    def waiting_for(self, epoch: int) -> str:
        """What this incarnation waits for while it looks at ``epoch``, naming the replicas."""
        if self.newest is None:
            missing = list(self.never_announced)
            announced = [r for r in range(self.replicas) if r not in missing]
            return (
                f"replicas {missing} to announce themselves (the job's first epoch needs "
                f"all {self.replicas}; announced: {announced})"
            )
        return (
            f"an epoch that admits replica {self.replica} (from epoch {epoch}): the members "
            f"of epoch {self.newest.epoch}, replicas {list(self.live_members)}, admit a "
            f"joiner at their next step"
        )

    def no_live_message(self) -> str:
        """The error once :attr:`no_live_replica`: what happened, and what to do."""
        newest = self.newest
        members = [] if newest is None else list(newest.replicas)
        epoch = None if newest is None else newest.epoch
        return (
            f"no live replica: every replica of the job's newest epoch ({epoch}, replicas "
            f"{members}) is dead, so none holds the job's state and none can admit replica "
            f"{self.replica}; restart the job from a checkpoint, with a fresh job store"
        )
