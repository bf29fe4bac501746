"""Hypothesis strategies for mesh layouts: shapes, names, rank tables, coordinates, axes.

Needs the optional ``hypothesis`` dependency (``pip install scopedmesh[testing]``);
this is the only module of scopedmesh that imports it. Every strategy draws
valid input for :class:`~scopedmesh.layout.MeshLayout`, so a test can state a law
and let hypothesis look for the layout that breaks it:

>>> from hypothesis import given, settings
>>> @settings(max_examples=10, deadline=None, database=None)
... @given(layouts(max_axes=3, max_world=32))
... def check_origin(layout):
...     assert layout.unravel(layout.ravel((0,) * layout.ndim)) == (0,) * layout.ndim
>>> check_origin()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from hypothesis import strategies as st
from hypothesis.strategies import DrawFn, SearchStrategy

from scopedmesh.errors import shown
from scopedmesh.layout import Axes, Axis, MeshLayout

__all__ = [
    "axes",
    "coordinates",
    "indices_for",
    "keys_for",
    "layouts",
    "names_for",
    "rank_tables",
    "shapes",
]

# Names that read like the usual parallelism axes; drawn alongside generated ones.
_COMMON_NAMES = ("dp", "pp", "tp", "cp", "ep", "fsdp", "replicate", "shard")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Identifier-like: a letter, then up to 7 letters, digits or '_'. Built from text()
# rather than from_regex(), whose first use costs seconds and trips health checks.
_NAME = st.one_of(
    st.sampled_from(_COMMON_NAMES),
    st.builds(
        str.__add__,
        st.sampled_from(_LETTERS),
        st.text(alphabet=_LETTERS + "0123456789_", max_size=7),
    ),
)


def _check_count(value: object, argument: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{argument} must be an int, got {shown(value)}")
    if value < minimum:
        raise ValueError(f"{argument} must be at least {minimum}, got {value}")
    return value


def _check_layout(layout: object) -> MeshLayout:
    if not isinstance(layout, MeshLayout):
        raise TypeError(f"layout must be a MeshLayout, got {shown(layout)}")
    return layout


def _small_then_any(limit: int) -> SearchStrategy[int]:
    """Integers in [1, limit], favouring the small sizes where meshes get interesting."""
    return st.one_of(st.integers(1, min(4, limit)), st.integers(1, limit))


@st.composite
def _shapes(draw: DrawFn, min_axes: int, max_axes: int, max_world: int) -> tuple[int, ...]:
    ndim = draw(st.integers(min_axes, max_axes))
    dims: list[int] = []
    room = max_world
    for _ in range(ndim):
        size = draw(_small_then_any(room))
        dims.append(size)
        room //= size
    # The first axes drawn get the most room; a permutation spreads the large ones out.
    return tuple(draw(st.permutations(dims)))


def shapes(
    *, min_axes: int = 1, max_axes: int = 5, max_world: int = 256
) -> SearchStrategy[tuple[int, ...]]:
    """Tuples of ``min_axes``..``max_axes`` positive ints whose product is at most ``max_world``.

    >>> isinstance(shapes(max_axes=3, max_world=64), SearchStrategy)
    True
    """
    _check_count(min_axes, "min_axes", 0)
    _check_count(max_axes, "max_axes", min_axes)
    _check_count(max_world, "max_world", 1)
    return _shapes(min_axes, max_axes, max_world)


def names_for(ndim: int) -> SearchStrategy[tuple[str, ...]]:
    """``ndim`` distinct, non-empty, identifier-like axis names.

    >>> isinstance(names_for(3), SearchStrategy)
    True
    """
    _check_count(ndim, "ndim", 0)
    return st.lists(_NAME, min_size=ndim, max_size=ndim, unique=True).map(tuple)


@st.composite
def _rank_tables(draw: DrawFn, size: int) -> Sequence[int]:
    kind = draw(st.sampled_from(("permutation", "subset", "range", "reversed range")))
    if kind == "permutation":
        start = draw(st.integers(0, 64))
        return tuple(draw(st.permutations(range(start, start + size))))
    if kind == "subset":
        pool = size + draw(st.integers(0, 2 * size + 8))
        return tuple(draw(st.permutations(range(pool)))[:size])
    step = draw(st.integers(1, 4))
    start = draw(st.integers(0, 64))
    if kind == "range":
        return range(start, start + step * size, step)
    first = start + step * (size - 1)
    return range(first, first - step * size, -step)


def rank_tables(size: int) -> SearchStrategy[Sequence[int]]:
    """``size`` distinct non-negative ranks: a permutation, a subset of a larger range, or a ``range``.

    >>> isinstance(rank_tables(8), SearchStrategy)
    True
    """
    return _rank_tables(_check_count(size, "size", 1))


@st.composite
def _layouts(
    draw: DrawFn,
    min_axes: int,
    max_axes: int,
    max_world: int,
    with_names: bool | None,
    with_ranks: bool | None,
) -> MeshLayout:
    shape = draw(shapes(min_axes=min_axes, max_axes=max_axes, max_world=max_world))
    named = draw(st.booleans()) if with_names is None else with_names
    custom = draw(st.booleans()) if with_ranks is None else with_ranks
    names = draw(names_for(len(shape))) if named else None
    ranks = draw(rank_tables(math.prod(shape))) if custom else None
    return MeshLayout(shape, names=names, ranks=ranks)


def layouts(
    *,
    min_axes: int = 1,
    max_axes: int = 5,
    max_world: int = 256,
    with_names: bool | None = None,
    with_ranks: bool | None = None,
) -> SearchStrategy[MeshLayout]:
    """Layouts, with names and a custom ``ranks`` table when asked (``None``: either way).

    >>> isinstance(layouts(max_axes=3, with_names=True, with_ranks=False), SearchStrategy)
    True
    """
    _check_count(min_axes, "min_axes", 0)
    _check_count(max_axes, "max_axes", min_axes)
    _check_count(max_world, "max_world", 1)
    for value, argument in ((with_names, "with_names"), (with_ranks, "with_ranks")):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{argument} must be True, False or None, got {shown(value)}")
    return _layouts(min_axes, max_axes, max_world, with_names, with_ranks)


def coordinates(layout: MeshLayout) -> SearchStrategy[tuple[int, ...]]:
    """Coordinates inside ``layout``: one position per axis, each within its size.

    >>> isinstance(coordinates(MeshLayout((2, 3))), SearchStrategy)
    True
    """
    parts = [st.integers(0, n - 1) for n in _check_layout(layout).shape]
    return cast("SearchStrategy[tuple[int, ...]]", st.tuples(*parts))


def _spellings(layout: MeshLayout, index: int) -> list[Axis]:
    """The ways to name axis ``index``: its index, its negative index, its name."""
    forms: list[Axis] = [index, index - layout.ndim]
    if layout.names is not None:
        forms.append(layout.names[index])
    return forms


@st.composite
def _axes(draw: DrawFn, layout: MeshLayout, min_size: int, max_size: int) -> tuple[Axis, ...]:
    order = draw(st.permutations(range(layout.ndim)))
    count = draw(st.integers(min_size, max_size))
    return tuple(draw(st.sampled_from(_spellings(layout, i))) for i in order[:count])


def axes(
    layout: MeshLayout, *, min_size: int = 1, max_size: int | None = None
) -> SearchStrategy[tuple[Axis, ...]]:
    """Tuples of distinct axes of ``layout`` in any order, spelt as indices, negative indices or names.

    >>> isinstance(axes(MeshLayout((2, 2, 2), names=("dp", "pp", "tp")), min_size=2), SearchStrategy)
    True
    """
    _check_layout(layout)
    top = layout.ndim if max_size is None else max_size
    _check_count(min_size, "min_size", 0)
    _check_count(top, "max_size", min_size)
    if top > layout.ndim:
        raise ValueError(f"max_size {top} exceeds the {layout.ndim} axes of {shown(layout)}")
    return _axes(layout, min_size, top)


@st.composite
def _positions(draw: DrawFn, size: int) -> list[int]:
    order = draw(st.permutations(range(size)))
    count = draw(st.integers(1, size))
    return [p - size if draw(st.booleans()) else p for p in order[:count]]


def indices_for(
    layout: MeshLayout, axes: Axes
) -> SearchStrategy[list[int] | tuple[list[int], ...]]:
    """Valid ``indices`` for ``layout.group(coord, axes, indices)``: distinct positions, some negative.

    A single axis gets one list of positions; a sequence of axes gets a tuple
    holding one list per axis, in the order given.

    >>> isinstance(indices_for(MeshLayout((4, 2), names=("pp", "tp")), ("tp", 0)), SearchStrategy)
    True
    """
    chosen = _check_layout(layout).axes_indices(axes)
    if isinstance(axes, (str, int)):
        return _positions(layout.shape[chosen[0]])
    parts = [_positions(layout.shape[a]) for a in chosen]
    return cast("SearchStrategy[tuple[list[int], ...]]", st.tuples(*parts))


@st.composite
def _slice_or_int(draw: DrawFn, size: int) -> int | slice:
    if draw(st.booleans()):
        return draw(st.integers(-size, size - 1))
    bound = st.none() | st.integers(-size - 2, size + 2)
    step = draw(st.none() | st.integers(1, 3) | st.integers(-3, -1))
    key = slice(draw(bound), draw(bound), step)
    if not range(size)[key]:
        # Fall back to a slice that selects something: the whole axis, in the drawn direction.
        key = slice(None, None, step)
    return key


@st.composite
def _keys(draw: DrawFn, layout: MeshLayout) -> object:
    items: list[object] = [draw(_slice_or_int(n)) for n in layout.shape]
    style = draw(st.sampled_from(("tuple", "ellipsis", "short", "mapping")))
    if style == "mapping":
        chosen = draw(_axes(layout, 0, layout.ndim))
        return {axis: items[layout.axis_index(axis)] for axis in chosen}
    if style == "ellipsis":
        start = draw(st.integers(0, layout.ndim))
        stop = draw(st.integers(start, layout.ndim))
        items[start:stop] = [Ellipsis]
    elif style == "short":
        items = items[: draw(st.integers(0, layout.ndim))]
    if len(items) == 1 and draw(st.booleans()):
        return items[0]
    return tuple(items)


def keys_for(layout: MeshLayout) -> SearchStrategy[object]:
    """Keys for ``layout[key]`` that select at least one rank: ints, slices, ``...``, or a mapping.

    Slices may run backwards; a mapping indexes axes by name, index or negative index.

    >>> isinstance(keys_for(MeshLayout((2, 4), names=("dp", "tp"))), SearchStrategy)
    True
    """
    return _keys(_check_layout(layout))
