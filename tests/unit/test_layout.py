"""Laws of MeshLayout, checked against a brute-force reference written in this file.

The reference (:class:`Ref`) never asks the library for an answer: it enumerates
every coordinate with ``itertools.product``, computes each C-order position by
hand and maps it through the rank table given to the constructor. Sub-layouts
are derived from the parent's reference by enumerating the selected coordinates.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn

from scopedmesh.errors import AxisError, CoordinateError
from scopedmesh.layout import MeshLayout
from scopedmesh.testing.strategies import (
    axes,
    coordinates,
    indices_for,
    keys_for,
    layouts,
    names_for,
    rank_tables,
    shapes,
)

ROOT = Path(__file__).resolve().parents[2]

# Sized for a slow 2-core machine: the whole module runs in well under a minute.
LAWS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Coord = tuple[int, ...]


# --------------------------------------------------------------- reference


def c_position(coord: Sequence[int], shape: Sequence[int]) -> int:
    """C-order position of ``coord`` (last axis fastest), computed digit by digit."""
    position = 0
    for c, n in zip(coord, shape, strict=True):
        position = position * n + c
    return position


def all_coords(shape: Sequence[int]) -> Iterator[Coord]:
    return itertools.product(*(range(n) for n in shape))


@dataclass(frozen=True)
class Ref:
    """A layout as a plain dict from coordinate to rank."""

    shape: Coord
    names: tuple[str, ...] | None
    table: dict[Coord, int]

    @staticmethod
    def build(
        shape: Sequence[int], names: Sequence[str] | None, ranks: Sequence[int] | None
    ) -> Ref:
        size = 1
        for n in shape:
            size *= n
        listed = list(range(size)) if ranks is None else list(ranks)
        assert len(listed) == size
        table = {coord: listed[c_position(coord, shape)] for coord in all_coords(shape)}
        return Ref(tuple(shape), None if names is None else tuple(names), table)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def ranks(self) -> list[int]:
        return [self.table[coord] for coord in all_coords(self.shape)]

    def axis(self, axis: object) -> int:
        if isinstance(axis, str):
            assert self.names is not None
            return self.names.index(axis)
        assert isinstance(axis, int)
        return axis + self.ndim if axis < 0 else axis

    def chosen(self, axes_: Any) -> list[int]:
        items = [axes_] if isinstance(axes_, (str, int)) else list(axes_)
        return [self.axis(a) for a in items]

    def allowed(self, axes_: Any, indices: Any) -> dict[int, set[int]]:
        """For each chosen axis, the positions a group may use."""
        chosen = self.chosen(axes_)
        if indices is None:
            return {a: set(range(self.shape[a])) for a in chosen}
        lists = [indices] if isinstance(axes_, (str, int)) else list(indices)
        return {
            a: {p + self.shape[a] if p < 0 else p for p in positions}
            for a, positions in zip(chosen, lists, strict=True)
        }

    def groups(self, axes_: object, indices: object = None) -> list[tuple[int, ...]]:
        allowed = self.allowed(axes_, indices)
        others = [k for k in range(self.ndim) if k not in allowed]
        buckets: dict[Coord, list[int]] = {}
        for coord, rank in self.table.items():
            if all(coord[a] in positions for a, positions in allowed.items()):
                buckets.setdefault(tuple(coord[k] for k in others), []).append(rank)
        order = all_coords([self.shape[k] for k in others])
        return [tuple(sorted(buckets[key])) for key in order]

    def group(self, coord: Coord, axes_: object, indices: object = None) -> tuple[int, ...]:
        allowed = self.allowed(axes_, indices)
        members = [
            rank
            for c, rank in self.table.items()
            if all(c[k] == coord[k] for k in range(self.ndim) if k not in allowed)
            and all(c[a] in positions for a, positions in allowed.items())
        ]
        return tuple(sorted(members))

    def restrict(self, fixed: Mapping[int, int], kept: Sequence[tuple[int, list[int]]]) -> Ref:
        """Fix some axes, keep others (in the given order, at the given positions)."""
        shape = tuple(len(positions) for _, positions in kept)
        table = {}
        for sub in all_coords(shape):
            full = [0] * self.ndim
            for a, value in fixed.items():
                full[a] = value
            for (a, positions), i in zip(kept, sub, strict=True):
                full[a] = positions[i]
            table[sub] = self.table[tuple(full)]
        names = None if self.names is None else tuple(self.names[a] for a, _ in kept)
        return Ref(shape, names, table)

    def select(self, key: object) -> Ref:
        """``layout[key]`` by hand: expand the key per axis, slice position lists."""
        per_axis: list[object]
        if isinstance(key, Mapping):
            per_axis = [slice(None)] * self.ndim
            for axis, item in key.items():
                per_axis[self.axis(axis)] = item
        else:
            items = list(key) if isinstance(key, tuple) else [key]
            if any(item is Ellipsis for item in items):
                at = next(i for i, item in enumerate(items) if item is Ellipsis)
                items[at : at + 1] = [slice(None)] * (self.ndim - len(items) + 1)
            per_axis = items + [slice(None)] * (self.ndim - len(items))
        fixed: dict[int, int] = {}
        kept: list[tuple[int, list[int]]] = []
        for a, item in enumerate(per_axis):
            positions = list(range(self.shape[a]))
            if isinstance(item, slice):
                kept.append((a, positions[item]))
            else:
                assert isinstance(item, int)
                fixed[a] = positions[item]
        return self.restrict(fixed, kept)

    def sub(self, coord: Coord, axes_: object) -> Ref:
        chosen = self.chosen(axes_)
        fixed = {a: coord[a] for a in range(self.ndim) if a not in chosen}
        return self.restrict(fixed, [(a, list(range(self.shape[a]))) for a in chosen])


@st.composite
def cases(
    draw: DrawFn, max_axes: int = 5, max_world: int = 256, custom: bool | None = None
) -> tuple[MeshLayout, Ref]:
    """A layout built from drawn arguments, with its reference built from the same ones."""
    shape = draw(shapes(max_axes=max_axes, max_world=max_world))
    names = draw(st.none() | names_for(len(shape)))
    use_ranks = draw(st.booleans()) if custom is None else custom
    ranks = draw(rank_tables(math.prod(shape))) if use_ranks else None
    return MeshLayout(shape, names=names, ranks=ranks), Ref.build(shape, names, ranks)


def check_against(layout: MeshLayout, ref: Ref) -> None:
    """Every coordinate ravels to the reference rank and back; absent ranks are refused."""
    assert layout.shape == ref.shape
    assert layout.names == ref.names
    assert layout.ndim == ref.ndim
    assert layout.size == len(ref.table)
    assert layout.ranks == tuple(ref.ranks())
    for coord, rank in ref.table.items():
        got = layout.ravel(coord)
        assert type(got) is int
        assert got == rank
        back = layout.unravel(rank)
        assert type(back) is tuple
        assert all(type(c) is int for c in back)
        assert back == coord
        assert rank in layout
    present = set(ref.table.values())
    gaps = sorted(set(range(max(present))) - present)
    for rank in [-1, max(present) + 1, max(present) + 7, *gaps[:10], *gaps[-10:]]:
        assert rank not in layout
        with pytest.raises(ValueError, match=f"rank {rank} is not in"):
            layout.unravel(rank)
    for axis in range(ref.ndim):
        assert list(layout.groups(axis)) == ref.groups(axis)
    if ref.ndim:
        assert list(layout.groups(tuple(range(ref.ndim)))) == [tuple(sorted(present))]


def check_partition(layout: MeshLayout, axes_: Any) -> None:
    """``groups(axes)`` partitions the layout into equal, ascending, self-consistent groups."""
    chosen = [layout.axis_index(a) for a in ([axes_] if isinstance(axes_, (str, int)) else axes_)]
    size = math.prod(layout.shape[a] for a in chosen)
    family = layout.groups(axes_)
    assert len(family) == layout.size // size
    seen: set[int] = set()
    for members in family:
        assert len(members) == size
        assert list(members) == sorted(members)
        assert seen.isdisjoint(members)
        seen.update(members)
        for rank in members:
            assert layout.group(layout.unravel(rank), axes_) == members
    assert seen == set(layout.ranks)


# ------------------------------------------------------- ravel and unravel


@LAWS
@given(cases())
def test_ravel_and_unravel_match_reference(case: tuple[MeshLayout, Ref]) -> None:
    layout, ref = case
    check_against(layout, ref)


@LAWS
@given(layouts(), st.data())
def test_round_trips_from_the_rank_side(layout: MeshLayout, data: st.DataObject) -> None:
    for rank in data.draw(st.lists(st.sampled_from(layout.ranks), min_size=1, max_size=10)):
        assert layout.ravel(layout.unravel(rank)) == rank
    coord = data.draw(coordinates(layout))
    assert layout.unravel(layout.ravel(coord)) == coord


def _wrapped(coord: Coord, shape: Coord) -> Coord:
    return tuple(((c % n) + n) % n for c, n in zip(coord, shape, strict=True))


def _clipped(coord: Coord, shape: Coord) -> Coord:
    return tuple(0 if c < 0 else n - 1 if c >= n else c for c, n in zip(coord, shape, strict=True))


@LAWS
@given(cases(), st.data())
def test_ravel_modes_follow_numpy_semantics(
    case: tuple[MeshLayout, Ref], data: st.DataObject
) -> None:
    layout, ref = case
    coord = tuple(data.draw(st.integers(-3 * n - 2, 3 * n + 2)) for n in ref.shape)
    wrapped = layout.ravel(coord, mode="wrap")
    clipped = layout.ravel(coord, mode="clip")
    assert type(wrapped) is int and type(clipped) is int
    assert wrapped == ref.table[_wrapped(coord, ref.shape)]
    assert clipped == ref.table[_clipped(coord, ref.shape)]
    if all(0 <= c < n for c, n in zip(coord, ref.shape, strict=True)):
        assert layout.ravel(coord, mode="raise") == ref.table[coord] == wrapped == clipped
    else:
        with pytest.raises(CoordinateError, match=r"coord \(.*\) is out of bounds"):
            layout.ravel(coord, mode="raise")
        with pytest.raises(ValueError, match="out of bounds"):  # as numpy.ravel_multi_index
            layout.ravel(coord)


@pytest.mark.parametrize(
    "call",
    [
        lambda: MeshLayout((2, 3)).ravel((2, 0)),
        lambda: MeshLayout((2, 3)).ravel((0, -1), mode="raise"),
        lambda: MeshLayout((2, 3)).unravel(6),
        lambda: MeshLayout((2, 3), ranks=range(6, 12)).unravel(0),
    ],
    ids=["ravel high", "ravel negative", "unravel high", "unravel absent"],
)
def test_out_of_bounds_is_numpys_value_error_and_still_an_index_error(
    call: Callable[[], object],
) -> None:
    """numpy's ravel_multi_index / unravel_index raise ValueError; IndexError still catches it."""
    for caught in (CoordinateError, ValueError, IndexError):
        with pytest.raises(caught) as info:
            call()
        assert type(info.value) is CoordinateError


