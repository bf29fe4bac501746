"""shrink(): the survivors' layout, checked against a brute-force reference (no process group)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn

from scopedmesh.layout import MeshLayout
from scopedmesh.layout.survivors import lost_positions, shrink
from scopedmesh.testing.strategies import layouts


def brute_force(layout: MeshLayout, lost: set[int], axis: int) -> tuple[tuple[int, ...], list[int]]:
    """The survivors' shape and ranks by walking every coordinate in C order."""
    hit = {c[axis] for c in itertools.product(*map(range, layout.shape)) if layout.ravel(c) in lost}
    kept = [p for p in range(layout.shape[axis]) if p not in hit]
    ranks = [
        layout.ravel(c) for c in itertools.product(*map(range, layout.shape)) if c[axis] not in hit
    ]
    shape = tuple(len(kept) if a == axis else n for a, n in enumerate(layout.shape))
    return shape, ranks


@st.composite
def cases(draw: DrawFn) -> tuple[MeshLayout, set[int], int]:
    layout = draw(layouts(max_axes=4, max_world=64))
    axis = draw(st.integers(0, layout.ndim - 1))
    lost = set(draw(st.lists(st.sampled_from(layout.ranks), max_size=4)))
    return layout, lost, axis


@settings(max_examples=300, deadline=None)
@given(cases())
def test_shrink_matches_brute_force(case: tuple[MeshLayout, set[int], int]) -> None:
    layout, lost, axis = case
    shape, ranks = brute_force(layout, lost, axis)
    if shape[axis] == 0:
        with pytest.raises(ValueError, match=r"cannot absorb the loss of ranks .* all \d+ of its"):
            shrink(layout, lost, axis)
        return
    survivors = shrink(layout, lost, axis)
    assert survivors.shape == shape
    assert list(survivors.ranks) == ranks
    assert survivors.names == layout.names
    assert not lost & set(survivors.ranks)
    # Other axes stay whole: every group along another axis is a group of the old layout.
    old_groups = {frozenset(g) for a in range(layout.ndim) for g in layout.groups(a)}
    for other in range(layout.ndim):
        if other != axis:
            assert {frozenset(g) for g in survivors.groups(other)} <= old_groups
    # By name as well as by index, and with negative indices.
    spelled = layout.names[axis] if layout.names else axis - layout.ndim
    assert shrink(layout, lost, spelled) == survivors
    assert len(lost_positions(layout, lost, axis)) == layout.shape[axis] - shape[axis]


def test_nothing_lost_is_the_same_layout() -> None:
    layout = MeshLayout((2, 3), names=("dp", "tp"), ranks=[5, 4, 3, 2, 1, 0])
    assert shrink(layout, [], "dp") == layout


def test_dp_tp_example() -> None:
    layout = MeshLayout((4, 2), names=("dp", "tp"))
    survivors = shrink(layout, [5], "dp")
    assert survivors.shape == (3, 2)
    assert survivors.groups("tp") == ((0, 1), (2, 3), (6, 7))
    assert survivors.groups("dp") == ((0, 2, 6), (1, 3, 7))


def test_errors_name_the_numbers() -> None:
    layout = MeshLayout((2, 2), names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"axis 'dp' cannot absorb the loss of ranks \[0, 3\]"):
        shrink(layout, [3, 0], "dp")
    with pytest.raises(ValueError, match=r"lost rank 9 is not in the mesh's ranks \[0, 1, 2, 3\]"):
        shrink(layout, [9], "dp")
    with pytest.raises(TypeError, match="lost must hold int ranks, got '1'"):
        shrink(layout, ["1"], "dp")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="lost must be an iterable"):
        shrink(layout, 3, "dp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        shrink(layout, [1], "ep")


def test_importing_survivors_leaves_torch_out() -> None:
    code = (
        "import sys, scopedmesh.layout.survivors; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
