"""Tests for scopedmesh.plan.svg (``scopedmesh plan --svg``): valid SVG whose facts match ``--json``."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scopedmesh.plan.cli import main
from scopedmesh.plan.svg import NODE_COLOURS

SVG = "{http://www.w3.org/2000/svg}"


def _cli(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    assert code == 0, err.getvalue()
    return out.getvalue()


def _cells(svg: str) -> list[dict[str, Any]]:
    """Every rank cell of the picture: its attributes, label, fill and tooltip."""
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    assert root.tag == f"{SVG}svg"
    cells = []
    for g in root.iter(f"{SVG}g"):
        if g.get("class") != "rank":
            continue
        rect, text, title = g.find(f"{SVG}rect"), g.find(f"{SVG}text"), g.find(f"{SVG}title")
        assert rect is not None and text is not None and title is not None
        cells.append({**g.attrib, "label": text.text, "fill": rect.get("fill"), "tip": title.text})
    return cells


def _swatches(svg: str) -> dict[int, str]:
    root = ET.fromstring(svg)
    return {
        int(r.get("data-node", "-1")): r.get("fill", "")
        for r in root.iter(f"{SVG}rect")
        if r.get("class") == "swatch"
    }


def _check(argv: list[str]) -> tuple[list[dict[str, Any]], Any]:
    """Check the picture of ``plan argv`` against ``plan argv --json``; return both."""
    doc = json.loads(_cli(*argv, "--json"))
    svg = _cli(*argv, "--svg", "-")
    cells = _cells(svg)
    strides = doc["strides"]
    for cell in cells:
        rank = int(cell["data-rank"])
        assert cell["label"] == str(rank)
        coord = tuple(int(c) for c in re.findall(r"\d+", cell["tip"].split("(")[1].split(")")[0]))
        assert (
            sum(c * s for c, s in zip(coord, strides)) == rank
        )  # the label sits at its coordinate
    ranks = [int(c["data-rank"]) for c in cells]
    assert len(ranks) == len(set(ranks))
    if doc["full"]:  # every rank, in the order of the grid (C order)
        assert ranks == list(range(doc["world"]))
    else:
        assert len(ranks) <= 3 * 8 * 16 and set(ranks) <= set(range(doc["world"]))
    nproc = doc["nproc_per_node"]
    swatches = _swatches(svg)
    if nproc is None:
        assert swatches == {} and all("data-node" not in c for c in cells)
    else:
        assert len(swatches) == min(doc["nodes"], len(NODE_COLOURS))
        for cell in cells:
            node = int(cell["data-node"])
            assert node == int(cell["data-rank"]) // nproc
            assert cell["fill"] == swatches[node % len(NODE_COLOURS)]
        assert len({c["fill"] for c in cells}) == len({int(c["data-node"]) % 10 for c in cells})
    if doc["rank"] is not None:
        for group in doc["rank"]["groups"]:
            label = ",".join(group["axes"])
            inside = {int(c["data-rank"]) for c in cells if label in c["data-in"].split()}
            assert inside == set(group["ranks"]) & set(ranks)
    else:
        assert all("data-in" not in c for c in cells)
    return cells, doc


@pytest.mark.parametrize(
    "argv",
    [
        ["2", "2", "2", "--names", "dp", "pp", "tp", "--nproc-per-node", "4", "--rank", "5"],
        ["2", "2", "2"],
        ["6"],
        ["2", "3", "4", "--nproc-per-node", "5", "--rank", "17", "--axis", "0,2"],
        ["8", "8", "16", "--names", "dp", "pp", "tp", "--nproc-per-node", "8", "--rank", "77"],
        ["1024", "--nproc-per-node", "8", "--rank", "500"],
        ["4", "256", "--names", "dp", "tp", "--rank", "300", "--axis", "dp,tp"],
        ["2", "2", "2", "--names", "a<b", "p&q", 'x"y', "--rank", "0"],  # escaped
    ],
)
def test_svg_parses_and_its_facts_match_json(argv: list[str]) -> None:
    _check(argv)


def test_summary_at_1024_ranks_shows_grids_like_the_text_view() -> None:
    cells, doc = _check(["8", "8", "16", "--names", "dp", "pp", "tp", "--nproc-per-node", "8"])
    assert not doc["full"]
    # dp=0, dp=1 and dp=7, each with every row and column: 3 grids of 8 x 16.
    ranks = [int(c["data-rank"]) for c in cells]
    assert ranks == [*range(256), *range(896, 1024)]
    svg = _cli("8", "8", "16", "--names", "dp", "pp", "tp", "--svg", "-")
    assert "… 5 more grids …" in svg and "--full shows all 1024 ranks" in svg


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    nproc=st.none() | st.integers(1, 12),
    pick=st.none() | st.integers(0, 10**6),
)
def test_svg_facts_match_json_for_any_small_plan(
    shape: list[int], nproc: int | None, pick: int | None
) -> None:
    world = 1
    for n in shape:
        world *= n
    argv = [str(n) for n in shape]
    if nproc is not None:
        argv += ["--nproc-per-node", str(nproc)]
    if pick is not None:
        argv += ["--rank", str(pick % world)]
    _check(argv)


def test_svg_file_beside_the_text_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "plan.svg"
    assert main(["plan", "2", "2", "--svg", str(target)]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("mesh axis0=2 x axis1=2: 4 ranks")
    assert len(_cells(target.read_text())) == 4
    assert main(["plan", "2", "2", "--svg", str(tmp_path / "missing" / "plan.svg")]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("scopedmesh plan: error: --svg ") and err.count("\n") == 1


def test_svg_needs_no_torch() -> None:
    code = (
        "import sys; from scopedmesh.plan.cli import main; "
        "main(['plan', '2', '2', '--svg', '-']); assert 'torch' not in sys.modules"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("<svg")


def test_the_plan_page_picture_is_what_the_cli_draws() -> None:
    root = Path(__file__).resolve().parents[2]
    readme = (root / "docs" / "plan.md").read_text()
    match = re.search(r"!\[scopedmesh (plan [^\]]*)\]\(plan\.svg\)", readme)
    assert match is not None
    drawn = _cli(*match.group(1).split()[1:], "--svg", "-")
    assert drawn == (root / "docs" / "plan.svg").read_text()
