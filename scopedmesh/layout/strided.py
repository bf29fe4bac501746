"""The MeshLayout value: a frozen strided view over a rank table, its axes, ravel and unravel.

Stdlib only. :class:`StridedLayout` holds shape, names, strides, offset and the
rank table; :mod:`scopedmesh.layout.indexing` and :mod:`scopedmesh.layout.families` add
sub-layouts and groups, and :class:`scopedmesh.layout.mesh_layout.MeshLayout` adds the
checked constructor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal, TypeAlias, TypeVar

from scopedmesh.errors import AxisError, CoordinateError
from scopedmesh.layout.ints import int_sequence, is_int

__all__ = ["Axes", "Axis", "RavelMode", "StridedLayout"]

Axis: TypeAlias = int | str
Axes: TypeAlias = Axis | Sequence[Axis]
RavelMode: TypeAlias = Literal["raise", "wrap", "clip"]
_MODES = ("raise", "wrap", "clip")
_L = TypeVar("_L", bound="StridedLayout")


class StridedLayout:
    """Shape, names and the strided map to ranks; build one with ``MeshLayout(...)``.

    A rank is ``table[offset + sum(coord[i] * strides[i])]`` (no table: the
    position itself).
    """

    __slots__ = ("_hash", "_inverse", "_names", "_offset", "_shape", "_strides", "_table")

    _shape: tuple[int, ...]
    _names: tuple[str, ...] | None
    _strides: tuple[int, ...]
    _offset: int
    _table: tuple[int, ...] | None
    _inverse: dict[int, int] | None
    _hash: int | None

    def _init(
        self,
        shape: tuple[int, ...],
        names: tuple[str, ...] | None,
        strides: tuple[int, ...],
        offset: int,
        table: tuple[int, ...] | None,
        inverse: dict[int, int] | None = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "_shape", shape)
        set_(self, "_names", names)
        # An axis of size 1 contributes nothing: a zero stride makes equal maps equal values.
        set_(self, "_strides", tuple(0 if n == 1 else s for n, s in zip(shape, strides)))
        set_(self, "_offset", offset)
        set_(self, "_table", table)
        set_(self, "_inverse", inverse)
        set_(self, "_hash", None)

    def _view(
        self: _L,
        shape: tuple[int, ...],
        names: tuple[str, ...] | None,
        strides: tuple[int, ...],
        offset: int,
    ) -> _L:
        view = object.__new__(self.__class__)
        view._init(shape, names, strides, offset, self._table, self._inverse)
        return view

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"MeshLayout is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"MeshLayout is immutable; cannot delete {name!r}")

    # ---------------------------------------------------------------- basics

    @property
    def shape(self) -> tuple[int, ...]:
        """The size of each axis."""
        return self._shape

    @property
    def names(self) -> tuple[str, ...] | None:
        """The axis names, or ``None``."""
        return self._names

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of ranks in the layout."""
        return math.prod(self._shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, in C order of coordinates (costs O(size)).

        >>> from scopedmesh import MeshLayout
        >>> MeshLayout((2, 3))[:, 1:].ranks
        (1, 2, 4, 5)
        """
        return tuple(self._rank_at(c) for c in itertools.product(*map(range, self._shape)))

    def __repr__(self) -> str:
        names = f", names={self._names!r}" if self._names is not None else ""
        default = self.size > 16 or self == type(self)(self._shape, self._names)  # type: ignore[call-arg]
        ranks = "" if default else f", ranks={list(self.ranks)!r}"
        return f"MeshLayout({self._shape!r}{names}{ranks})"

    def __eq__(self, other: object) -> bool:
        """Equal shape, names and map from coordinates to ranks, however each was built."""
        if not isinstance(other, StridedLayout):
            return NotImplemented
        if self is other:
            return True
        if self._shape != other._shape or self._names != other._names:
            return False
        view = (self._strides, self._offset)
        if self._table is None and other._table is None:
            # offset + strides is the only spelling of a strided map (size-1 axes have stride 0).
            return view == (other._strides, other._offset)
        if self._table is other._table and view == (other._strides, other._offset):
            return True
        return self.ranks == other.ranks  # O(size of this view), never O(table)

    def __hash__(self) -> int:
        value = self._hash
        if value is None:
            # O(ndim) and spelling-independent: the ranks at the origin and one step along each axis.
            corner = [0] * self.ndim
            probes = [self._rank_at(corner)]
            for a, n in enumerate(self._shape):
                if n > 1:
                    corner[a] = 1
                    probes.append(self._rank_at(corner))
                    corner[a] = 0
            value = hash((self._shape, self._names, tuple(probes)))
            object.__setattr__(self, "_hash", value)
        return value

    def __contains__(self, rank: object) -> bool:
        if not is_int(rank):
            return False
        try:
            self.unravel(rank)
        except ValueError:
            return False
        return True

    # ------------------------------------------------------------------ axes

    def axis_index(self, axis: Axis, *, argument: str = "axis") -> int:
        """The non-negative index of ``axis``, given as an index or a name.

        >>> from scopedmesh import MeshLayout
        >>> MeshLayout((2, 4), names=("dp", "tp")).axis_index("tp")
        1
        """
        if isinstance(axis, str):
            if self._names is None or axis not in self._names:
                known = (
                    f"this mesh's axes are {self._names}"
                    if self._names
                    else "this mesh has no axis names"
                )
                raise AxisError(f"unknown {argument} {axis!r}; {known}")
            return self._names.index(axis)
        if not is_int(axis):
            raise TypeError(f"{argument} must be an int or an axis name, got {axis!r}")
        if not -self.ndim <= axis < self.ndim:
            raise AxisError(f"{argument} {axis} is out of range for a mesh with {self.ndim} axes")
        return axis % self.ndim

    def axes_indices(self, axes: Axes, *, argument: str = "axes") -> tuple[int, ...]:
        """Several axes as distinct indices, in the order given.

        >>> from scopedmesh import MeshLayout
        >>> MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).axes_indices(("tp", 0))
        (2, 0)
        """
        items = self._axis_items(axes, argument)
        each = "axis" if argument == "axes" else argument
        result = tuple(self.axis_index(a, argument=each) for a in items)
        if len(set(result)) != len(result):
            raise ValueError(f"{argument} must be distinct, got {axes!r}")
        return result

    @staticmethod
    def _axis_items(axes: Axes, argument: str) -> tuple[Axis, ...]:
        if isinstance(axes, (str, int)) and not isinstance(axes, bool):
            return (axes,)
        if not isinstance(axes, Sequence) or not axes:
            raise TypeError(
                f"{argument} must be an axis or a non-empty sequence of axes, got {axes!r}"
            )
        return tuple(axes)

    def axis_name(self, axis: Axis) -> str:
        """The name of ``axis`` (its index as text when the layout has no names)."""
        index = self.axis_index(axis)
        return self._names[index] if self._names is not None else str(index)

    # ----------------------------------------------------------------- ranks

    def _rank_at(self, coord: Sequence[int]) -> int:
        position = self._offset + sum(c * s for c, s in zip(coord, self._strides))
        return position if self._table is None else self._table[position]

    def _check_coord(self, coord: object, argument: str = "coord") -> tuple[int, ...]:
        values = int_sequence(coord, argument)
        if len(values) != self.ndim:
            raise ValueError(
                f"{argument} must have {self.ndim} entries for shape {self._shape}, got {values}"
            )
        for c, n in zip(values, self._shape):
            if not 0 <= c < n:
                raise CoordinateError(
                    f"{argument} {values} is out of bounds for shape {self._shape}"
                )
        return values

    def ravel(self, coord: Sequence[int], mode: RavelMode = "raise") -> int:
        """The global rank at ``coord``; ``mode`` treats out-of-range entries like numpy.

        In mode ``"raise"`` an entry out of bounds is a :class:`CoordinateError`
        (a ``ValueError``, as in numpy, and an ``IndexError``).

        >>> from scopedmesh import MeshLayout
        >>> layout = MeshLayout((2, 3))
        >>> layout.ravel((1, 2)), layout.ravel((1, 4), mode="wrap"), layout.ravel((5, -1), mode="clip")
        (5, 4, 3)
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        values = int_sequence(coord, "coord")
        if len(values) != self.ndim:
            self._check_coord(values)  # raises; zip() below would silently truncate
        if mode == "wrap":
            values = tuple(c % n for c, n in zip(values, self._shape))
        elif mode == "clip":
            values = tuple(min(max(c, 0), n - 1) for c, n in zip(values, self._shape))
        return self._rank_at(self._check_coord(values))

    def unravel(self, rank: int) -> tuple[int, ...]:
        """The coordinate of global ``rank``; a :class:`CoordinateError` if the layout lacks it.

        >>> from scopedmesh import MeshLayout
        >>> MeshLayout((2, 2, 2)).unravel(6)
        (1, 1, 0)
        """
        if not is_int(rank):
            raise TypeError(f"rank must be an int, got {rank!r}")
        position = self._position_of(rank)
        if position is not None:
            coord = self._solve(position - self._offset)
            if coord is not None:
                return coord
        raise CoordinateError(f"rank {rank} is not in {self!r}")

    def _position_of(self, rank: int) -> int | None:
        if self._table is None:
            return rank
        inverse = self._inverse
        if inverse is None:
            inverse = {r: i for i, r in enumerate(self._table)}
            object.__setattr__(self, "_inverse", inverse)
        return inverse.get(rank)

    def _solve(self, distance: int) -> tuple[int, ...] | None:
        """The coordinate whose strides add up to ``distance``, or None.

        Views made by this class nest their axes (each stride exceeds the extent
        of the smaller ones), so a greedy division by decreasing strides finds
        the coordinate; the result is checked, never assumed.
        """
        coord = [0] * self.ndim
        remaining = distance
        for i, s in enumerate(self._strides):
            if s < 0:  # walk a reversed axis from its far end
                remaining -= (self._shape[i] - 1) * s
        for i in sorted(range(self.ndim), key=lambda k: -abs(self._strides[k])):
            s = self._strides[i]
            if s == 0:
                continue
            step = min(max(remaining // abs(s), 0), self._shape[i] - 1)
            remaining -= step * abs(s)
            coord[i] = step if s > 0 else self._shape[i] - 1 - step
        if remaining != 0:
            return None
        return tuple(coord)