@pytest.mark.parametrize("mode", ["raise", "wrap", "clip"])
@pytest.mark.parametrize("coord", [(0,), (0, 0), (1, 1, 1, 1), (0, 0, 0, 0, 0), ()])
def test_ravel_checks_the_length_in_every_mode(mode: str, coord: Coord) -> None:
    with pytest.raises(ValueError, match=r"coord must have 3 entries"):
        MeshLayout((2, 3, 4)).ravel(coord, mode=mode)  # type: ignore[arg-type]  # str, not the Literal


def test_c_order_examples_from_the_design() -> None:
    layout = MeshLayout((2, 2, 2))
    assert layout.ravel((0, 1, 0)) == c_position((0, 1, 0), (2, 2, 2)) == 2
    assert layout.unravel(5) == (1, 0, 1)


# ------------------------------------------------------------------ groups


@LAWS
@given(layouts(), st.data())
def test_groups_partition_the_layout(layout: MeshLayout, data: st.DataObject) -> None:
    check_partition(layout, data.draw(axes(layout)))


@LAWS
@given(cases(), st.data())
def test_groups_and_group_match_reference(
    case: tuple[MeshLayout, Ref], data: st.DataObject
) -> None:
    layout, ref = case
    chosen = data.draw(axes(layout))
    assert list(layout.groups(chosen)) == ref.groups(chosen)
    coord = data.draw(coordinates(layout))
    assert layout.group(coord, chosen) == ref.group(coord, chosen)
    # group(coord) is the member of the partition that holds ravel(coord).
    holding = [g for g in layout.groups(chosen) if layout.ravel(coord) in g]
    assert holding == [layout.group(coord, chosen)]
    # The same through a single axis, spelt as it was drawn.
    assert layout.group(coord, chosen[0]) == ref.group(coord, [chosen[0]])


