"""Group families of a layout: one group, the partition along axes, their coordinates.

Stdlib only: ``group``, ``compact_group``, ``groups`` and ``coords_along`` of
:class:`~scopedmesh.layout.mesh_layout.MeshLayout`, with ``indices`` subsets of the axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from scopedmesh.layout.ints import as_range, int_sequence
from scopedmesh.layout.strided import Axes, StridedLayout

__all__ = ["Families"]


class Families(StridedLayout):
    """The group methods of :class:`~scopedmesh.layout.mesh_layout.MeshLayout`."""

    __slots__ = ()

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
                raise TypeError(f"indices must be a sequence, got {indices!r}")
            if len(lists) != len(chosen):
                raise ValueError(
                    f"indices must hold one sequence of positions per axis ({len(chosen)}), got {indices!r}"
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
                        f"indices for axis {self.axis_name(a)!r} must be distinct, got {values}"
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

        >>> from scopedmesh import MeshLayout
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

        >>> from scopedmesh import MeshLayout
        >>> layout = MeshLayout((4, 4, 4))
        >>> layout.compact_group((1, 2, 3), 0), layout.compact_group((1, 2, 3), (1, 2))
        (range(11, 75, 16), range(16, 32))
        >>> layout.compact_group((0, 0, 0), (0, 2))
        (0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51)
        """
        base = self._check_coord(coord)
        chosen, per_axis = self._indices(axes, indices)
        if self._table is None:
            span = self._span(base, chosen, per_axis)
            if span is not None:
                return span
        point = list(base)
        ranks = []
        for values in itertools.product(*per_axis):
            for a, v in zip(chosen, values):
                point[a] = v
            ranks.append(self._rank_at(point))
        ranks.sort()
        return as_range(ranks) or tuple(ranks)

    def _span(
        self, base: tuple[int, ...], chosen: tuple[int, ...], per_axis: tuple[Sequence[int], ...]
    ) -> range | None:
        """The group as one arithmetic progression of ranks, or None if it is not one."""
        start = self._offset + sum(
            c * s for a, (c, s) in enumerate(zip(base, self._strides)) if a not in chosen
        )
        runs = []  # (count, step) of each chosen axis, as positive steps
        for a, positions in zip(chosen, per_axis):
            spaced = as_range(positions)
            if spaced is None:
                return None
            step = self._strides[a] * spaced.step
            start += spaced.start * self._strides[a]
            if step < 0:
                start += (len(spaced) - 1) * step
                step = -step
            if len(spaced) > 1:
                runs.append((len(spaced), step))
        runs.sort(key=lambda run: run[1])
        count, step = 1, 1
        for i, (n, s) in enumerate(runs):
            if i == 0:
                count, step = n, s
            elif s == count * step:
                count *= n
            else:
                return None
        return range(start, start + count * step, step)

    def groups(self, axes: Axes, indices: object = None) -> tuple[tuple[int, ...], ...]:
        """Every group along ``axes``, in C order of the other axes.

        >>> from scopedmesh import MeshLayout
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

        >>> from scopedmesh import MeshLayout
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
