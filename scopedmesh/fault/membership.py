"""The membership of a replicated job: which incarnation of each replica is in an epoch.

Pure values, no torch: a :class:`Decision` is what the store holds for one
epoch (written once, by ``compare_set``), and :func:`propose` is the rule every
proposer applies, so that whichever proposal wins, it is one of the same kind.

>>> d = Decision(epoch=4, members=((0, "a"), (2, "c")), source=0, joins=7)
>>> Decision.parse(4, d.text())  == d
True
>>> d.text()
'members=0:a,2:c;source=0;joins=7'
>>> d.index(2), d.size, d.token(1) is None
(1, 2, True)
>>> Decision(5, ((0, "a"), (1, "b2")), 0, 8, fresh=(1,)).text()
'members=0:a,1:b2;source=0;joins=8;fresh=1'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Decision", "propose"]


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