@LAWS
@given(cases(), st.data())
def test_indices_select_a_disjoint_family(
    case: tuple[MeshLayout, Ref], data: st.DataObject
) -> None:
    layout, ref = case
    single = data.draw(st.booleans())
    chosen: Any = data.draw(axes(layout, max_size=1))[0] if single else data.draw(axes(layout))
    indices: Any = data.draw(indices_for(layout, chosen))
    lists: list[list[int]] = [indices] if single else list(indices)
    expected_size = math.prod(len(positions) for positions in lists)
    family = layout.groups(chosen, indices)
    assert list(family) == ref.groups(chosen, indices)
    seen: set[int] = set()
    for members in family:
        assert len(members) == expected_size
        assert list(members) == sorted(members)
        assert seen.isdisjoint(members)
        seen.update(members)
    coord = data.draw(coordinates(layout))
    assert layout.group(coord, chosen, indices) == ref.group(coord, chosen, indices)
    # Negative positions mean the same as their positive forms; their order does not matter.
    positive = [
        sorted(p % layout.shape[layout.axis_index(a)] for p in positions)
        for a, positions in zip([chosen] if single else chosen, lists, strict=True)
    ]
    as_given = positive[0] if single else positive
    assert layout.groups(chosen, as_given) == family


@LAWS
@given(layouts(with_names=True), st.data())
def test_axis_spellings_and_order_are_interchangeable(
    layout: MeshLayout, data: st.DataObject
) -> None:
    names = layout.names
    assert names is not None
    first = data.draw(axes(layout), label="first")
    canonical = sorted(layout.axis_index(a) for a in first)
    again = data.draw(st.permutations(canonical), label="order")
    spellings: list[list[int | str]] = [[a, a - layout.ndim, names[a]] for a in again]
    respelt = tuple(data.draw(st.sampled_from(forms)) for forms in spellings)
    coord = data.draw(coordinates(layout))
    assert layout.group(coord, first) == layout.group(coord, respelt)
    assert layout.group(coord, first) == layout.group(coord, tuple(canonical))
    assert layout.groups(first) == layout.groups(respelt)
    one = canonical[0]
    assert (
        layout.groups(one)
        == layout.groups(one - layout.ndim)
        == layout.groups(names[one])
        == layout.groups((one,))
    )


