"""The liveness watch at 128 members, run as a user runs the scale benchmark (the launch lane).

``python -m benchmarks.watch_scale --sizes 128`` hosts 128 real watch members in
worker processes (most in processes of 64, two nodes of 8), kills members and a
node from outside, and has every survivor agree. Asserted are counts and
outcomes, never times: an idle job asks nothing of the store; every death is
learned by every live member; every survivor decides the same lost set, the one
killed; an agreement costs each member a handful of requests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def row() -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.watch_scale", "--sizes", "128", "--kills", "5"]
    command += ["--per-process", "64", "--nodes", "2", "--idle", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, done.stdout
    print(rows[0])
    result: dict[str, Any] = rows[0]
    return result


def test_an_idle_job_of_128_members_asks_nothing_of_the_store(row: dict[str, Any]) -> None:
    assert row["idle_per_s"] == 0


def test_every_kill_is_learned_by_every_live_member(row: dict[str, Any]) -> None:
    # 5 kills (the fifth a node's 8), then two at once, then the other node: each waited
    # for until every live member had learned it, or the benchmark raised.
    assert row["kills"] == 5 + 1 + 1


@pytest.mark.parametrize("case", ["one death", "two at once", "a node's 8"])
def test_every_survivor_agrees_on_the_killed_at_a_handful_of_requests(
    row: dict[str, Any], case: str
) -> None:
    agreement = row["agree"][case]
    assert "DIFFERENT" not in agreement, agreement
    # The check-in (its tag's append, its entry, the count), the decision's read, and the
    # store thread's wake-up (the wait, the delete, one read of both lists): 7. A look
    # at a stalled agreement on a loaded machine may add one or two.
    assert agreement["requests_per_member"] <= 10, agreement
