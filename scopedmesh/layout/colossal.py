"""ColossalAI's static helpers of ``ProcessGroupMesh``: ravel, unravel, coordinates along axes.

Stdlib only; :class:`~scopedmesh.mesh.process_group_mesh.ProcessGroupMesh` exposes them as
static methods under the same names.

>>> ravel((0, 1, 0), (2, 2, 2)), unravel(5, (2, 2, 2))
(2, (1, 0, 1))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from scopedmesh.errors import shown
from scopedmesh.layout.ints import int_list
from scopedmesh.layout.mesh_layout import MeshLayout, RavelMode

__all__ = ["get_coords_along_axis", "ravel", "unravel"]


def ravel(coord: Sequence[int], shape: Sequence[int], mode: RavelMode = "raise") -> int:
    """The rank at ``coord`` in a default C-order mesh of ``shape``."""
    return MeshLayout(shape).ravel(coord, mode)


def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinate of ``rank`` in a default C-order mesh of ``shape``."""
    return MeshLayout(shape).unravel(rank)


def get_coords_along_axis(
    base_coord: Sequence[int], axis: int | Sequence[int], indices_at_axis: Sequence[Any]
) -> list[tuple[int, ...]]:
    """ColossalAI's helper: ``base_coord`` with ``axis`` set to each index, in C order.

    >>> get_coords_along_axis((0, 1, 0), 2, [0, 1])
    [(0, 1, 0), (0, 1, 1)]
    """
    coord = int_list(base_coord, "base_coord")
    if isinstance(axis, int) and not isinstance(axis, bool):
        axes, lists = [axis], [indices_at_axis]
    else:
        axes, lists = int_list(axis, "axis"), list(indices_at_axis)
    if len(lists) != len(axes):
        raise ValueError(
            f"indices_at_axis must hold one list of indices per axis ({len(axes)}), "
            f"got {shown(indices_at_axis)}"
        )
    for a in axes:
        if not -len(coord) <= a < len(coord):
            raise IndexError(f"axis {a} is out of range for base_coord {tuple(coord)}")
    result = []
    for values in itertools.product(*(int_list(ix, "indices_at_axis") for ix in lists)):
        for a, v in zip(axes, values):
            coord[a] = v
        result.append(tuple(coord))
    return result
