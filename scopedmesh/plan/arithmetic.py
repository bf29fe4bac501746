"""The group arithmetic behind ``scopedmesh plan``: members, spans and node residues of groups.

Pure integer facts about a layout with the default ranks (stdlib only), never
O(world): a group's ranks, the nodes it spans at ``nproc`` ranks per node, and
how many groups start at each rank modulo ``nproc``.

>>> from scopedmesh.layout.mesh_layout import MeshLayout
>>> layout = MeshLayout((2, 4, 8))
>>> group_coord(layout, (1,), 3), nth(layout, (0, 0, 5), (1,), 2), spans(layout, (0, 0, 5), (1,), 8, [0])
((0, 0, 3), 21, [4])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scopedmesh.layout.mesh_layout import MeshLayout

__all__ = ["BUDGET", "group_coord", "members", "nested", "nth", "residues", "spans"]

BUDGET = 1 << 18  # most (shift, rank) pairs visited to count the nodes of uneven groups

# With the default ranks, a group's C order over its axes is ascending order.


def group_coord(layout: MeshLayout, axes: Sequence[int], index: int) -> tuple[int, ...]:
    """A coordinate of the ``index``-th group along ``axes`` (C order of the other axes)."""
    others = [a for a in range(layout.ndim) if a not in axes]
    coord = [0] * layout.ndim
    for a, c in zip(others, MeshLayout(tuple(layout.shape[a] for a in others)).unravel(index)):
        coord[a] = c
    return tuple(coord)


def nth(layout: MeshLayout, coord: Sequence[int], axes: Sequence[int], index: int) -> int:
    """The ``index``-th smallest rank of the group through ``coord``, in O(ndim)."""
    sub = layout.sub(coord, axes)
    return sub.ravel(MeshLayout(sub.shape).unravel(index))


def members(layout: MeshLayout, coord: Sequence[int], axes: Sequence[int]) -> Sequence[int]:
    """The ranks of the group along ``axes`` through ``coord``, ascending.

    An evenly spaced group is ``compact_group``'s ``range``, in O(ndim). Another is
    summed from its axes' progressions in O(size), several times faster than
    ``compact_group`` walking its coordinates.

    >>> layout = MeshLayout((2, 3, 4))
    >>> members(layout, (1, 2, 3), (0, 1)), members(layout, (0, 0, 0), (0, 2))
    (range(3, 27, 4), [0, 1, 2, 3, 12, 13, 14, 15])
    """
    sub = layout.sub(coord, axes)
    if _spaced(sub):
        return layout.compact_group(coord, axes)
    origin = (0,) * sub.ndim
    ranks = [sub.ravel(origin)]
    for i in range(sub.ndim):  # outermost axis first, so the sums come out ascending
        along = _progression(sub, origin, i)
        ranks = [r + s - along.start for r in ranks for s in along]
    return ranks


def _spaced(group: MeshLayout) -> bool:
    """Whether a group's sub-layout holds evenly spaced ranks, in O(ndim).

    Layouts compare by value in O(ndim): ``group`` against the evenly spaced
    layout through its two smallest ranks.
    """
    first = group.ravel((0,) * group.ndim)
    step = group.ravel(MeshLayout(group.shape).unravel(1)) - first if group.size > 1 else 1
    even = range(first, first + group.size * step, step)
    return group == MeshLayout(group.shape, names=group.names, ranks=even)


def _progression(layout: MeshLayout, coord: Sequence[int], axis: int) -> range:
    """The ranks along one axis through ``coord``, always evenly spaced."""
    group = layout.compact_group(coord, axis)
    assert isinstance(group, range)
    return group


def spans(
    layout: MeshLayout, coord: Sequence[int], axes: Sequence[int], nproc: int, shifts: list[int]
) -> list[int] | None:
    """How many nodes hold the group through ``coord``, its ranks shifted by each of ``shifts``.

    O(1) a shift when evenly spaced; None when an uneven group would cost over BUDGET.
    """
    size = math.prod(layout.shape[a] for a in axes)
    if size * len(shifts) > BUDGET and not _spaced(layout.sub(coord, axes)):
        return None
    group = members(layout, coord, axes)
    if not isinstance(group, range):
        return [len({(r + shift) // nproc for r in group}) for shift in shifts]
    if len(group) == 1 or group.step >= nproc:  # a node or more between neighbours
        return [len(group)] * len(shifts)
    return [(group[-1] + s) // nproc - (group[0] + s) // nproc + 1 for s in shifts]  # none skipped


def residues(layout: MeshLayout, axes: Sequence[int], nproc: int) -> dict[int, int]:
    """How many groups along ``axes`` start at each rank modulo ``nproc``.

    A start (0 on ``axes``) sums one rank of each other axis's progression. Costs
    O(min(nproc, count) * min(nproc, size)) per other axis, never O(world).
    """
    origin = (0,) * layout.ndim
    counts = {0: 1}
    for a in (a for a in range(layout.ndim) if a not in axes):
        along = _progression(layout, origin, a)
        period = nproc // math.gcd(along.step, nproc)  # positions p and p + period share a residue
        steps = {along[c] % nproc: len(along[c::period]) for c in range(min(len(along), period))}
        merged: dict[int, int] = {}
        for r, m in counts.items():
            for d, k in steps.items():
                merged[(r + d) % nproc] = merged.get((r + d) % nproc, 0) + m * k
        counts = merged
    return counts


def nested(ranks: Sequence[int], shape: Sequence[int]) -> object:
    """``ranks`` (C order) as nested lists of ``shape``, for JSON.

    >>> nested(range(6), (2, 3))
    [[0, 1, 2], [3, 4, 5]]
    """
    if len(shape) == 1:
        return list(ranks)
    step = len(ranks) // shape[0]
    return [nested(ranks[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
