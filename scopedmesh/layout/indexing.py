"""Sub-layouts of a layout: ``sub`` through a coordinate and numpy-like indexing.

Stdlib only. Every sub-layout is a view of the same rank table, made in O(ndim).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TypeAlias, TypeVar

from scopedmesh.layout.ints import is_int
from scopedmesh.layout.strided import Axes, StridedLayout

__all__ = ["Index", "Indexing"]

Index: TypeAlias = int | slice
_L = TypeVar("_L", bound="Indexing")


class Indexing(StridedLayout):
    """The sub-layout methods of :class:`~scopedmesh.layout.mesh_layout.MeshLayout`."""

    __slots__ = ()

    def sub(self: _L, coord: Sequence[int], axes: Axes) -> _L:
        """The sub-layout over ``axes`` (in the order given) through ``coord``.

        >>> from scopedmesh import MeshLayout
        >>> MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).sub((1, 0, 0), ("pp", "tp")).ranks
        (4, 5, 6, 7)
        """
        base = self._check_coord(coord)
        chosen = self.axes_indices(axes)
        fixed = {a: base[a] for a in range(self.ndim) if a not in chosen}
        offset = self._offset + sum(self._strides[a] * c for a, c in fixed.items())
        names = None if self._names is None else tuple(self._names[a] for a in chosen)
        return self._view(
            tuple(self._shape[a] for a in chosen),
            names,
            tuple(self._strides[a] for a in chosen),
            offset,
        )

    def __getitem__(self: _L, key: object) -> _L:
        """Numpy-like indexing: an int drops its axis, a slice keeps it.

        A mapping indexes axes by name: ``layout[{"tp": 0}]``.

        >>> from scopedmesh import MeshLayout
        >>> layout = MeshLayout((2, 2, 2), names=("dp", "pp", "tp"))
        >>> layout[0].shape, layout[:, 1:].shape, layout[{"tp": 1}].ranks
        ((2, 2), (2, 1, 2), (1, 3, 5, 7))
        """
        per_axis = self._expand_key(key)
        shape, names, strides, offset = [], [], [], self._offset
        for a, index in enumerate(per_axis):
            n, s = self._shape[a], self._strides[a]
            if isinstance(index, slice):
                start, _, step = index.indices(n)
                length = len(range(*index.indices(n)))
                if length == 0:
                    raise IndexError(
                        f"slice {index} selects no position of axis {self.axis_name(a)!r}"
                    )
                offset += start * s
                shape.append(length)
                strides.append(s * step)
                if self._names is not None:
                    names.append(self._names[a])
            else:
                if not -n <= index < n:
                    raise IndexError(
                        f"index {index} is out of range for axis {self.axis_name(a)!r} of size {n}"
                    )
                offset += (index % n) * s
        return self._view(
            tuple(shape), tuple(names) if self._names is not None else None, tuple(strides), offset
        )

    def _expand_key(self, key: object) -> list[Index]:
        if isinstance(key, Mapping):
            per_axis: list[Index] = [slice(None)] * self.ndim
            seen: set[int] = set()
            for axis, index in key.items():
                a = self.axis_index(axis, argument="key")
                if a in seen:
                    raise ValueError(
                        f"key names axis {self.axis_name(a)!r} more than once: {key!r}"
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
                    raise TypeError(f"slice parts must be ints or None, got {index!r}")
            if index.step == 0:
                raise ValueError("slice step must not be zero")
            return index
        if is_int(index):
            return int(index)
        raise TypeError(
            f"layout indices must be ints, slices, '...' or a mapping of axis to index, got {index!r}"
        )

    def __iter__(self: _L) -> Iterator[_L]:
        raise TypeError("MeshLayout is not iterable; use .ranks or .groups(axes)")
