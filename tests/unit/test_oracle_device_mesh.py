"""MeshLayout's groups agree with torch's DeviceMesh, rank by rank.

Every 1-3 axis shape with at most 16 ranks, plus a few 4-axis shapes. For each
shape, every rank of a ``fake`` world asks ``init_device_mesh`` for its group along
each axis and along each pair of axes (by flattening the pair); the layout must
name the same ranks in the same order. The rows of ``dm.mesh`` along each axis
check the whole partition and its order. Torch runs in a few subprocesses
(see ``_device_mesh_oracle.py``), run side by side; this process never imports it.

The shapes of at most 8 ranks run in the README's command; the larger ones
(four fifths of the oracle's meshes, one per rank) in the launch lane.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from scopedmesh.layout import MeshLayout

HERE = Path(__file__).resolve().parent
PROCESSES = 3
TIMEOUT = 300.0


def _shapes_up_to(world: int, ndim: int) -> list[tuple[int, ...]]:
    return [
        shape
        for shape in itertools.product(range(1, world + 1), repeat=ndim)
        if math.prod(shape) <= world
    ]


SHAPES: list[tuple[int, ...]] = [
    *_shapes_up_to(16, 1),
    *_shapes_up_to(16, 2),
    *_shapes_up_to(16, 3),
    (2, 2, 2, 2),
    (1, 2, 3, 2),
    (3, 1, 2, 2),
    (2, 2, 1, 4),
    (2, 3, 2, 2),
    (2, 1, 2, 2),  # a four-axis shape of 8 ranks, for the README's command
]
FEW_RANKS = 8  # shapes of at most this many ranks run in the README's command
GROUPS: dict[str, list[tuple[int, ...]]] = {
    "few": [shape for shape in SHAPES if math.prod(shape) <= FEW_RANKS],
    "many": [shape for shape in SHAPES if math.prod(shape) > FEW_RANKS],
}
LANE = {"few": (), "many": (pytest.mark.launch,)}  # the larger shapes: the launch lane


def _group_of(shape: tuple[int, ...]) -> str:
    return "few" if math.prod(shape) <= FEW_RANKS else "many"


# torch 2.9 (measured on 2.9.1; not on 2.12.1 and later): the oracle probes one fake
# world per rank and shape in one process, and once a world has been destroyed,
# flattening a pair of axes may name a group that is not registered ("Could not
# resolve the process group registered under the name ..."). A torch limitation of
# the oracle, not of the mesh: there, the whole pair partitions (from the mesh
# tensor) are still checked; on every other release every rank's pairs must flatten.
RELEASE = tuple(int(part) for part in re.findall(r"\d+", version("torch"))[:2])  # no torch import
FLATTEN_MAY_FAIL = RELEASE == (2, 9)


def _key(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


@pytest.fixture(scope="module")
def device_mesh(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """A group's ("few" or "many") DeviceMesh answers by shape, probed on first use."""
    answers: dict[str, dict[str, Any]] = {}

    def probe(group: str) -> dict[str, Any]:
        if group not in answers:
            answers[group] = _probe(GROUPS[group], tmp_path_factory.mktemp(f"device_mesh_{group}"))
        return answers[group]

    return probe


def _probe(shapes: list[tuple[int, ...]], out_dir: Path) -> dict[str, Any]:
    """Every shape's DeviceMesh answers, gathered by a few concurrent subprocesses."""
    # Deal shapes out by cost (one mesh per rank), largest first, to the cheapest chunk.
    chunks: list[list[tuple[int, ...]]] = [[] for _ in range(PROCESSES)]
    costs = [0] * PROCESSES
    for shape in sorted(shapes, key=math.prod, reverse=True):
        cheapest = costs.index(min(costs))
        chunks[cheapest].append(shape)
        costs[cheapest] += math.prod(shape)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for i, chunk in enumerate(chunks):
        out = out_dir / f"chunk{i}.json"
        args = [sys.executable, str(HERE / "_device_mesh_oracle.py"), json.dumps(chunk), str(out)]
        procs.append((out, subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)))
    records: dict[str, Any] = {}
    try:
        for out, proc in procs:
            _, err = proc.communicate(timeout=TIMEOUT)
            if proc.returncode == 77:
                pytest.skip("this torch has no fake process-group backend")
            assert proc.returncode == 0, f"oracle subprocess failed:\n{err}"
            records.update(json.loads(out.read_text()))
    finally:
        for _, proc in procs:  # only on failure: a timeout, a skip or a failed chunk
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return records


def test_the_groups_share_out_every_shape() -> None:
    # 16 one-axis shapes, sum of d(W) = 50 two-axis, sum of d3(W) = 110 three-axis, 6 four-axis.
    assert len(SHAPES) == len(set(SHAPES)) == 16 + 50 + 110 + 6
    assert sorted(GROUPS["few"] + GROUPS["many"]) == sorted(SHAPES)
    assert {len(shape) for shape in GROUPS["few"]} == {1, 2, 3, 4}


@pytest.mark.parametrize("group", [pytest.param(g, marks=LANE[g]) for g in GROUPS])
def test_every_shape_was_probed_at_every_rank(
    device_mesh: Callable[[str], dict[str, Any]], group: str
) -> None:
    answers = device_mesh(group)
    assert sorted(answers) == sorted(_key(s) for s in GROUPS[group])
    for shape in GROUPS[group]:
        record = answers[_key(shape)]
        assert [entry["rank"] for entry in record["ranks"]] == list(range(math.prod(shape)))


@pytest.mark.parametrize(
    "shape", [pytest.param(s, marks=LANE[_group_of(s)], id=_key(s)) for s in SHAPES]
)
def test_groups_match_device_mesh(
    device_mesh: Callable[[str], dict[str, Any]], shape: tuple[int, ...]
) -> None:
    record = device_mesh(_group_of(shape))[_key(shape)]
    layout = MeshLayout(shape, names=tuple(f"ax{i}" for i in range(len(shape))))
    assert record["mesh"] == list(layout.ranks)
    pairs = list(itertools.combinations(range(len(shape)), 2))
    # The whole partition along each axis and pair of axes, in torch's order.
    for axis, rows in enumerate(record["rows"]):
        assert [tuple(row) for row in rows] == list(layout.groups(axis)), f"axis {axis}"
        assert layout.groups(f"ax{axis}") == layout.groups(axis)
    for i, j in pairs:
        rows = record["pair_rows"][f"{i},{j}"]
        assert [tuple(row) for row in rows] == list(layout.groups((i, j))), f"axes {(i, j)}"
    # Each rank's own groups, as its process groups list them.
    for entry in record["ranks"]:
        coord = layout.unravel(entry["rank"])
        for axis, members in enumerate(entry["single"]):
            assert tuple(members) == layout.group(coord, axis), (entry["rank"], axis)
        for i, j in pairs:
            members = entry["pairs"][f"{i},{j}"]
            if members is None:  # torch could not flatten (see FLATTEN_MAY_FAIL)
                assert FLATTEN_MAY_FAIL, (entry["rank"], (i, j))
                continue
            assert tuple(members) == layout.group(coord, (f"ax{j}", i)), (entry["rank"], (i, j))
