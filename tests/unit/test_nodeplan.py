"""``scopedmesh plan ... --intra-node``: the node-aware table, its text and its JSON."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scopedmesh.layout import MeshLayout
from scopedmesh.layout.placement import node_aware_ranks
from scopedmesh.plan.cli import main
from scopedmesh.testing.strategies import shapes

BASE = ["plan", "2", "2", "2", "--names", "dp", "pp", "tp", "--nproc-per-node", "4"]


def test_text_shows_the_node_aware_grid_and_where_each_axis_sits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*BASE, "--intra-node", "dp,tp"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("node-aware layout") :]
    assert section == (
        "node-aware layout: dp, tp inside a node (node = rank // 4)\n"
        "\n"
        "dp=0\n"
        "  pp \\ tp | 0  1\n"
        "  --------+-----\n"
        "        0 | 0  1\n"
        "        1 | 4  5\n"
        "\n"
        "dp=1\n"
        "  pp \\ tp | 0  1\n"
        "  --------+-----\n"
        "        0 | 2  3\n"
        "        1 | 6  7\n"
        "\n"
        "dp     intra-node\n"
        "       [0, 2]  [1, 3]  [4, 6]  [5, 7]\n"
        "pp     cross-node: each group spans 2 nodes\n"
        "       [0, 4]  [1, 5]  [2, 6]  [3, 7]\n"
        "tp     intra-node\n"
        "       [0, 1]  [4, 5]  [2, 3]  [6, 7]\n"
        "dp,tp  intra-node\n"
        "       [0, 1, 2, 3]  [4, 5, 6, 7]\n"
    )
    assert main(BASE) == 0
    assert "node-aware" not in capsys.readouterr().out  # nothing changes without the option


@given(shapes(max_axes=4, max_world=64), st.data())
def test_json_is_the_placement_table_and_its_facts(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    world = math.prod(shape)
    intra = sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
    block = math.prod(shape[a] for a in intra)
    nproc = block * data.draw(
        st.sampled_from([f for f in range(1, world // block + 1) if world // block % f == 0])
    )
    args = ["plan", *map(str, shape), "--nproc-per-node", str(nproc), "--json"]
    args += ["--intra-node", ",".join(map(str, intra))]
    out = _run(args)
    aware = out["node_aware"]
    table = node_aware_ranks(shape, [r // nproc for r in range(world)], intra)
    assert aware["ranks"] == list(table)
    assert aware["intra_node"] == [f"axis{a}" for a in intra]
    layout = MeshLayout(shape, ranks=table)
    for entry in aware["axes"]:
        axes = tuple(int(label[4:]) for label in entry["axes"])
        groups = [list(g) for g in layout.groups(axes)]
        assert entry["groups"] == groups
        spans = [len({r // nproc for r in g}) for g in groups]
        assert entry["span"] == [min(spans), max(spans)]
        if set(axes) <= set(intra):
            assert entry["placement"] == "intra-node"


def _run(args: list[str]) -> dict[str, object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    result: dict[str, object] = json.loads(out.getvalue())
    return result


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "2", "4", "--intra-node", "1"], "--intra-node needs --nproc-per-node"),
        ([*BASE, "--intra-node", "tpp"], "unknown axis 'tpp' in --intra-node tpp; the axes are dp, pp, tp"),
        ([*BASE, "--intra-node", "tp,tp"], "--intra-node must name distinct axes, got tp,tp"),
        ([*BASE[:-1], "3", "--intra-node", "tp"], "8 ranks is not a multiple of --nproc-per-node 3"),
        ([*BASE[:-1], "2", "--intra-node", "dp,tp"], "hold 4 ranks but a node holds only 2 ranks"),
    ],
)  # fmt: skip
def test_bad_requests_are_one_error_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("scopedmesh plan: error: ") and message in err and err.count("\n") == 1


def test_the_nodes_page_shows_what_the_cli_prints() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "nodes.md").read_text()
    block = re.search(
        r"```console\n\$ \.venv/bin/python -m (scopedmesh plan [^\n]*--intra-node[^\n]*)\n"
        r"\.\.\.\n(.*?)```",
        readme,
        re.S,
    )
    assert block is not None
    run = subprocess.run(
        [sys.executable, "-m", *block.group(1).split()], capture_output=True, text=True, check=True
    )
    assert run.stdout.endswith(block.group(2)) and block.group(2).startswith("node-aware layout")
