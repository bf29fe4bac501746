"""The integer algebra under MeshLayout, against brute force over every coordinate."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from scopedmesh.layout.algebra import c_strides, fixed_offset, position, slice_view, solve, span

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


def c_order(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*map(range, shape)))


@given(shapes, st.integers(1, 3), st.integers(0, 5))
def test_c_strides_number_coordinates_in_c_order(
    shape: tuple[int, ...], step: int, at: int
) -> None:
    strides = c_strides(shape, step)
    positions = [position(c, strides, at) for c in c_order(shape)]
    assert positions == list(range(at, at + step * len(positions), step))


@given(shapes, st.data())
def test_solve_inverts_position_and_refuses_the_rest(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    flips = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    strides = tuple(-s if f else s for s, f in zip(c_strides(shape), flips))
    reached = {position(c, strides, 0): c for c in c_order(shape)}
    for distance in range(min(reached) - 2, max(reached) + 3):
        assert solve(distance, shape, strides) == reached.get(distance)


@given(shapes, st.data())
def test_span_is_the_group_when_it_is_a_progression(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    strides = c_strides(shape)
    base = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    chosen = tuple(sorted(data.draw(st.sets(st.sampled_from(range(len(shape))), min_size=1))))
    per_axis = tuple(
        sorted(data.draw(st.sets(st.integers(0, shape[a] - 1), min_size=1))) for a in chosen
    )
    start = fixed_offset(base, strides, 0, chosen)
    members = []
    for values in itertools.product(*per_axis):
        point = list(base)
        for a, v in zip(chosen, values):
            point[a] = v
        members.append(position(point, strides, 0))
    members.sort()
    progression = span(start, strides, chosen, per_axis)
    is_progression = all(b - a == members[1] - members[0] for a, b in itertools.pairwise(members))
    if is_progression and (len(members) == 1 or members[1] > members[0]):
        assert progression is not None and list(progression) == members
    else:
        assert progression is None


@given(shapes, st.data())
def test_slice_view_matches_indexing_every_coordinate(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    strides = c_strides(shape)
    per_axis: list[int | slice] = []
    for n in shape:
        if data.draw(st.booleans()):
            per_axis.append(data.draw(st.integers(0, n - 1)))
        else:
            start = data.draw(st.integers(0, n - 1))
            step = data.draw(st.sampled_from([1, 2, -1]))
            per_axis.append(slice(start, None, step))
    new_shape, new_strides, offset, kept = slice_view(shape, strides, 0, per_axis)
    axes = [range(*p.indices(n)) if isinstance(p, slice) else [p] for p, n in zip(per_axis, shape)]
    expected = [position(c, strides, 0) for c in itertools.product(*axes)]
    got = [position(c, new_strides, offset) for c in c_order(new_shape)]
    assert got == expected
    assert kept == tuple(a for a, p in enumerate(per_axis) if isinstance(p, slice))