def test_group_examples_with_custom_ranks() -> None:
    layout = MeshLayout((2, 2), ranks=[3, 1, 0, 2])
    ref = Ref.build((2, 2), None, [3, 1, 0, 2])
    assert layout.group((0, 0), 1) == ref.group((0, 0), 1) == (1, 3)
    assert layout.groups(0) == tuple(ref.groups(0)) == ((0, 3), (1, 2))


# ------------------------------------------------------------- sub-layouts


@LAWS
@given(cases(), st.data())
def test_getitem_matches_reference(case: tuple[MeshLayout, Ref], data: st.DataObject) -> None:
    layout, ref = case
    key = data.draw(keys_for(layout), label="key")
    check_against(layout[key], ref.select(key))


@LAWS
@given(cases(max_world=128), st.data())
def test_sub_layouts_of_sub_layouts(case: tuple[MeshLayout, Ref], data: st.DataObject) -> None:
    layout, ref = case
    for _ in range(3):
        if layout.ndim and data.draw(st.booleans(), label="via sub"):
            coord = data.draw(coordinates(layout), label="coord")
            chosen = data.draw(axes(layout), label="axes")
            layout, ref = layout.sub(coord, chosen), ref.sub(coord, chosen)
        else:
            key = data.draw(keys_for(layout), label="key")
            layout, ref = layout[key], ref.select(key)
        check_against(layout, ref)
        if layout.ndim:
            check_partition(layout, data.draw(axes(layout), label="partition axes"))


@LAWS
@given(cases(), st.data())
def test_sub_matches_reference(case: tuple[MeshLayout, Ref], data: st.DataObject) -> None:
    layout, ref = case
    coord = data.draw(coordinates(layout))
    chosen = data.draw(axes(layout))
    sub = layout.sub(coord, chosen)
    expected = ref.sub(coord, chosen)
    check_against(sub, expected)
    # The sub-layout through coord holds exactly coord's group along those axes.
    assert tuple(sorted(sub.ranks)) == ref.group(coord, chosen)


@FEW
@given(cases(custom=True), st.data())
def test_empty_slices_are_refused(case: tuple[MeshLayout, Ref], data: st.DataObject) -> None:
    layout, ref = case
    axis = data.draw(st.integers(0, ref.ndim - 1))
    n = ref.shape[axis]
    key = (slice(None),) * axis + (slice(n, None),)
    with pytest.raises(IndexError, match="selects no position"):
        layout[key]


# ---------------------------------------------------------- -1 and values


@LAWS
@given(cases(custom=True), st.data())
def test_minus_one_is_inferred_from_ranks(
    case: tuple[MeshLayout, Ref], data: st.DataObject
) -> None:
    layout, ref = case
    axis = data.draw(st.integers(0, ref.ndim - 1))
    shape = list(ref.shape)
    shape[axis] = -1
    inferred = MeshLayout(shape, names=ref.names, ranks=ref.ranks())
    assert inferred.shape == ref.shape
    assert inferred == layout
    check_against(inferred, ref)


@pytest.mark.parametrize(
    ("shape", "ranks", "expected"),
    [((-1, 2), range(8, 16), (4, 2)), ((3, -1), list(range(12)), (3, 4)), ((-1,), [7], (1,))],
)
def test_minus_one_examples(shape: Coord, ranks: Sequence[int], expected: Coord) -> None:
    assert MeshLayout(shape, ranks=ranks).shape == expected


