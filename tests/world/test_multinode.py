"""Two torchrun agents on this machine as two nodes: the README's two-node example, for real.

``examples/launch_two_nodes.py`` starts the agents (``--nnodes 2 --nproc-per-node 4``,
c10d rendezvous on 127.0.0.1); ``examples/multinode.py`` checks on every rank that
torchrun's ``GROUP_RANK``/``LOCAL_RANK`` is the node the plan gives, that intra-node
axes stay on one real node, and that a node-aware mesh keeps ``dp`` and ``tp``
inside a node. Each launch costs tens of seconds on a small machine, so there are
three: one whose second agent starts late (and checks everything), and two in
which a worker, or a whole node's agent, is killed mid-run.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from types import ModuleType

import pytest

from scopedmesh.layout import MeshLayout
from scopedmesh.plan.cli import main as cli

# Two torchrun agents per test: the launch lane.
pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("dp", "pp", "tp")
ROW = re.compile(
    r"^\[node \d\] rank (\d+): node (\d+) local (\d+)/(\d+) = plan; \(dp, pp, tp\) = "
    r"\((\d), (\d), (\d)\); sums dp=(\d+) pp=(\d+) tp=(\d+); "
    r"node-aware on one node: dp=(yes|no) pp=(yes|no) tp=(yes|no)$",
    re.MULTILINE,
)


def launcher() -> ModuleType:
    path = ROOT / "examples" / "launch_two_nodes.py"
    spec = importlib.util.spec_from_file_location("launch_two_nodes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def plan(*args: str) -> dict[str, object]:
    """``scopedmesh plan 2 2 2 --names dp pp tp --nproc-per-node 4 --json ARGS``."""
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli(
            ["plan", "2", "2", "2", "--names", *NAMES, "--nproc-per-node", "4", "--json", *args]
        )
    assert status == 0
    document: dict[str, object] = json.loads(out.getvalue())
    return document


def test_two_nodes_one_starting_late_match_the_plan_and_keep_intra_axes_on_one_node() -> None:
    result = launcher().launch(late=3.0, timeout=300)
    text = result.text()
    assert not result.timed_out and result.returncodes == [0, 0], text[-6000:]
    assert result.leftovers == []
    assert "two-node check passed on 8 ranks" in text
    rows = {int(m[1]): m.groups()[1:] for m in ROW.finditer(text)}
    assert sorted(rows) == list(range(8)), text[-6000:]

    layout = MeshLayout((2, 2, 2), names=NAMES)
    node = {rank: int(row[0]) for rank, row in rows.items()}  # each rank's real GROUP_RANK
    document = plan()
    intra = [p["axes"] for p in document["axes"] if p["placement"] == "intra-node"]  # type: ignore[attr-defined,index]
    assert intra == [["pp"], ["tp"]]  # at 4 ranks per node only dp crosses nodes
    for axes in intra:
        for group in layout.groups(tuple(axes)):
            assert len({node[r] for r in group}) == 1, (axes, group, node)
    for rank, (group_rank, local, nproc, *rest) in rows.items():
        coord, sums, aware = rest[:3], rest[3:6], rest[6:]
        facts = plan("--rank", str(rank))["rank"]
        assert facts["node"] == int(group_rank)  # type: ignore[index]
        assert (int(local), int(nproc)) == (rank % 4, 4)
        assert tuple(map(int, coord)) == layout.unravel(rank) == tuple(facts["coordinate"])  # type: ignore[index]
        assert [int(s) for s in sums] == [sum(layout.group(layout.unravel(rank), a)) for a in NAMES]
        assert aware == ["yes", "no", "yes"]  # node-aware dp and tp on one node; pp across


@pytest.mark.parametrize("victim", ["worker", "agent"])
def test_a_killed_peer_fails_the_survivors_with_a_clear_error_and_leaves_no_process(
    victim: str,
) -> None:
    """Kill rank 5's process, or its node's agent (its workers die with it), mid-run."""
    killed: dict[str, float] = {}
    agents: dict[int, int] = {}

    def kill(node: int, line: str) -> None:
        match = re.search(r"rank 5 pid (\d+) holding", line)
        if match and not killed:
            os.kill(int(match[1]) if victim == "worker" else agents[node], signal.SIGKILL)
            killed["at"] = time.monotonic()

    args = ["--hold", "120", "--timeout", "20"]
    result = launcher().launch(
        timeout=300, worker_args=args, on_line=kill, on_agent=agents.__setitem__
    )
    text = result.text()
    assert killed, text[-6000:]
    assert not result.timed_out, text[-6000:]  # the agents ended by themselves
    assert result.returncodes[0] != 0 and result.returncodes[1] != 0
    assert result.leftovers == []
    lost = re.findall(r"^\[node 0\] rank [0-3]: lost a peer at step \d+: (.*)$", text, re.M)
    assert lost, text[-6000:]  # node 0's workers saw the death themselves, and said so
    if victim == "worker":
        assert "SIGKILL" in text  # torchrun names the killed worker


def test_the_leftover_scan_finds_a_marked_process() -> None:
    module = launcher()
    env = dict(os.environ, **{module.MARKER: "scan-test"})
    with subprocess.Popen(["sleep", "60"], env=env) as proc:
        try:
            # Popen returns once forked; until the child has exec'd, /proc shows the
            # parent's environment, without the marker (seen under load).
            deadline = time.monotonic() + 30
            while module.marked("scan-test") != [proc.pid] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert module.marked("scan-test") == [proc.pid]
        finally:
            proc.kill()
    assert module.marked("scan-test") == []
