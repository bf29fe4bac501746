"""Node-aware rank tables, checked against a brute-force construction and by their laws."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn

from scopedmesh.layout import MeshLayout
from scopedmesh.layout.placement import node_aware_ranks, node_numbers, nodes_from_env
from scopedmesh.testing.strategies import shapes

Case = tuple[tuple[int, ...], tuple[int, ...], list[Hashable]]


@st.composite
def cases(draw: DrawFn, max_world: int = 48) -> Case:
    """A shape, its intra-node axes, and node labels (any order) with whole blocks a node."""
    shape = draw(shapes(max_axes=4, max_world=max_world))
    intra = tuple(a for a in range(len(shape)) if draw(st.booleans()))
    world, block = math.prod(shape), math.prod(shape[a] for a in intra)
    fill = draw(
        st.sampled_from([f for f in range(1, world // block + 1) if world // block % f == 0])
    )
    per_node = block * fill
    nodes = [r // per_node for r in range(world)]
    nodes = draw(st.permutations(nodes))
    labels = draw(st.sampled_from([lambda n: n, lambda n: f"host-{n * 7 % 101}", lambda n: -n]))
    return shape, intra, [labels(n) for n in nodes]


def reference(shape: Sequence[int], intra: Sequence[int], nodes: Sequence[Hashable]) -> list[int]:
    """Move the intra-node axes innermost, lay out C order over the ranks sorted node by node
    (nodes by lowest rank), then move the axes back."""
    first: dict[Hashable, int] = {}
    for r, label in enumerate(nodes):
        first.setdefault(label, r)
    ordered = sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r))
    order = [a for a in range(len(shape)) if a not in intra] + list(intra)
    moved = [shape[a] for a in order]
    table = []
    for coord in itertools.product(*map(range, shape)):
        position = 0
        for a, n in zip(order, moved):
            position = position * n + coord[a]
        table.append(ordered[position])
    return table


@given(cases())
def test_matches_the_reference_and_keeps_intra_groups_on_one_node(case: Case) -> None:
    shape, intra, nodes = case
    table = node_aware_ranks(shape, nodes, list(intra))
    assert list(table) == reference(shape, intra, nodes)
    assert sorted(table) == list(range(len(nodes)))
    layout = MeshLayout(shape, ranks=table)
    for size in range(1, len(intra) + 1):
        for axes in itertools.combinations(intra, size):  # each intra axis, and any together
            for group in layout.groups(axes):
                assert len({nodes[r] for r in group}) == 1, (axes, group)


@given(cases())
def test_other_axes_keep_c_order_node_by_node(case: Case) -> None:
    shape, intra, nodes = case
    table = node_aware_ranks(shape, nodes, list(intra))
    numbers = node_numbers(nodes)
    layout = MeshLayout(shape, ranks=table)
    outer = tuple(a for a in range(len(shape)) if a not in intra)
    if not outer:
        return
    for group in layout.groups(outer):  # listed ascending by rank: reorder by C order
        coords = sorted(layout.unravel(r) for r in group)
        keys = [(numbers[layout.ravel(c)], layout.ravel(c)) for c in coords]
        assert keys == sorted(keys)


@given(cases())
def test_torchrun_order_with_trailing_intra_axes_is_the_default_table(case: Case) -> None:
    shape, _, nodes = case
    per_node = len(nodes) // len(set(nodes))
    ordered = [r // per_node for r in range(len(nodes))]
    for count in range(len(shape) + 1):
        trailing = tuple(range(len(shape) - count, len(shape)))
        if per_node % math.prod(shape[a] for a in trailing) == 0:
            assert node_aware_ranks(shape, ordered, trailing) == tuple(range(len(nodes)))


@settings(max_examples=60)
@given(shapes(max_axes=3, max_world=6), st.data())
def test_errors_exactly_when_no_table_exists(shape: tuple[int, ...], data: st.DataObject) -> None:
    """Brute force over every rank table: one keeps the intra axes on nodes iff no error."""
    world = math.prod(shape)
    intra = tuple(a for a in range(len(shape)) if data.draw(st.booleans()))
    nodes = data.draw(st.lists(st.integers(0, 2), min_size=world, max_size=world))
    equal = len(set(map(nodes.count, set(nodes)))) == 1
    possible = equal and (
        not intra
        or any(
            all(
                len({nodes[r] for r in group}) == 1
                for group in MeshLayout(shape, ranks=table).groups(intra)
            )
            for table in itertools.permutations(range(world))
        )
    )
    try:
        node_aware_ranks(shape, nodes, intra)
    except ValueError:
        assert not possible
    else:
        assert possible


def test_examples_by_name() -> None:
    names = ("dp", "pp", "tp")
    two_nodes = [0] * 4 + [1] * 4
    assert node_aware_ranks((2, 2, 2), two_nodes, "tp", names=names) == tuple(range(8))
    assert node_aware_ranks((2, 2, 2), two_nodes, ("tp", "dp"), names=names) == (
        0, 1, 4, 5, 2, 3, 6, 7,
    )  # fmt: skip
    interleaved = [r % 2 for r in range(8)]  # a launcher that deals ranks round-robin
    assert node_aware_ranks((2, 2, 2), interleaved, ("pp", "tp"), names=names) == (
        0, 2, 4, 6, 1, 3, 5, 7,
    )  # fmt: skip
    assert node_aware_ranks((2, 2, 2), interleaved, (), names=names) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert node_aware_ranks((-1, 4), ["a"] * 4 + ["b"] * 4, -1) == tuple(range(8))


@pytest.mark.parametrize(
    ("shape", "nodes", "intra", "message"),
    [
        ((2, 4), [0] * 4 + [1] * 4, (0, 1), "axis0=2 x axis1=4) hold 8 ranks but a node holds only 4"),
        ((2, 3), [0] * 4 + [1] * 2, 1, "ranks per node (numbered by lowest rank) are {0: 4, 1: 2}"),
        ((3, 4), [0] * 6 + [1] * 6, 1, "hold 4 ranks but a node holds 6 ranks; a node must hold a multiple of 4"),
        ((2, 2, 2), [0] * 6, 0, "shape (2, 2, 2) holds 8 ranks but nodes lists 6 ranks"),
        ((-1, 4), [0] * 6, 1, "cannot infer the -1"),
    ],
)  # fmt: skip
def test_impossible_requests_name_the_numbers(
    shape: tuple[int, ...], nodes: list[int], intra: object, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        node_aware_ranks(shape, nodes, intra)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="nodes must be a sequence"):
        node_aware_ranks((2,), "ab", 0)
    with pytest.raises(TypeError, match="node labels must be hashable"):
        node_aware_ranks((2,), [[0], [1]], 0)
    with pytest.raises(ValueError, match="unknown intra_node 'tpp'; this mesh's axes are"):
        node_aware_ranks((2, 2), [0, 0, 1, 1], "tpp", names=("dp", "tp"))


def torchrun_env(rank: int, nnodes: int, nproc: int) -> dict[str, str]:
    """What torchrun sets for global rank ``rank`` with ``nproc`` workers on each node."""
    values = {
        "RANK": rank,
        "WORLD_SIZE": nnodes * nproc,
        "LOCAL_RANK": rank % nproc,
        "LOCAL_WORLD_SIZE": nproc,
        "GROUP_RANK": rank // nproc,
        "GROUP_WORLD_SIZE": nnodes,
    }
    return {key: str(value) for key, value in values.items()}


@given(st.integers(1, 5), st.integers(1, 5), st.data())
def test_nodes_from_env_agree_on_every_rank(nnodes: int, nproc: int, data: st.DataObject) -> None:
    world = nnodes * nproc
    expected = tuple(r // nproc for r in range(world))
    rank = data.draw(st.integers(0, world - 1))
    assert nodes_from_env(torchrun_env(rank, nnodes, nproc)) == expected


def test_nodes_from_env_refuses_what_it_cannot_derive() -> None:
    assert nodes_from_env({}) is None
    assert nodes_from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}) is None
    bad = torchrun_env(5, 2, 4) | {"GROUP_RANK": "0"}
    with pytest.raises(ValueError, match="RANK = GROUP_RANK \\* LOCAL_WORLD_SIZE"):
        nodes_from_env(bad)
    uneven = torchrun_env(1, 2, 2) | {"WORLD_SIZE": "6", "GROUP_WORLD_SIZE": "2"}  # 2 + 4 workers
    with pytest.raises(ValueError, match="GROUP_WORLD_SIZE=2"):
        nodes_from_env(uneven)
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer, got 'x'"):
        nodes_from_env(torchrun_env(0, 1, 2) | {"LOCAL_RANK": "x"})
    with pytest.raises(ValueError, match="inconsistent"):
        nodes_from_env(torchrun_env(0, 1, 2) | {"LOCAL_RANK": "2"})


def test_import_placement_leaves_torch_out() -> None:
    code = "import sys, scopedmesh.layout.placement; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