@LAWS
@given(cases())
def test_layouts_are_values(case: tuple[MeshLayout, Ref]) -> None:
    layout, ref = case
    # Built again from the same map (ranks listed explicitly): equal, same hash.
    twin = MeshLayout(ref.shape, names=ref.names, ranks=ref.ranks())
    assert twin == layout and hash(twin) == hash(layout)
    cache = {layout: "hit"}
    assert cache[twin] == "hit"
    if len(ref.table) > 1:
        assert MeshLayout(ref.shape, names=ref.names, ranks=ref.ranks()[::-1]) != layout
    other_names = tuple(f"x{i}" for i in range(ref.ndim))
    assert MeshLayout(ref.shape, names=other_names, ranks=ref.ranks()) != layout
    if ref.names is not None:
        assert MeshLayout(ref.shape, ranks=ref.ranks()) != layout
    assert layout != ref.ranks() and layout != tuple(ref.ranks())
    for clone in (copy.copy(layout), copy.deepcopy(layout), pickle.loads(pickle.dumps(layout))):
        assert clone == layout and hash(clone) == hash(layout)
        check_against(clone, ref)


@LAWS
@given(cases(), st.data())
def test_sub_layouts_equal_layouts_built_from_their_ranks(
    case: tuple[MeshLayout, Ref], data: st.DataObject
) -> None:
    layout, ref = case
    key = data.draw(keys_for(layout))
    view, expected = layout[key], ref.select(key)
    built = MeshLayout(expected.shape, names=expected.names, ranks=expected.ranks())
    assert view == built and hash(view) == hash(built)
    assert {view: 1}[built] == 1
    assert pickle.loads(pickle.dumps(view)) == view


def test_equal_maps_from_different_spellings() -> None:
    assert MeshLayout((8,), ranks=range(8, 16)) == MeshLayout((8,), ranks=list(range(8, 16)))
    assert MeshLayout((2, 4))[:, ::2] == MeshLayout((2, 2), ranks=[0, 2, 4, 6])
    assert MeshLayout((2, 2), ranks=[3, 1, 0, 2])[0] == MeshLayout((2,), ranks=[3, 1])
    assert MeshLayout((4,))[::-1] == MeshLayout((4,), ranks=[3, 2, 1, 0])
    assert MeshLayout((2, 4))[1] == MeshLayout((4,), ranks=range(4, 8))
    assert MeshLayout((2, 4))[1] != MeshLayout((4,), ranks=range(4, 8), names=("tp",))
    assert MeshLayout((2, 2)) != MeshLayout((4,))


def test_layouts_are_immutable() -> None:
    layout = MeshLayout((2, 2), names=("dp", "tp"))
    for name in ("shape", "names", "ranks", "_shape", "_table", "_hash", "anything"):
        with pytest.raises(AttributeError, match="MeshLayout is immutable"):
            setattr(layout, name, (1,))
        with pytest.raises(AttributeError):
            delattr(layout, name)
    assert layout.shape == (2, 2) and layout.names == ("dp", "tp")
    assert layout.ranks == (0, 1, 2, 3)


