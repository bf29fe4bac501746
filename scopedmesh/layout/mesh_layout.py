"""MeshLayout: the pure rank algebra of an N-D mesh (standard library only).

A layout maps mesh coordinates to global ranks in C order (the last axis varies
fastest). It is stored as a strided view -- shape, strides, offset -- over a rank
table, so a sub-layout costs O(ndim) and one group's ranks cost O(group size).
The value, its axes and ``ravel``/``unravel`` live in :mod:`scopedmesh.layout.strided`,
sub-layouts in :mod:`scopedmesh.layout.indexing`, groups in :mod:`scopedmesh.layout.families`;
this module puts them together behind the checked constructor.

>>> layout = MeshLayout((2, 2, 2), names=("dp", "pp", "tp"))
>>> layout.ravel((0, 1, 0))
2
>>> layout.unravel(5)
(1, 0, 1)
>>> layout.group((1, 0, 1), "tp")
(4, 5)
>>> layout.groups("dp")
((0, 4), (1, 5), (2, 6), (3, 7))
>>> layout[1, :, 0].ranks
(4, 6)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scopedmesh.layout.families import Families
from scopedmesh.layout.indexing import Index, Indexing
from scopedmesh.layout.ints import as_range, infer_shape, int_sequence
from scopedmesh.layout.strided import Axes, Axis, RavelMode, StridedLayout

__all__ = ["Axes", "Axis", "Index", "MeshLayout", "RavelMode", "as_range"]


class MeshLayout(Families, Indexing):
    """A frozen map from mesh coordinates to global ranks.

    ``shape`` may hold one ``-1``, inferred from ``ranks``. ``ranks`` (default
    ``range(prod(shape))``) lists the global ranks in C order of coordinates.

    >>> MeshLayout((-1, 2), ranks=range(8, 16)).shape
    (4, 2)
    >>> MeshLayout((2, 2), ranks=[3, 1, 0, 2]).group((0, 0), 1)
    (1, 3)
    """

    __slots__ = ()

    # The public methods, defined in the modules above, named here too so that the
    # class's own namespace lists its whole API (for help() and introspection).
    axis_index = StridedLayout.axis_index
    axes_indices = StridedLayout.axes_indices
    axis_name = StridedLayout.axis_name
    ravel = StridedLayout.ravel
    unravel = StridedLayout.unravel
    group = Families.group
    compact_group = Families.compact_group
    groups = Families.groups
    coords_along = Families.coords_along
    sub = Indexing.sub
    __getitem__ = Indexing.__getitem__

    def __init__(
        self,
        shape: Sequence[int],
        names: Sequence[str] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        table: tuple[int, ...] | None = None
        if ranks is None:
            count, offset, step = None, 0, 1
        elif isinstance(ranks, range):
            count, offset, step = len(ranks), ranks.start, ranks.step
            if count and min(ranks[0], ranks[-1]) < 0:
                raise ValueError(f"ranks must be non-negative, got {ranks!r}")
        else:
            table = int_sequence(ranks, "ranks")
            count, offset, step = len(table), 0, 1
            if any(r < 0 for r in table):
                raise ValueError(f"ranks must be non-negative, got {list(table)}")
            if len(set(table)) != len(table):
                raise ValueError(f"ranks must be distinct, got {list(table)}")
            if table == tuple(range(len(table))):
                table = None
        dims = infer_shape(shape, count)
        if count is not None and math.prod(dims) != count:
            raise ValueError(f"shape {dims} holds {math.prod(dims)} ranks but ranks has {count}")
        strides = [step] * len(dims)
        for i in range(len(dims) - 2, -1, -1):
            strides[i] = strides[i + 1] * dims[i + 1]
        self._init(dims, self._check_names(names, len(dims)), tuple(strides), offset, table)

    @staticmethod
    def _check_names(names: object, ndim: int) -> tuple[str, ...] | None:
        if names is None:
            return None
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise TypeError(f"names must be a sequence of strings, got {names!r}")
        result = tuple(names)
        if not all(isinstance(name, str) and name for name in result):
            raise TypeError(f"names must be non-empty strings, got {result!r}")
        if len(result) != ndim:
            raise ValueError(f"names has {len(result)} entries but the shape has {ndim} axes")
        if len(set(result)) != len(result):
            raise ValueError(f"names must be distinct, got {result!r}")
        return result

    def __reduce__(self) -> tuple[object, ...]:
        # The default protocol restores slots through __setattr__ (which refuses),
        # and would carry a cached hash of strings into a process with another seed.
        return (_restore, (self._shape, self._names, self._strides, self._offset, self._table))


def _restore(
    shape: tuple[int, ...],
    names: tuple[str, ...] | None,
    strides: tuple[int, ...],
    offset: int,
    table: tuple[int, ...] | None,
) -> MeshLayout:
    """Rebuild a pickled or copied layout (see ``MeshLayout.__reduce__``)."""
    layout = object.__new__(MeshLayout)
    layout._init(shape, names, strides, offset, table)
    return layout
