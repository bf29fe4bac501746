"""The survivors' layout: a mesh shrunk around lost ranks along one axis (standard library only).

When ranks die, the axis that may shrink (usually data parallel, ``dp``) drops
every slice that holds a lost rank; the other axes stay whole, the survivors
keep C order and the axis names.

>>> from scopedmesh.layout.mesh_layout import MeshLayout
>>> layout = MeshLayout((4, 2), names=("dp", "tp"))
>>> survivors = shrink(layout, lost=[5], axis="dp")
>>> survivors.shape, survivors.names, survivors.ranks
((3, 2), ('dp', 'tp'), (0, 1, 2, 3, 6, 7))
>>> lost_positions(layout, [5, 0], "dp")
(0, 2)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from scopedmesh.errors import shown
from scopedmesh.layout.mesh_layout import Axis, MeshLayout

__all__ = ["lost_positions", "shrink"]


def _lost_ranks(layout: MeshLayout, lost: object) -> tuple[int, ...]:
    if isinstance(lost, (str, bytes)) or not isinstance(lost, Iterable):
        raise TypeError(f"lost must be an iterable of global ranks, got {shown(lost)}")
    ranks = tuple(lost)
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"lost must hold int ranks, got {shown(rank)}")
        if rank not in layout:
            raise ValueError(f"lost rank {rank} is not in the mesh's ranks {list(layout.ranks)}")
    return ranks


def _check_layout(layout: object) -> MeshLayout:
    if not isinstance(layout, MeshLayout):
        raise TypeError(f"layout must be a MeshLayout, got {shown(layout)}")
    return layout


def lost_positions(layout: MeshLayout, lost: Iterable[int], axis: Axis) -> tuple[int, ...]:
    """The positions along ``axis`` whose slices hold a rank in ``lost``, ascending.

    >>> from scopedmesh.layout.mesh_layout import MeshLayout
    >>> lost_positions(MeshLayout((2, 2), names=("dp", "tp")), [3], "dp")
    (1,)
    """
    index = _check_layout(layout).axis_index(axis)
    return tuple(sorted({layout.unravel(rank)[index] for rank in _lost_ranks(layout, lost)}))


def shrink(layout: MeshLayout, lost: Iterable[int], axis: Axis) -> MeshLayout:
    """``layout`` without every slice along ``axis`` that holds a rank in ``lost``.

    The other axes keep their sizes; the surviving ranks keep their C order and
    the names stay. ``lost`` empty returns an equal layout. Raises ``ValueError``
    naming the numbers when a lost rank is not in the layout, or when every
    slice of ``axis`` holds a lost rank (nothing would survive).

    >>> from scopedmesh.layout.mesh_layout import MeshLayout
    >>> shrink(MeshLayout((2, 2, 2), names=("dp", "pp", "tp")), [2], "dp").ranks
    (4, 5, 6, 7)
    >>> shrink(MeshLayout((2, 2)), [0, 3], 0)
    Traceback (most recent call last):
    ...
    ValueError: axis 0 cannot absorb the loss of ranks [0, 3]: they lie in all 2 of its slices (positions [0, 1]), so no rank would survive; shrink another axis or restart
    """
    index = _check_layout(layout).axis_index(axis)
    ranks = _lost_ranks(layout, lost)
    dropped = set(lost_positions(layout, ranks, index))
    size = layout.shape[index]
    if len(dropped) == size:
        name = layout.axis_name(index) if layout.names else str(index)
        shown = repr(name) if layout.names else name
        raise ValueError(
            f"axis {shown} cannot absorb the loss of ranks {sorted(set(ranks))}: they lie in "
            f"all {size} of its slices (positions {sorted(dropped)}), so no rank would "
            "survive; shrink another axis or restart"
        )
    inner = math.prod(layout.shape[index + 1 :])
    kept = tuple(
        rank for flat, rank in enumerate(layout.ranks) if (flat // inner) % size not in dropped
    )
    shape = (*layout.shape[:index], size - len(dropped), *layout.shape[index + 1 :])
    return MeshLayout(shape, layout.names, kept)