def test_importing_layout_leaves_torch_out() -> None:
    code = (
        "import sys, scopedmesh.layout, scopedmesh.errors;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'hypothesis')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# -------------------------------------------------------------- bad input

# Bad calls are ill-typed on purpose: go through Any rather than silence mypy line by line.
Layout: Any = MeshLayout
L: Any = MeshLayout((2, 3, 4), names=("dp", "pp", "tp"))
AXES = re.escape("('dp', 'pp', 'tp')")

BAD_INPUT: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    # shape
    ("shape bool", lambda: Layout((2, True)), TypeError, "shape must contain only ints"),
    ("shape float", lambda: Layout((2.0, 2)), TypeError, "shape must contain only ints"),
    ("shape str", lambda: Layout("22"), TypeError, "shape must be a sequence of ints"),
    ("shape int", lambda: Layout(4), TypeError, "shape must be a sequence of ints"),
    ("shape zero", lambda: Layout((2, 0)), ValueError, "shape must hold positive ints"),
    ("shape negative", lambda: Layout((-2, 2)), ValueError, "shape must hold positive"),
    ("two -1", lambda: Layout((-1, -1), ranks=range(4)), ValueError, "at most one -1"),
    ("-1 no ranks", lambda: Layout((-1, 2)), ValueError, r"shape \(-1, 2\) has a -1 but"),
    ("-1 no fit", lambda: Layout((-1, 3), ranks=range(8)), ValueError, "cannot infer the -1"),
    ("-1 empty ranks", lambda: Layout((-1,), ranks=[]), ValueError, "cannot infer the -1"),
    ("-1 empty range", lambda: Layout((2, -1), ranks=range(0)), ValueError, "infer the -1"),
    ("count", lambda: Layout((2, 2), ranks=range(5)), ValueError, "holds 4 ranks but ranks"),
    # names
    ("names short", lambda: Layout((2, 2), names=("a",)), ValueError, "names has 1 entries"),
    (
        "names dup",
        lambda: Layout((2, 2), names=("a", "a")),
        ValueError,
        "names must be distinct",
    ),
    ("names int", lambda: Layout((2, 2), names=("a", 1)), TypeError, "names must be"),
    ("names empty", lambda: Layout((2, 2), names=("a", "")), TypeError, "names must be"),
    ("names str", lambda: Layout((2, 2), names="ab"), TypeError, "names must be a sequence"),
    # ranks
    (
        "ranks dup",
        lambda: Layout((2, 2), ranks=[0, 0, 1, 2]),
        ValueError,
        "ranks must be distinct",
    ),
    (
        "ranks neg",
        lambda: Layout((4,), ranks=[0, 1, 2, -3]),
        ValueError,
        "ranks must be non-neg",
    ),
    (
        "range neg",
        lambda: Layout((4,), ranks=range(-1, 3)),
        ValueError,
        "ranks must be non-neg",
    ),
    (
        "range down",
        lambda: Layout((4,), ranks=range(2, -2, -1)),
        ValueError,
        "ranks must be non",
    ),
    ("ranks count", lambda: Layout((2, 2), ranks=[0, 1, 2]), ValueError, "but ranks has 3"),
    ("ranks float", lambda: Layout((2,), ranks=[0, 1.0]), TypeError, "ranks must contain only"),
    ("ranks bool", lambda: Layout((2,), ranks=[0, True]), TypeError, "ranks must contain only"),
    ("ranks set", lambda: Layout((2,), ranks={0, 1}), TypeError, "ranks must be a sequence"),
    ("ranks str", lambda: Layout((2,), ranks="01"), TypeError, "ranks must be a sequence"),
    # axes
    (
        "unknown name",
        lambda: L.groups("tpp"),
        AxisError,
        f"unknown axis 'tpp'; this mesh's axes are {AXES}",
    ),
    (
        "unknown in group",
        lambda: L.group((0, 0, 0), ("dp", "tpp")),
        AxisError,
        f"unknown axis 'tpp'; this mesh's axes are {AXES}",
    ),
    (
        "unknown in sub",
        lambda: L.sub((0, 0, 0), "tpp"),
        AxisError,
        f"unknown axis 'tpp'; this mesh's axes are {AXES}",
    ),
    (
        "axis_index name",
        lambda: L.axis_index("tpp"),
        AxisError,
        f"unknown axis 'tpp'; this mesh's axes are {AXES}",
    ),
    (
        "no names",
        lambda: Layout((2, 2)).groups("dp"),
        AxisError,
        "unknown axis 'dp'; this mesh has no axis names",
    ),
    (
        "axis range",
        lambda: L.axis_index(3),
        AxisError,
        "axis 3 is out of range for a mesh with 3 axes",
    ),
    ("axes range", lambda: L.groups(-4), AxisError, "axis -4 is out of range"),
    ("sub axes range", lambda: L.sub((0, 0, 0), (0, 5)), AxisError, "axis 5 is out of range"),
    ("axes dup", lambda: L.groups((0, 0)), ValueError, "axes must be distinct"),
    ("axes dup name", lambda: L.groups(("dp", 0)), ValueError, "axes must be distinct"),
    ("axes dup neg", lambda: L.group((0, 0, 0), (2, -1)), ValueError, "axes must be distinct"),
    ("axes float", lambda: L.groups(1.0), TypeError, "axes must be an axis or a non-empty"),
    ("axes bool", lambda: L.groups(True), TypeError, "axes must be an axis or a non-empty"),
    ("axes empty", lambda: L.groups(()), TypeError, "axes must be an axis or a non-empty"),
    (
        "axes None item",
        lambda: L.groups((0, None)),
        TypeError,
        "axis must be an int or an axis name",
    ),
    (
        "axis_index bool",
        lambda: L.axis_index(False),
        TypeError,
        "axis must be an int or an axis name",
    ),
    # indices
    (
        "indices count",
        lambda: L.groups(("dp", "tp"), indices=[[0]]),
        ValueError,
        "indices must hold one sequence",
    ),
    (
        "indices high",
        lambda: L.groups("tp", indices=[4]),
        IndexError,
        "index 4 is out of range for axis 'tp' of size 4",
    ),
    (
        "indices low",
        lambda: L.groups("tp", indices=[-5]),
        IndexError,
        "index -5 is out of range for axis 'tp'",
    ),
    (
        "indices dup",
        lambda: L.groups("tp", indices=[1, -3]),
        ValueError,
        "indices for axis 'tp' must be distinct",
    ),
    (
        "indices empty",
        lambda: L.groups("tp", indices=[]),
        ValueError,
        "indices for axis 'tp' must not be empty",
    ),
    (
        "indices nested empty",
        lambda: L.group((0, 0, 0), ("dp", "tp"), [[0], []]),
        ValueError,
        "indices for axis 'tp' must not be empty",
    ),
    ("indices int", lambda: L.groups("tp", indices=5), TypeError, "indices must be a sequence"),
    (
        "indices float",
        lambda: L.groups("tp", indices=[0.5]),
        TypeError,
        "indices must contain only ints",
    ),
    ("indices str", lambda: L.groups("tp", indices="01"), TypeError, "indices must be a sequence"),
    # coordinates
    (
        "coord short",
        lambda: L.ravel((0, 0)),
        ValueError,
        r"coord must have 3 entries for shape \(2, 3, 4\)",
    ),
    ("coord long", lambda: L.ravel((0, 0, 0, 0)), ValueError, "coord must have 3 entries"),
    (
        "coord long wrap",
        lambda: L.ravel((0, 0, 0, 9), mode="wrap"),
        ValueError,
        "coord must have 3 entries",
    ),
    (
        "coord short clip",
        lambda: L.ravel((0, 0), mode="clip"),
        ValueError,
        "coord must have 3 entries",
    ),
    (
        "coord high",
        lambda: L.ravel((2, 0, 0)),
        CoordinateError,
        r"coord \(2, 0, 0\) is out of bounds",
    ),
    ("coord negative", lambda: L.ravel((0, -1, 0)), CoordinateError, "coord .* is out of bounds"),
    ("group coord", lambda: L.group((0, 3, 0), "tp"), CoordinateError, "coord .* is out of bounds"),
    ("group coord len", lambda: L.group((0, 0), "tp"), ValueError, "coord must have 3 entries"),
    ("sub coord", lambda: L.sub((0, 0, 4), "dp"), CoordinateError, "coord .* is out of bounds"),
    ("coord bool", lambda: L.ravel((0, 0, True)), TypeError, "coord must contain only ints"),
    ("coord int", lambda: L.ravel(5), TypeError, "coord must be a sequence of ints"),
    ("rank absent", lambda: L.unravel(24), CoordinateError, "rank 24 is not in"),
    ("rank negative", lambda: L.unravel(-1), CoordinateError, "rank -1 is not in"),
    ("rank float", lambda: L.unravel(1.0), TypeError, "rank must be an int"),
    ("rank bool", lambda: L.unravel(True), TypeError, "rank must be an int"),
    # ravel mode
    ("mode", lambda: L.ravel((0, 0, 0), mode="wrapp"), ValueError, "mode must be one of"),
    ("mode None", lambda: L.ravel((0, 0, 0), mode=None), ValueError, "mode must be one of"),
    # getitem keys
    ("key high", lambda: L[2], IndexError, "index 2 is out of range for axis 'dp' of size 2"),
    ("key low", lambda: L[:, -4], IndexError, "index -4 is out of range for axis 'pp'"),
    ("key many", lambda: L[0, 0, 0, 0], IndexError, "too many indices: 4 for a layout with 3 axes"),
    ("key many ellipsis", lambda: L[0, ..., 0, 0, 0], IndexError, "too many indices"),
    ("key ellipses", lambda: L[..., ...], IndexError, "single ellipsis"),
    ("key float", lambda: L[1.0], TypeError, "layout indices must be ints"),
    ("key None", lambda: L[None], TypeError, "layout indices must be ints"),
    ("key list", lambda: L[[0, 1]], TypeError, "layout indices must be ints"),
    ("key name", lambda: L["dp"], TypeError, "layout indices must be ints"),
    ("key step 0", lambda: L[::0], ValueError, "slice step must not be zero"),
    ("key slice float", lambda: L[0.5:], TypeError, "slice parts must be ints"),
    ("key empty slice", lambda: L[5:], IndexError, "slice .* selects no position of axis 'dp'"),
    ("key empty back", lambda: L[:, 0:2:-1], IndexError, "selects no position of axis 'pp'"),
    (
        "key unknown",
        lambda: L[{"tpp": 0}],
        AxisError,
        f"unknown key 'tpp'; this mesh's axes are {AXES}",
    ),
    ("key axis range", lambda: L[{3: 0}], AxisError, "key 3 is out of range"),
    ("key value", lambda: L[{"tp": 9}], IndexError, "index 9 is out of range for axis 'tp'"),
    ("key value type", lambda: L[{"tp": "x"}], TypeError, "layout indices must be ints"),
    ("key twice", lambda: L[{"dp": 0, 0: 1}], ValueError, "key names axis 'dp' more than once"),
    (
        "key twice neg",
        lambda: L[{2: 0, -1: slice(None)}],
        ValueError,
        "key names axis 'tp' more than once",
    ),
    ("iterate", lambda: iter(L), TypeError, "MeshLayout is not iterable"),
]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [pytest.param(call, error, message, id=name) for name, call, error, message in BAD_INPUT],
)
def test_bad_input_names_the_argument(
    call: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        call()
    assert type(info.value) is not AssertionError
    assert str(info.value)


GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-30, 30),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.just(Ellipsis),
    st.builds(slice, st.none() | st.integers(-5, 5), st.none() | st.integers(-5, 5)),
    st.lists(st.integers(-5, 5) | st.sampled_from(["dp", "tp", "x"]), max_size=4),
    st.tuples(st.integers(-5, 5), st.integers(-5, 5), st.integers(-5, 5)),
    st.lists(st.lists(st.integers(-5, 5), max_size=3), max_size=3),
    st.dictionaries(st.sampled_from(["dp", "tp", "x", 0, -1, 7]), st.integers(-5, 5), max_size=2),
)

