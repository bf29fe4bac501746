"""The integer algebra under :class:`~scopedmesh.layout.mesh_layout.MeshLayout`: free functions
over tuples (standard library only).

A layout is a strided view over positions: the rank at ``coord`` is
``table[offset + sum(coord[i] * strides[i])]`` (with no table, the position
itself). Everything here works on ``(shape, strides, offset)`` and costs O(ndim)
or O(group size), never O(world), as torch's ``_pycute`` does under its
``_MeshLayout``. Arguments are trusted: ``MeshLayout`` checks them first.

>>> c_strides((2, 3, 4))
(12, 4, 1)
>>> position((1, 2, 3), (12, 4, 1), 0)
23
>>> solve(23, (2, 3, 4), (12, 4, 1))
(1, 2, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

from scopedmesh.layout.ints import as_range

__all__ = ["c_strides", "fixed_offset", "position", "slice_view", "solve", "span"]


def c_strides(shape: Sequence[int], step: int = 1) -> tuple[int, ...]:
    """The strides of C order over ``shape`` (last axis fastest), ``step`` apart.

    >>> c_strides((2, 3)), c_strides((2, 3), step=4)
    ((3, 1), (12, 4))
    """
    strides = [step] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def position(coord: Sequence[int], strides: Sequence[int], offset: int) -> int:
    """The position of ``coord`` in the table: ``offset + sum(coord[i] * strides[i])``.

    >>> position((1, 1), (3, 1), 10)
    14
    """
    return offset + sum(c * s for c, s in zip(coord, strides))


def solve(distance: int, shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """The coordinate whose strides add up to ``distance`` from the origin, or None.

    Layouts nest their axes (each stride exceeds the extent of the smaller
    ones, reversed axes included), so a greedy division by decreasing strides
    finds the coordinate; the remainder checks it, nothing is assumed.

    >>> solve(5, (2, 3), (3, 1)), solve(6, (2, 3), (3, 1))
    ((1, 2), None)
    >>> solve(-1, (2, 3), (3, -1))  # the last axis reversed: it starts at 2
    (0, 1)
    """
    coord = [0] * len(shape)
    remaining = distance
    for i, s in enumerate(strides):
        if s < 0:  # walk a reversed axis from its far end
            remaining -= (shape[i] - 1) * s
    for i in sorted(range(len(shape)), key=lambda k: -abs(strides[k])):
        s = strides[i]
        if s == 0:
            continue
        step = min(max(remaining // abs(s), 0), shape[i] - 1)
        remaining -= step * abs(s)
        coord[i] = step if s > 0 else shape[i] - 1 - step
    if remaining != 0:
        return None
    return tuple(coord)


def fixed_offset(
    base: Sequence[int], strides: Sequence[int], offset: int, free: Sequence[int]
) -> int:
    """The offset of the sub-view through ``base`` that keeps the ``free`` axes.

    >>> fixed_offset((1, 0, 1), (4, 2, 1), 0, free=(1,))  # dp=1, tp=1: ranks 5 and 7
    5
    """
    return offset + sum(c * s for a, (c, s) in enumerate(zip(base, strides)) if a not in free)


def slice_view(
    shape: Sequence[int], strides: Sequence[int], offset: int, per_axis: Sequence[int | slice]
) -> tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]:
    """Numpy-like indexing of a view: ``(shape, strides, offset, kept axes)``.

    An int (in range, non-negative) drops its axis; a slice keeps it. Empty
    slices are the caller's to refuse.

    >>> slice_view((2, 4), (4, 1), 0, [1, slice(None, None, 2)])
    ((2,), (2,), 4, (1,))
    """
    new_shape, new_strides, kept = [], [], []
    for a, index in enumerate(per_axis):
        n, s = shape[a], strides[a]
        if isinstance(index, slice):
            chosen = range(*index.indices(n))
            offset += chosen.start * s
            new_shape.append(len(chosen))
            new_strides.append(s * chosen.step)
            kept.append(a)
        else:
            offset += index * s
    return tuple(new_shape), tuple(new_strides), offset, tuple(kept)


def span(
    start: int, strides: Sequence[int], chosen: Sequence[int], per_axis: Sequence[Sequence[int]]
) -> range | None:
    """The positions of a group as one ascending progression, or None if they are not one.

    ``start`` is the offset of the group's sub-view (see :func:`fixed_offset`);
    ``per_axis`` are the chosen positions of each axis in ``chosen``.

    >>> span(1, (4, 2, 1), (0, 1), (range(2), range(2)))  # tp=1: ranks 1, 3, 5, 7
    range(1, 9, 2)
    >>> span(0, (4, 2, 1), (0, 2), (range(2), range(2))) is None  # 0, 1, 4, 5
    True
    """
    runs = []  # (count, step) of each chosen axis, as positive steps
    for a, positions in zip(chosen, per_axis):
        spaced = as_range(positions)
        if spaced is None:
            return None
        step = strides[a] * spaced.step
        start += spaced.start * strides[a]
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
