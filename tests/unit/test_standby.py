"""Standby groups (scopedmesh.mesh.standby): which groups each rank forms ahead, in what order.

Pure: no world. The property that keeps formation ahead from deadlocking: any two
groups two ranks both form come in the same order on both (one global order, each
rank forming its own groups in it), and every group a survivors' mesh will ask for
after the loss of any slice is among its members' standby groups.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scopedmesh import MeshLayout, shrink
from scopedmesh.mesh.standby import Standby, prepare_standby, standby_keys

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(
    lambda shape: 2 <= len(MeshLayout(tuple(shape)).ranks) <= 24
)


def _keys(layout: MeshLayout, axis: int, ordered: bool) -> dict[int, list[tuple[int, ...]]]:
    axes = list(range(len(layout.shape)))
    return {
        rank: [k for k, _ in standby_keys(layout, rank, axis, axes, ordered=ordered, backend="b")]
        for rank in layout.ranks
    }


@settings(max_examples=25)
@given(shapes, st.data(), st.booleans())
def test_two_ranks_form_their_common_standby_groups_in_the_same_order(
    shape: list[int], data: st.DataObject, ordered: bool
) -> None:
    layout = MeshLayout(tuple(shape))
    axis = data.draw(st.integers(0, len(shape) - 1))
    keys = _keys(layout, axis, ordered)
    for a, b in itertools.combinations(layout.ranks, 2):
        common = [k for k in keys[a] if k in keys[b]]
        assert common == [k for k in keys[b] if k in keys[a]], (a, b)
    for rank, own in keys.items():
        assert len(own) == len(set(own))  # each group once
        assert all(rank in group for group in own)
        assert all(all(r in keys and group in keys[r] for r in group) for group in own)


@pytest.mark.fault  # a slow lane: about 0.7 s (the README's suite is at its budget)
@settings(max_examples=25)
@given(shapes, st.data())
def test_every_group_of_a_survivors_mesh_is_ready_on_its_members(
    shape: list[int], data: st.DataObject
) -> None:
    layout = MeshLayout(tuple(shape))
    axis = data.draw(st.integers(0, len(shape) - 1))
    if layout.shape[axis] < 2:
        return  # losing the only slice leaves nobody
    keys = _keys(layout, axis, True)
    position = data.draw(st.integers(0, layout.shape[axis] - 1))
    lost = [r for r in layout.ranks if layout.unravel(r)[axis] == position]
    survivors = shrink(layout, lost, axis)
    for rank in survivors.ranks:
        coord = survivors.unravel(rank)
        for along in range(len(shape)):
            assert tuple(survivors.ordered_group(coord, along)) in keys[rank]


def test_a_rank_holds_one_group_per_other_slice_and_axis_at_most() -> None:
    # 4 x 2 (dp, tp), ready for losing any dp row: rank 0 forms dp groups of 3 for the
    # 3 rows it is not in, and its tp group [0, 1] once (the same whichever row is lost).
    keys = _keys(MeshLayout((4, 2)), 0, True)
    assert keys[0] == [(0, 4, 6), (0, 1), (0, 2, 6), (0, 2, 4)]


def test_an_empty_standby_takes_nothing_and_closes() -> None:
    standby = Standby()
    assert standby.take(((0, 1), "nccl")) is None
    assert (standby.groups, standby.taken, standby.bytes_per_group) == (0, 0, None)
    standby.close()
    standby.prune([0])


def test_prepare_standby_names_a_bad_mesh() -> None:
    with pytest.raises(TypeError, match="mesh must be a ProcessGroupMesh, got"):
        prepare_standby("dp", "dp")  # type: ignore[arg-type]
