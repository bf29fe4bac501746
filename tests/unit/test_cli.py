"""Tests for scopedmesh.plan.cli (``scopedmesh plan``): facts checked against brute force."""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scopedmesh
from scopedmesh.plan.cli import main

ROOT = Path(scopedmesh.__file__).resolve().parent.parent


# ----------------------------------------------------------- the reference


def strides_of(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[a + 1 :]) for a in range(len(shape))]


def rank_at(shape: Sequence[int], coord: Sequence[int]) -> int:
    return sum(c * s for c, s in zip(coord, strides_of(shape)))


def brute_groups(shape: Sequence[int], axes: Sequence[int]) -> list[list[int]]:
    """Every group along ``axes``: ascending ranks, in C order of the other axes."""
    return [list(g) for g in _brute_groups(tuple(shape), tuple(axes))]


@functools.lru_cache(maxsize=64)
def _brute_groups(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for coord in itertools.product(*map(range, shape)):
        key = tuple(c for a, c in enumerate(coord) if a not in axes)
        groups.setdefault(key, []).append(rank_at(shape, coord))
    return tuple(tuple(sorted(groups[key])) for key in sorted(groups))


def brute_nodes(groups: list[list[int]], nproc: int) -> tuple[str, int, list[int]]:
    spans = [len({r // nproc for r in group}) for group in groups]
    crossing = sum(1 for n in spans if n > 1)
    placement = (
        "intra-node" if not crossing else "cross-node" if crossing == len(groups) else "mixed"
    )
    return placement, crossing, [min(spans), max(spans)]


def axis_sets(ndim: int) -> list[tuple[int, ...]]:
    return [c for k in range(1, ndim + 1) for c in itertools.combinations(range(ndim), k)]


# --------------------------------------------------------------- running it


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_quiet(*argv: str) -> tuple[int, str]:
    """``main`` without capsys (usable inside hypothesis tests)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    assert code == 0, err.getvalue()
    return code, out.getvalue()


def plan_json(*argv: str) -> Any:
    _, out = run_quiet(*argv, "--json")
    return json.loads(out)


def combos(ndim: int) -> list[str]:
    """``--axis`` options for every set of two or more axes, given by index."""
    result = []
    for axes in axis_sets(ndim):
        if len(axes) > 1:
            result += ["--axis", ",".join(map(str, axes))]
    return result


def check_document(doc: Any, shape: Sequence[int], nproc: int | None) -> None:
    """Every fact in a --json document (made with ``combos``) against brute force."""
    world = math.prod(shape)
    assert doc["shape"] == list(shape)
    assert doc["world"] == world
    assert doc["strides"] == strides_of(shape)
    assert [tuple(entry["indices"]) for entry in doc["axes"]] == axis_sets(len(shape))
    for entry in doc["axes"]:
        axes = entry["indices"]
        groups = brute_groups(shape, axes)
        assert entry["axes"] == [doc["labels"][a] for a in axes]
        assert entry["size"] == math.prod(shape[a] for a in axes)
        assert entry["count"] == len(groups)
        cut, omitted = entry["omitted_at"], entry["omitted"]
        assert entry["groups"][:cut] == groups[:cut]
        assert entry["groups"][cut:] == groups[len(groups) - len(entry["groups"]) + cut :]
        assert len(entry["groups"]) + omitted == len(groups)
        if doc["full"]:
            assert omitted == 0 and entry["groups"] == groups
        if nproc is None:
            assert entry["placement"] is None and entry["crossing"] is None
        else:
            placement, crossing, span = brute_nodes(groups, nproc)
            assert (entry["placement"], entry["crossing"]) == (placement, crossing)
            assert entry["span"] in (span, None)
            if len(axes) == 1:
                assert entry["span"] == span


# -------------------------------------------------------------------- facts

SHAPES = [(8,), (2, 3), (2, 2, 2), (2, 4, 8), (3, 1, 2, 2), (2, 3, 2, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_json_groups_and_grid_match_brute_force(shape: tuple[int, ...]) -> None:
    doc = plan_json(*map(str, shape), *combos(len(shape)))
    check_document(doc, shape, None)
    assert doc["full"] is True
    assert doc["names"] is None
    assert doc["labels"] == [f"axis{a}" for a in range(len(shape))]
    grid = doc["grid"]
    for coord in itertools.product(*map(range, shape)):
        cell = grid
        for c in coord:
            cell = cell[c]
        assert cell == rank_at(shape, coord)
    assert doc["rank"] is None and doc["warnings"] == []


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    nproc=st.integers(1, 12),
)
def test_node_placement_matches_brute_force(shape: list[int], nproc: int) -> None:
    doc = plan_json(*map(str, shape), *combos(len(shape)), "--nproc-per-node", str(nproc))
    check_document(doc, shape, nproc)
    world = math.prod(shape)
    assert doc["nproc_per_node"] == nproc
    assert doc["nodes"] == -(-world // nproc)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(2, 12), min_size=2, max_size=4).filter(
        lambda s: 64 < math.prod(s) <= 2000
    ),
    nproc=st.integers(1, 40),
    data=st.data(),
)
def test_summarised_worlds_list_true_groups(
    shape: list[int], nproc: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, math.prod(shape) - 1))
    argv = [*map(str, shape), *combos(len(shape)), "--nproc-per-node", str(nproc)]
    doc = plan_json(*argv, "--rank", str(rank))
    assert doc["full"] is False and doc["grid"] is None
    check_document(doc, shape, nproc)
    check_rank(doc, shape, rank, nproc)


def check_rank(doc: Any, shape: Sequence[int], rank: int, nproc: int | None) -> None:
    coord = [rank // s % n for n, s in zip(shape, strides_of(shape))]
    assert doc["rank"]["rank"] == rank
    assert rank_at(shape, coord) == rank
    assert doc["rank"]["coordinate"] == coord
    assert doc["rank"]["node"] == (None if nproc is None else rank // nproc)
    assert len(doc["rank"]["groups"]) == len(doc["axes"])
    for entry, mine in zip(doc["axes"], doc["rank"]["groups"]):
        group = next(g for g in brute_groups(shape, entry["indices"]) if rank in g)
        assert mine["axes"] == entry["axes"]
        assert mine["ranks"] == group
        assert mine["position"] == group.index(rank)
        if nproc is not None and mine["nodes"] is not None:
            assert mine["nodes"] == len({r // nproc for r in group})


def test_rank_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "2", "4", "8", "--names", "dp", "pp", "tp", "--rank", "13", "--json")
    assert code == 0
    check_rank(json.loads(out), (2, 4, 8), 13, None)


def test_large_groups_are_exact() -> None:
    """Groups above 4096 ranks are built from progressions: check them against brute force."""
    shape = (2, 3, 4096)
    rank = 5 * 4096 + 17
    doc = plan_json(*map(str, shape), "--axis", "0,2", "--axis", "1,2", "--rank", str(rank))
    by_axes = {tuple(e["indices"]): e for e in doc["axes"]}
    for axes in [(2,), (0, 2), (1, 2)]:
        groups = brute_groups(shape, axes)
        entry = by_axes[axes]
        assert (
            entry["groups"]
            == groups[: entry["omitted_at"]]
            + groups[len(groups) - len(entry["groups"]) + entry["omitted_at"] :]
        )
    check_rank(doc, shape, rank, None)


# --------------------------------------------------------------------- text


def grid_cells(text: str) -> list[tuple[str, list[str], str, list[str]]]:
    """Each grid row as (title, column labels, row label, cells), parsed from the text."""
    lines = text.splitlines()
    result = []
    title = ""
    for i, line in enumerate(lines):
        if re.fullmatch(r"\w+=\d+(, \w+=\d+)*", line):
            title = line
        if re.fullmatch(r"  -+\+-+", line):
            columns = lines[i - 1].split(" | ")[1].split()
            for row in itertools.takewhile(lambda s: " | " in s, lines[i + 1 :]):
                label, cells = row.split(" | ")
                result.append((title, columns, label.strip(), cells.split()))
    return result


@pytest.mark.parametrize(
    "shape", [(1,), (5,), (64,), (2, 32), (4, 4), (2, 2, 2), (2, 4, 8), (2, 2, 2, 2), (1, 3, 1, 2)]
)
def test_grid_shows_every_rank_once_at_its_coordinate(
    capsys: pytest.CaptureFixture[str], shape: tuple[int, ...]
) -> None:
    names = [f"n{a}" for a in range(len(shape))]
    code, out, err = run(capsys, *map(str, shape), "--names", *names)
    assert code == 0 and err == ""
    rows = grid_cells(out)
    seen = []
    for title, columns, label, cells in rows:
        lead = [int(part.split("=")[1]) for part in title.split(", ")] if title else []
        assert len(columns) == len(cells)
        for column, cell in zip(columns, cells):
            coord = [*lead, int(column)] if len(shape) == 1 else [*lead, int(label), int(column)]
            assert label == "rank" or len(shape) > 1
            assert int(cell) == rank_at(shape, coord)
            seen.append(int(cell))
    assert sorted(seen) == list(range(math.prod(shape)))


def test_full_shows_a_large_world_whole(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "2", "4", "16", "--names", "dp", "pp", "tp")
    assert code == 0 and "(summarised; --full shows all 128 ranks)" in out
    code, out, _ = run(capsys, "2", "4", "16", "--names", "dp", "pp", "tp", "--full")
    assert code == 0 and "summarised" not in out and ELLIPSIS not in out
    assert sorted(int(c) for *_, cells in grid_cells(out) for c in cells) == list(range(128))


ELLIPSIS = "…"


def test_title_and_group_lists(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "2", "4", "8", "--names", "dp", "pp", "tp")
    assert code == 0
    assert out.splitlines()[0] == "mesh dp=2 x pp=4 x tp=8: 64 ranks, rank = 32*dp + 8*pp + tp"
    lines = out.splitlines()
    at = lines.index("tp: 8 groups of 8 ranks")
    listed = re.findall(r"\[([\d, ]+)\]", "\n".join(lines[at + 1 : at + 5]))
    assert [[int(r) for r in g.split(",")] for g in listed] == brute_groups((2, 4, 8), [2])
    assert "dp: 32 groups of 2 ranks" in lines and "pp: 16 groups of 4 ranks" in lines


def test_rank_line_shows_coordinate_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["2", "4", "8", "--names", "dp", "pp", "tp", "--nproc-per-node", "8", "--rank", "13"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    first = next(line for line in lines if line.startswith("rank 13:"))
    assert first == "rank 13: coordinate (0, 1, 5) [dp=0, pp=1, tp=5], node 1"
    rows = {line.split()[0]: line for line in lines[lines.index(first) + 1 :] if line.strip()}
    assert "[13, 45]" in rows["dp"] and "position 0 of 2" in rows["dp"]
    assert "[5, 13, 21, 29]" in rows["pp"] and "position 1 of 4, spans 4 nodes" in rows["pp"]
    assert "[8, 9, 10, 11, 12, 13, 14, 15]" in rows["tp"]
    assert "position 5 of 8, inside node 1" in rows["tp"]


def node_table(out: str) -> dict[str, str]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("axis "))
    rows = itertools.takewhile(bool, lines[at + 1 :])
    return {row.split()[0]: row for row in rows}


def test_node_crossing_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["2", "4", "8", "--names", "dp", "pp", "tp", "--nproc-per-node"]
    code, out, _ = run(capsys, *base, "8")
    assert code == 0
    table = node_table(out)
    assert table["tp"].endswith("intra-node")
    assert "cross-node: each group spans 4 nodes" in table["pp"]
    assert "cross-node: each group spans 2 nodes" in table["dp"]
    assert "warning" not in out
    assert "nodes: 8 ranks per node, 8 nodes (node = rank // 8)" in out

    code, out, _ = run(capsys, *base, "4")
    assert code == 0
    assert "cross-node: each group spans 2 nodes" in node_table(out)["tp"]
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: tp groups cross nodes (each spans 2 nodes")
    assert "NVLink" in warnings[0]


def test_mixed_placement_and_last_axis_warning(capsys: pytest.CaptureFixture[str]) -> None:
    # groups [0,1,2] [3,4,5] [6,7,8] [9,10,11] on nodes of 4: the middle two cross.
    code, out, _ = run(capsys, "4", "3", "--names", "dp", "x", "--nproc-per-node", "4")
    assert code == 0
    assert "mixed: 2 of 4 groups cross nodes" in node_table(out)["x"]
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "the last axis" in warnings[0]
    # a bandwidth-hungry name anywhere is checked too; dp is not
    code, out, _ = run(capsys, "4", "2", "--names", "sp", "dp", "--nproc-per-node", "2")
    assert [w.split()[1] for w in out.splitlines() if w.startswith("warning")] == ["sp"]


def test_minus_one_is_inferred_from_world() -> None:
    doc = plan_json("-1", "8", "--world", "64", "--names", "dp", "tp")
    assert doc["shape"] == [8, 8] and doc["world"] == 64
    assert plan_json("4", "-1", "2", "--world", "24")["shape"] == [4, 3, 2]
    assert plan_json("2", "4", "--world", "8")["shape"] == [2, 4]


def test_axis_option_forms() -> None:
    doc = plan_json("2", "2", "2", "--names", "dp,pp,tp", "--axis", "tp,dp", "--axis", "0,2")
    assert doc["names"] == ["dp", "pp", "tp"]
    assert [e["axes"] for e in doc["axes"]] == [["dp"], ["pp"], ["tp"], ["dp", "tp"]]
    assert doc["axes"][3]["groups"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert doc["axes"][3]["stride"] is None
    doc = plan_json("2", "2", "--axis", "axis1", "--axis", "0,1")
    assert [e["indices"] for e in doc["axes"]] == [[0], [1], [0, 1]]


def test_large_world_is_summarised(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["1024", "1024", "--names", "dp", "tp", "--nproc-per-node", "8"]
    code, out, err = run(capsys, *argv, "--rank", "5000", "--axis", "dp,tp")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) < 100
    assert lines.count(f"  {ELLIPSIS} 1020 more groups {ELLIPSIS}") == 2  # dp and tp
    assert "dp,tp: 1 group of 1048576 ranks" in lines
    assert "tp: 1024 groups of 1024 ranks" in lines
    assert "  [0, 1, 2, …, 1022, 1023]" in lines
    assert "rank 5000: coordinate (4, 904) [dp=4, tp=904], node 625" in lines
    assert "cross-node: each group spans 128 nodes" in node_table(out)["tp"]

    code, out, _ = run(capsys, str(1 << 20), "--nproc-per-node", "8", "--rank", "77")
    assert code == 0 and len(out.splitlines()) < 100
    doc = plan_json(str(1 << 20), "--nproc-per-node", "8")
    assert doc["axes"][0]["groups"] == [list(range(1 << 20))]
    assert doc["axes"][0]["span"] == [1 << 17, 1 << 17]


def test_huge_groups_are_left_out_of_a_json_summary() -> None:
    doc = plan_json("2", str(10**9), "--rank", "5")
    tp = doc["axes"][1]
    assert tp["groups"] == [] and tp["omitted"] == 2 and tp["omitted_at"] == 0
    assert doc["rank"]["groups"][1]["ranks"] is None
    assert doc["rank"]["groups"][0]["ranks"] == [5, 10**9 + 5]


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: scopedmesh plan") and "--nproc-per-node" in out


# ------------------------------------------------------------------- errors

BAD = [
    (["0"], "axis sizes must be positive"),
    (["-2", "4"], "axis sizes must be positive"),
    (["-1", "-1", "--world", "4"], "only one axis size may be -1"),
    (["-1", "4"], "needs --world"),
    (["-1", "3", "--world", "8"], "not a multiple of 3"),
    (["2", "2", "--world", "5"], "holds 4 ranks but --world is 5"),
    (["2", "--world", "0"], "--world must be positive"),
    (["2", "2", "--names", "dp"], "--names gives 1 name but the shape has 2 axes"),
    (["2", "2", "--names", "a", "a"], "--names must be distinct"),
    (["2", "2", "--names", "dp", "tp", "--axis", "pp"], "unknown axis 'pp'.*dp, tp"),
    (["2", "2", "--axis", "5"], "--axis 5 is out of range"),
    (["2", "2", "--axis", "0,0"], "distinct"),
    (["2", "2", "--axis", "0,"], "unknown axis ''"),
    (["2", "2", "--rank", "4"], "--rank 4 is not in the mesh: its ranks are 0 to 3"),
    (["2", "2", "--rank", "-1"], "--rank -1 is not in the mesh"),
    (["2", "2", "--nproc-per-node", "0"], "--nproc-per-node must be positive"),
    (["x"], "invalid int value: 'x'"),
    ([], "required: SIZE"),
    (["2", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_arguments_give_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert err.startswith("scopedmesh plan: error: ")
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scopedmesh: error: ") and err.count("\n") == 1


# ----------------------------------------------------------------- processes


def python(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )


def test_python_m_scopedmesh() -> None:
    argv = ["2", "4", "8", "--names", "dp", "pp", "tp", "--nproc-per-node", "8"]
    done = python("-m", "scopedmesh", "plan", *argv)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "tp       8       1       8  intra-node" in done.stdout
    bad = python("-m", "scopedmesh", "plan", "2", "2", "--rank", "9")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "scopedmesh plan: error: --rank 9 is not in the mesh: its ranks are 0 to 3"
    ]


def test_plan_does_not_import_torch() -> None:
    code = """
import runpy, sys
sys.argv = ["scopedmesh", "plan", "2", "4", "--names", "dp", "tp", "--rank", "3", "--json"]
try:
    runpy.run_module("scopedmesh", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    print(stop.code, "torch" in sys.modules)
"""
    done = python("-c", code)
    assert done.returncode == 0, done.stderr
    *document, verdict = done.stdout.splitlines()
    assert json.loads("\n".join(document))["rank"]["coordinate"] == [0, 3]
    assert verdict == "0 False"
