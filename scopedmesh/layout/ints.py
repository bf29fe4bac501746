"""Integer argument checks and progressions shared by the layout modules (stdlib only).

>>> int_sequence([2, 4], "shape"), infer_shape((-1, 2), 8), as_range([3, 5, 7])
((2, 4), (4, 2), range(3, 9, 2))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard

from scopedmesh.errors import shown

__all__ = ["as_range", "infer_shape", "int_list", "int_sequence", "is_int"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_sequence(value: object, argument: str) -> tuple[int, ...]:
    """``value`` as a tuple of plain ints, or a TypeError naming ``argument``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{argument} must be a sequence of ints, got {shown(value)}")
    items = tuple(value)
    for item in items:
        if not is_int(item):
            raise TypeError(
                f"{argument} must contain only ints, got {shown(item)} in {shown(value)}"
            )
    return tuple(int(item) for item in items)


def int_list(value: object, argument: str) -> list[int]:
    """``value`` as a list of ints, or a TypeError naming ``argument``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{argument} must be a sequence of ints, got {shown(value)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{argument} must contain only ints, got {shown(value)}")
    return list(value)


def infer_shape(shape: object, count: int | None) -> tuple[int, ...]:
    """Validate ``shape`` and fill in its one ``-1`` from ``count`` ranks."""
    dims = int_sequence(shape, "shape")
    unknown = [i for i, n in enumerate(dims) if n == -1]
    bad = [n for n in dims if n < 1 and n != -1]
    if bad or len(unknown) > 1:
        raise ValueError(f"shape must hold positive ints and at most one -1, got {shown(dims)}")
    if not unknown:
        return dims
    if count is None:
        raise ValueError(f"shape {dims} has a -1 but there are no ranks to infer it from")
    known = math.prod(n for n in dims if n != -1)
    if count == 0:
        raise ValueError(f"cannot infer the -1 in shape {dims} from an empty ranks")
    if count % known:
        raise ValueError(
            f"cannot infer the -1 in shape {dims}: {count} ranks is not a multiple of {known}"
        )
    return tuple(count // known if n == -1 else n for n in dims)


def as_range(values: Sequence[int]) -> range | None:
    """``values`` as an equal ``range`` if they ascend evenly, else None.

    >>> as_range([3, 5, 7]), as_range([4]), as_range([1, 2, 4])
    (range(3, 9, 2), range(4, 5), None)
    """
    if isinstance(values, range) and values.step > 0:
        return values
    if not values:
        return None
    first = values[0]
    if len(values) == 1:
        return range(first, first + 1)
    step = values[1] - first
    if step <= 0:
        return None
    for i, value in enumerate(values):
        if value != first + i * step:
            return None
    return range(first, first + len(values) * step, step)