CALLS: list[Callable[[object, object], object]] = [
    lambda a, b: Layout(a),
    lambda a, b: Layout((2, 2), names=a),
    lambda a, b: Layout((-1, 2), ranks=a),
    lambda a, b: L.ravel(a),
    lambda a, b: L.ravel((0, 1, 2), mode=a),
    lambda a, b: L.ravel(a, mode="wrap"),
    lambda a, b: L.unravel(a),
    lambda a, b: L.group(a, b),
    lambda a, b: L.group((1, 2, 3), a, b),
    lambda a, b: L.groups(a, b),
    lambda a, b: L.sub(a, b),
    lambda a, b: L.sub((1, 2, 3), a),
    lambda a, b: L.axis_index(a),
    lambda a, b: L[a],
    lambda a, b: L[a, b],
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(CALLS))), GARBAGE, GARBAGE)
def test_garbage_gets_a_standard_error_with_a_message(which: int, a: object, b: object) -> None:
    try:
        CALLS[which](a, b)
    except (TypeError, ValueError, IndexError, KeyError) as error:
        assert str(error), f"{type(error).__name__} without a message"


# ------------------------------------------------------------------- scale

BIG = (2**10,) * 4  # 2**40 ranks: anything O(world) would never finish.


def test_no_world_sized_work_on_a_2_40_rank_layout() -> None:
    big = MeshLayout(BIG, names=("a", "b", "c", "d"))
    coord = (3, 1023, 0, 512)

    def rank(c: Sequence[int]) -> int:
        return c_position(c, BIG)

    assert big.size == 2**40
    assert big.ravel(coord) == rank(coord)
    assert big.unravel(2**40 - 1) == (1023,) * 4
    assert big.group(coord, "c") == tuple(rank((3, 1023, i, 512)) for i in range(1024))
    assert big.group(coord, ("d", "a"), indices=[[0, -1], [-1, 0]]) == tuple(
        sorted(rank((a, 1023, 0, d)) for a in (0, 1023) for d in (0, 1023))
    )
    sub = big.sub(coord, ("d", "b"))
    assert sub.shape == (1024, 1024) and sub.names == ("d", "b")
    assert sub.ravel((5, 7)) == rank((3, 7, 0, 5))
    assert sub.unravel(rank((3, 9, 0, 1000))) == (1000, 9)
    view = big[1, ..., ::-3]
    assert view.shape == (1024, 1024, 342)
    assert view.ravel((2, 4, 1)) == rank((1, 2, 4, 1020))
    assert view.unravel(rank((1, 2, 4, 1020))) == (2, 4, 1)
    assert view[{"b": 2}].group((4, 1), "d") == tuple(
        sorted(rank((1, 2, 4, d)) for d in range(1023, -1, -3))
    )
    assert big[1, ..., ::-3] == view and hash(big[1, ..., ::-3]) == hash(view)
    assert pickle.loads(pickle.dumps(view)) == view
    strided = MeshLayout((2**20, -1), ranks=range(5, 5 + 3 * 2**40, 3))
    assert strided.shape == (2**20, 2**20)
    assert strided.group((7, 9), 0, indices=[0, -1]) == (
        5 + 3 * 9,
        5 + 3 * ((2**20 - 1) * 2**20 + 9),
    )
    assert strided.unravel(5 + 3 * (2**20 + 2)) == (1, 2)


def test_a_2_20_rank_table_answers_by_hand() -> None:
    shape = (2**10, 2**10)
    table = [(i * 7919) % 2**20 for i in range(2**20)]  # 7919 is odd: a permutation
    layout = MeshLayout(shape, names=("dp", "tp"), ranks=table)
    coord = (17, 300)
    assert layout.ravel(coord) == table[17 * 1024 + 300]
    assert layout.group(coord, "dp") == tuple(sorted(table[i * 1024 + 300] for i in range(1024)))
    assert layout.sub(coord, "tp").ranks == tuple(table[17 * 1024 : 18 * 1024])
    assert layout[:, 300][::-2].ranks == tuple(table[i * 1024 + 300] for i in range(1023, -1, -2))
    assert layout.unravel(table[5 * 1024 + 6]) == (5, 6)
    assert layout[5].unravel(table[5 * 1024 + 6]) == (6,)
    assert layout[5] == MeshLayout((1024,), names=("tp",), ranks=table[5 * 1024 : 6 * 1024])
