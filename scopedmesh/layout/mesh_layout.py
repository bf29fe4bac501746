"""MeshLayout: the pure rank algebra of an N-D mesh (standard library only).

A layout maps mesh coordinates to global ranks in C order (the last axis varies
fastest). It is a frozen strided view -- shape, strides, offset -- over a rank
table, so a sub-layout costs O(ndim) and one group's ranks cost O(group size).
This module is the value and its checks; the integer algebra beneath it is free
functions in :mod:`scopedmesh.layout.algebra`.

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

import itertools
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, TypeAlias

from scopedmesh.errors import AxisError, CoordinateError, shown
from scopedmesh.layout.algebra import c_strides, fixed_offset, position, slice_view, solve, span
from scopedmesh.layout.ints import as_range, infer_shape, int_sequence, is_int

__all__ = ["Axes", "Axis", "Index", "MeshLayout", "RavelMode", "as_range"]

Axis: TypeAlias = int | str
Axes: TypeAlias = Axis | Sequence[Axis]
Index: TypeAlias = int | slice
RavelMode: TypeAlias = Literal["raise", "wrap", "clip"]
_MODES = ("raise", "wrap", "clip")


class MeshLayout:
    """A frozen map from mesh coordinates to global ranks.

    ``shape`` may hold one ``-1``, inferred from ``ranks``. ``ranks`` (default
    ``range(prod(shape))``) lists the global ranks in C order of coordinates.
    A rank is ``table[offset + sum(coord[i] * strides[i])]`` (no table: the
    position itself).

    >>> MeshLayout((-1, 2), ranks=range(8, 16)).shape
    (4, 2)
    >>> MeshLayout((2, 2), ranks=[3, 1, 0, 2]).group((0, 0), 1)
    (1, 3)
    """

    __slots__ = ("_hash", "_inverse", "_names", "_offset", "_shape", "_strides", "_table")

    _shape: tuple[int, ...]
    _names: tuple[str, ...] | None
    _strides: tuple[int, ...]
    _offset: int
    _table: tuple[int, ...] | None
    _inverse: dict[int, int] | None
    _hash: int | None

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
            if ranks.stop - ranks.start > sys.maxsize * abs(ranks.step):  # len() refuses it
                raise ValueError(f"ranks must hold at most {sys.maxsize} ranks, got {shown(ranks)}")
            count, offset, step = len(ranks), ranks.start, ranks.step
            if count and min(ranks[0], ranks[-1]) < 0:
                raise ValueError(f"ranks must be non-negative, got {shown(ranks)}")
        else:
            table = int_sequence(ranks, "ranks")
            count, offset, step = len(table), 0, 1
            if any(r < 0 for r in table):
                raise ValueError(f"ranks must be non-negative, got {shown(list(table))}")
            if len(set(table)) != len(table):
                raise ValueError(f"ranks must be distinct, got {shown(list(table))}")
            if table == tuple(range(len(table))):
                table = None
        dims = infer_shape(shape, count)
        if math.prod(dims) > sys.maxsize:  # a range of them has no len()
            raise ValueError(f"shape {shown(dims)} holds more than {sys.maxsize} ranks")
        if count is not None and math.prod(dims) != count:
            raise ValueError(f"shape {dims} holds {math.prod(dims)} ranks but ranks has {count}")
        self._init(dims, self._check_names(names, len(dims)), c_strides(dims, step), offset, table)

    @staticmethod
    def _check_names(names: object, ndim: int) -> tuple[str, ...] | None:
        if names is None:
            return None
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise TypeError(f"names must be a sequence of strings, got {shown(names)}")
        result = tuple(names)
        if not all(isinstance(name, str) and name for name in result):
            raise TypeError(f"names must be non-empty strings, got {shown(result)}")
        if len(result) != ndim:
            raise ValueError(f"names has {len(result)} entries but the shape has {ndim} axes")
        if len(set(result)) != len(result):
            raise ValueError(f"names must be distinct, got {shown(result)}")
        return result

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
        self,
        shape: tuple[int, ...],
        names: tuple[str, ...] | None,
        strides: tuple[int, ...],
        offset: int,
    ) -> MeshLayout:
        """A layout over the same rank table: O(ndim), whatever the table's size."""
        view = object.__new__(MeshLayout)
        view._init(shape, names, strides, offset, self._table, self._inverse)
        return view

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"MeshLayout is immutable; cannot set {shown(name)}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"MeshLayout is immutable; cannot delete {shown(name)}")

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

        >>> MeshLayout((2, 3))[:, 1:].ranks
        (1, 2, 4, 5)
        """
        return tuple(self._rank_at(c) for c in itertools.product(*map(range, self._shape)))

    def __repr__(self) -> str:
        names = f", names={shown(self._names)}" if self._names is not None else ""
        default = self.size > 16 or self == MeshLayout(self._shape, self._names)
        ranks = "" if default else f", ranks={list(self.ranks)!r}"
        return f"MeshLayout({shown(self._shape)}{names}{ranks})"

    def __eq__(self, other: object) -> bool:
        """Equal shape, names and map from coordinates to ranks, however each was built."""
        if not isinstance(other, MeshLayout):
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
                raise AxisError(f"unknown {argument} {shown(axis)}; {known}")
            return self._names.index(axis)
        if not is_int(axis):
            raise TypeError(f"{argument} must be an int or an axis name, got {shown(axis)}")
        if not -self.ndim <= axis < self.ndim:
            raise AxisError(f"{argument} {axis} is out of range for a mesh with {self.ndim} axes")
        return axis % self.ndim

    def axes_indices(self, axes: Axes, *, argument: str = "axes") -> tuple[int, ...]:
        """Several axes as distinct indices, in the order given.

        >>> MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).axes_indices(("tp", 0))
        (2, 0)
        """
        items = self._axis_items(axes, argument)
        each = "axis" if argument == "axes" else argument
        result = tuple(self.axis_index(a, argument=each) for a in items)
        if len(set(result)) != len(result):
            raise ValueError(f"{argument} must be distinct, got {shown(axes)}")
        return result

    @staticmethod
    def _axis_items(axes: Axes, argument: str) -> tuple[Axis, ...]:
        if isinstance(axes, (str, int)) and not isinstance(axes, bool):
            return (axes,)
        if not isinstance(axes, Sequence) or not axes:
            raise TypeError(
                f"{argument} must be an axis or a non-empty sequence of axes, got {shown(axes)}"
            )
        return tuple(axes)

    def axis_name(self, axis: Axis) -> str:
        """The name of ``axis`` (its index as text when the layout has no names)."""
        index = self.axis_index(axis)
        return self._names[index] if self._names is not None else str(index)

    # ----------------------------------------------------------------- ranks

    def _rank_at(self, coord: Sequence[int]) -> int:
        at = position(coord, self._strides, self._offset)
        return at if self._table is None else self._table[at]

    def _check_coord(self, coord: object, argument: str = "coord") -> tuple[int, ...]:
        values = int_sequence(coord, argument)
        if len(values) != self.ndim:
            raise ValueError(
                f"{argument} must have {self.ndim} entries for shape {self._shape}, got {shown(values)}"
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

        >>> layout = MeshLayout((2, 3))
        >>> layout.ravel((1, 2)), layout.ravel((1, 4), mode="wrap"), layout.ravel((5, -1), mode="clip")
        (5, 4, 3)
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {shown(mode)}")
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

        >>> MeshLayout((2, 2, 2)).unravel(6)
        (1, 1, 0)
        """
        if not is_int(rank):
            raise TypeError(f"rank must be an int, got {shown(rank)}")
        at = self._position_of(rank)
        if at is not None:
            coord = solve(at - self._offset, self._shape, self._strides)
            if coord is not None:
                return coord
        raise CoordinateError(f"rank {rank} is not in {shown(self)}")

    def _position_of(self, rank: int) -> int | None:
        if self._table is None:
            return rank
        inverse = self._inverse
        if inverse is None:
            inverse = {r: i for i, r in enumerate(self._table)}
            object.__setattr__(self, "_inverse", inverse)
        return inverse.get(rank)

    def reshape(self, shape: Sequence[int], names: Sequence[str] | None = None) -> MeshLayout:
        """The same ranks in the same (C) order, laid out as ``shape`` (one ``-1`` allowed).

        A second factorization of one set of ranks, as a mixture-of-experts
        model lays its expert axes over its dense ones. O(ndim) when this
        layout's ranks are evenly spaced in C order, O(size) otherwise.

        >>> dense = MeshLayout((2, 2, 2), names=("dp", "pp", "tp"))
        >>> expert = dense.reshape((-1, 4), names=("edp", "ep"))
        >>> expert.shape, expert.groups("ep")
        ((2, 4), ((0, 1, 2, 3), (4, 5, 6, 7)))
        """
        dims = infer_shape(shape, self.size)
        if math.prod(dims) != self.size:
            raise ValueError(
                f"shape {dims} holds {math.prod(dims)} ranks but this layout has {self.size}"
            )
        checked = self._check_names(names, len(dims))
        moving = [s for n, s in zip(self._shape, self._strides) if n > 1]
        step = moving[-1] if moving else 1
        expected = c_strides(self._shape, step)
        if all(n == 1 or s == e for n, s, e in zip(self._shape, self._strides, expected)):
            return self._view(dims, checked, c_strides(dims, step), self._offset)
        return MeshLayout(dims, checked, self.ranks)

    # ------------------------------------------------------------ sub-layouts

    def sub(self, coord: Sequence[int], axes: Axes) -> MeshLayout:
        """The sub-layout over ``axes`` (in the order given) through ``coord``.

        >>> MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).sub((1, 0, 0), ("pp", "tp")).ranks
        (4, 5, 6, 7)
        """
        base = self._check_coord(coord)
        chosen = self.axes_indices(axes)
        offset = fixed_offset(base, self._strides, self._offset, chosen)
        names = None if self._names is None else tuple(self._names[a] for a in chosen)
        return self._view(
            tuple(self._shape[a] for a in chosen),
            names,
            tuple(self._strides[a] for a in chosen),
            offset,
        )

    def __getitem__(self, key: object) -> MeshLayout:
        """Numpy-like indexing: an int drops its axis, a slice keeps it.

        A mapping indexes axes by name: ``layout[{"tp": 0}]``.

        >>> layout = MeshLayout((2, 2, 2), names=("dp", "pp", "tp"))
        >>> layout[0].shape, layout[:, 1:].shape, layout[{"tp": 1}].ranks
        ((2, 2), (2, 1, 2), (1, 3, 5, 7))
        """
        per_axis = self._expand_key(key)
        for a, index in enumerate(per_axis):
            n = self._shape[a]
            if isinstance(index, slice):
                if not range(*index.indices(n)):
                    raise IndexError(
                        f"slice {index} selects no position of axis {self.axis_name(a)!r}"
                    )
            elif not -n <= index < n:
                raise IndexError(
                    f"index {index} is out of range for axis {self.axis_name(a)!r} of size {n}"
                )
            else:
                per_axis[a] = index % n
        shape, strides, offset, kept = slice_view(
            self._shape, self._strides, self._offset, per_axis
        )
        names = None if self._names is None else tuple(self._names[a] for a in kept)
        return self._view(shape, names, strides, offset)

    def _expand_key(self, key: object) -> list[Index]:
        if isinstance(key, Mapping):
            per_axis: list[Index] = [slice(None)] * self.ndim
            seen: set[int] = set()
            for axis, index in key.items():
                a = self.axis_index(axis, argument="key")
                if a in seen:
                    raise ValueError(
                        f"key names axis {self.axis_name(a)!r} more than once: {shown(key)}"
                    )
                seen.add(a)
                per_axis[a] = self._check_index(index)
            return per_axis
        items = key if isinstance(key, tuple) else (key,)
        if sum(item is Ellipsis for item in items) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if Ellipsis in items:
            at = items.index(Ellipsis)
            fill = (slice(None),) * (self.ndim - len(items) + 1)
            items = items[:at] + fill + items[at + 1 :]
        if len(items) > self.ndim:
            raise IndexError(f"too many indices: {len(items)} for a layout with {self.ndim} axes")
        checked = [self._check_index(item) for item in items]
        return checked + [slice(None)] * (self.ndim - len(checked))

    @staticmethod
    def _check_index(index: object) -> Index:
        if isinstance(index, slice):
            for part in (index.start, index.stop, index.step):
                if part is not None and not is_int(part):
                    raise TypeError(f"slice parts must be ints or None, got {shown(index)}")
            if index.step == 0:
                raise ValueError("slice step must not be zero")
            return index
        if is_int(index):
            return int(index)
        raise TypeError(
            f"layout indices must be ints, slices, '...' or a mapping of axis to index, got {shown(index)}"
        )

    def __iter__(self) -> Iterator[MeshLayout]:
        raise TypeError("MeshLayout is not iterable; use .ranks or .groups(axes)")

    # ----------------------------------------------------------------- groups

    def _indices(
        self, axes: Axes, indices: object
    ) -> tuple[tuple[int, ...], tuple[Sequence[int], ...]]:
        """Axes in mesh order, each with its positions (all of them by default)."""
        chosen = self.axes_indices(axes)
        if indices is None:
            per_axis: list[Sequence[int]] = [range(self._shape[a]) for a in chosen]
        else:
            several = not (isinstance(axes, (str, int)) and not isinstance(axes, bool))
            lists = indices if several else [indices]
            if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence):
                raise TypeError(f"indices must be a sequence, got {shown(indices)}")
            if len(lists) != len(chosen):
                raise ValueError(
                    f"indices must hold one sequence of positions per axis ({len(chosen)}), got {shown(indices)}"
                )
            per_axis = []
            for a, positions in zip(chosen, lists):
                values = int_sequence(positions, "indices")
                n = self._shape[a]
                if not values:
                    raise ValueError(f"indices for axis {self.axis_name(a)!r} must not be empty")
                for v in values:
                    if not -n <= v < n:
                        raise IndexError(
                            f"index {v} is out of range for axis {self.axis_name(a)!r} of size {n}"
                        )
                normalised = tuple(v % n for v in values)
                if len(set(normalised)) != len(normalised):
                    raise ValueError(
                        f"indices for axis {self.axis_name(a)!r} must be distinct, got {shown(values)}"
                    )
                per_axis.append(normalised)
        order = sorted(range(len(chosen)), key=lambda k: chosen[k])
        return tuple(chosen[k] for k in order), tuple(
            per_axis[k] if isinstance(per_axis[k], range) else sorted(per_axis[k]) for k in order
        )

    def group(self, coord: Sequence[int], axes: Axes, indices: object = None) -> tuple[int, ...]:
        """The ranks that share ``coord`` on every axis but ``axes``, ascending.

        ``indices`` keeps only those positions of the chosen axes (one sequence
        per axis when ``axes`` is a tuple); negative positions count from the end.

        >>> layout = MeshLayout((4, 2), names=("pp", "tp"))
        >>> layout.group((2, 1), "pp"), layout.group((2, 1), "pp", indices=[0, -1])
        ((1, 3, 5, 7), (1, 7))
        >>> layout.group((0, 0), ("pp", "tp"), indices=[[0, 1], [1]])
        (1, 3)
        """
        return tuple(self.compact_group(coord, axes, indices))

    def compact_group(
        self, coord: Sequence[int], axes: Axes, indices: object = None
    ) -> range | tuple[int, ...]:
        """The ranks of :meth:`group`, as a ``range`` whenever they are evenly spaced.

        A group of the default rank table that is evenly spaced costs O(ndim),
        whatever its size; other groups cost O(group size). Every evenly spaced
        group comes back as a ``range``, so the result is a canonical key.

        >>> layout = MeshLayout((4, 4, 4))
        >>> layout.compact_group((1, 2, 3), 0), layout.compact_group((1, 2, 3), (1, 2))
        (range(11, 75, 16), range(16, 32))
        >>> layout.compact_group((0, 0, 0), (0, 2))
        (0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51)
        """
        return self._members(coord, axes, indices, ascending=True)

    def ordered_group(
        self, coord: Sequence[int], axes: Axes, indices: object = None
    ) -> range | tuple[int, ...]:
        """The ranks of :meth:`group` in mesh order: C order of ``axes`` taken in mesh order.

        The order a group's members take when rank ``k`` of the group is the one
        at position ``k`` along the axes, as DTensor places shard ``k``. Equal to
        :meth:`compact_group` wherever the ranks ascend along the axes (always,
        with the default ranks); a ``range`` whenever evenly spaced and ascending.

        >>> layout = MeshLayout((2, 2), ranks=[3, 1, 2, 0])
        >>> layout.ordered_group((0, 0), 1), layout.compact_group((0, 0), 1)
        ((3, 1), range(1, 5, 2))
        """
        return self._members(coord, axes, indices, ascending=False)

    def _members(
        self, coord: Sequence[int], axes: Axes, indices: object, *, ascending: bool
    ) -> range | tuple[int, ...]:
        base = self._check_coord(coord)
        chosen, per_axis = self._indices(axes, indices)
        moving = [self._strides[a] for a in chosen if self._shape[a] > 1]
        if self._table is None and (ascending or _shrinking(moving)):
            # With positive strides that shrink from axis to axis, C order ascends.
            start = fixed_offset(base, self._strides, self._offset, chosen)
            progression = span(start, self._strides, chosen, per_axis)
            if progression is not None:
                return progression
        point = list(base)
        ranks = []
        for values in itertools.product(*per_axis):
            for a, v in zip(chosen, values):
                point[a] = v
            ranks.append(self._rank_at(point))
        if ascending:
            ranks.sort()
        return as_range(ranks) or tuple(ranks)

    def groups(self, axes: Axes, indices: object = None) -> tuple[tuple[int, ...], ...]:
        """Every group along ``axes``, in C order of the other axes.

        >>> MeshLayout((2, 2, 2)).groups((0, 2))
        ((0, 1, 4, 5), (2, 3, 6, 7))
        """
        chosen, _ = self._indices(axes, indices)
        others = [range(n) if a not in chosen else range(1) for a, n in enumerate(self._shape)]
        return tuple(self.group(coord, axes, indices) for coord in itertools.product(*others))

    def coords_along(
        self, coord: Sequence[int], axes: Axes, indices: object = None
    ) -> list[tuple[int, ...]]:
        """The coordinates of ``group(coord, axes, indices)``, in C order of ``axes``.

        >>> MeshLayout((2, 3)).coords_along((1, 0), 1, indices=[0, -1])
        [(1, 0), (1, 2)]
        """
        base = list(self._check_coord(coord))
        chosen, per_axis = self._indices(axes, indices)
        result = []
        for values in itertools.product(*per_axis):
            for a, v in zip(chosen, values):
                base[a] = v
            result.append(tuple(base))
        return result

    def __reduce__(self) -> tuple[object, ...]:
        # The default protocol restores slots through __setattr__ (which refuses),
        # and would carry a cached hash of strings into a process with another seed.
        return (_restore, (self._shape, self._names, self._strides, self._offset, self._table))


def _shrinking(strides: Sequence[int]) -> bool:
    """Whether ``strides`` are positive and strictly decreasing.

    >>> _shrinking([8, 2, 1]), _shrinking([1, 4]), _shrinking([-1])
    (True, False, False)
    """
    return all(s > 0 for s in strides) and all(a > b for a, b in itertools.pairwise(strides))


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
