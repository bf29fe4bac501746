"""MeshLayout.reshape: another factorization of the same ranks (the layout of a mesh view)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scopedmesh.layout import MeshLayout
from scopedmesh.testing import strategies as sst


def factorizations(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes whose product is ``n``, built from its divisors."""

    @st.composite
    def draw(draw: st.DrawFn) -> tuple[int, ...]:
        dims, left = [], n
        while left > 1 and len(dims) < 4:
            divisors = [d for d in range(1, left + 1) if left % d == 0]
            d = draw(st.sampled_from(divisors))
            dims.append(d)
            left //= d
        return (*dims, left)

    return draw()


def sliced(layout: MeshLayout, data: st.DataObject) -> MeshLayout:
    """``layout`` or a strided, maybe reversed, slice of it (a view over the same table)."""
    key = tuple(
        slice(None, None, data.draw(st.sampled_from([1, -1, 2]))) if n > 1 else slice(None)
        for n in layout.shape
    )
    return layout[key] if data.draw(st.booleans()) else layout


@given(sst.layouts(max_world=64), st.data())
def test_reshape_keeps_the_ranks_in_c_order(layout: MeshLayout, data: st.DataObject) -> None:
    source = sliced(layout, data)
    shape = data.draw(factorizations(source.size))
    reshaped = source.reshape(shape)
    assert reshaped.shape == shape
    assert reshaped.ranks == source.ranks  # brute force: the same sequence of ranks
    assert reshaped == MeshLayout(shape, ranks=list(source.ranks))
    for coord in [(0,) * len(shape), tuple(n - 1 for n in shape)]:
        assert reshaped.unravel(reshaped.ravel(coord)) == coord


@given(sst.layouts(max_world=64), st.data())
def test_reshape_groups_partition_the_same_ranks(layout: MeshLayout, data: st.DataObject) -> None:
    shape = data.draw(factorizations(layout.size))
    reshaped = layout.reshape(shape)
    for axis in range(len(shape)):
        groups = reshaped.groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == sorted(layout.ranks)
        assert all(len(g) == shape[axis] for g in groups)


def test_reshape_infers_minus_one_and_names_axes() -> None:
    layout = MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).reshape(
        (-1, 2, 2), ("edp", "ep", "tp")
    )
    assert layout.names == ("edp", "ep", "tp")
    assert layout.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_reshape_refuses_a_shape_of_another_size() -> None:
    with pytest.raises(ValueError, match=r"shape \(3, 3\) holds 9 ranks but this layout has 8"):
        MeshLayout((2, 4)).reshape((3, 3))
    with pytest.raises(ValueError, match="names has 1 entries but the shape has 2 axes"):
        MeshLayout((2, 4)).reshape((4, 2), names=("a",))
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        MeshLayout((2, 4)).reshape(8)  # type: ignore[arg-type]


def test_reshape_of_a_huge_default_layout_costs_no_table() -> None:
    world = 1 << 40
    layout = MeshLayout((1 << 20, 1 << 20)).reshape((1 << 10, 1 << 30))
    assert layout.ravel((3, 5)) == 3 * (1 << 30) + 5
    assert layout.size == world and math.prod(layout.shape) == world


@given(sst.layouts(max_world=64), st.data())
def test_ordered_group_is_the_group_in_c_order_of_its_axes(
    layout: MeshLayout, data: st.DataObject
) -> None:
    source = sliced(layout, data)
    if source.ndim > 1 and data.draw(st.booleans()):  # a transposed sub-layout
        order = data.draw(st.permutations(range(source.ndim)))
        source = source.sub((0,) * source.ndim, tuple(order))
    coord = tuple(data.draw(st.integers(0, n - 1)) for n in source.shape)
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, source.ndim - 1), min_size=1))))
    expected = [source.ravel(c) for c in source.coords_along(coord, axes)]  # C order of axes
    assert list(source.ordered_group(coord, axes)) == expected
    assert sorted(expected) == list(source.compact_group(coord, axes))
