"""The ``hosts`` lane: scripts run on two hosts in network namespaces by ``.ci/two_hosts``.

Each test runs the harness with namespace names of its own (so that a second run on
the machine does not collide), and deletes whatever the harness left (namespaces,
the veth, ``/etc/netns/<ns>``) afterwards, even when the harness was killed at the
bound. It needs root, ``ip``, ``unshare``, ``timeout`` and ``sysctl``; elsewhere it
is skipped, saying which.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / ".ci" / "two_hosts"
HERE = Path(__file__).resolve().parent
BOUND = 600  # seconds: a "never hang" bound for one harness run, not a performance figure


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare --uts)"
    for tool in ("ip", "unshare", "timeout", "sysctl"):
        if shutil.which(tool) is None:
            return f"needs {tool} on PATH"
    return None


def _clean(names: tuple[str, str]) -> list[str]:
    """Delete what a harness run over ``names`` left behind; what was left, for the report."""
    left = []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    for ns in names:
        if any(line.split()[:1] == [ns] for line in listed.stdout.splitlines()):
            left.append(ns)
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10
            ).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], timeout=10, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        link = f"{ns}-veth"
        if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
            left.append(link)
            subprocess.run(["ip", "link", "del", link], timeout=10, check=False)
    return left


def run_hosts(script: str, *args: str) -> tuple[int, str]:
    """``bash .ci/two_hosts <python> tests/hosts/<script> args...``: its exit code and output."""
    tag = f"{os.getpid() % 100000:05d}"
    names = (f"smh{tag}a", f"smh{tag}b")
    env = {
        **os.environ,
        "TWO_HOSTS_NS_A": names[0],
        "TWO_HOSTS_NS_B": names[1],
        "TWO_HOSTS_LIMIT": str(BOUND - 60),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = ["bash", str(HARNESS), sys.executable, str(HERE / script), *args]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness's trap cleans up
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        output += f"\n(killed at the bound of {BOUND} s)"
    finally:
        left = _clean(names)
    if left:
        output += f"\nthe harness left {left} (deleted here)"
    return proc.returncode, output


def _result(output: str) -> dict[str, object]:
    for line in output.splitlines():
        _, _, body = line.partition("] ")
        if body.startswith('{"result"'):
            parsed: dict[str, object] = json.loads(body)
            return parsed
    raise AssertionError(f"no result line in the harness's output:\n{output[-6000:]}")


@pytest.mark.hosts
def test_a_replica_cut_off_from_the_network_is_dropped_and_rejoins() -> None:
    """Replica 2 alone on host B, the job's store on host A. A stop of replica 1 changes
    nothing; each silent cut gives a step without replica 2 well before the heal's
    30 s timeout (the script's bound), replica 2 is told it was cut off and commits
    nothing meanwhile, rejoins as a new incarnation once the link is back, and every
    replica ends on the same step with the same weights. The second cut lands while
    replica 2's request to the job's store (after a step's all-reduce) is in flight."""
    if (missing := _missing()) is not None:
        pytest.skip(missing)
    code, output = run_hosts("two_hosts_replicas.py", "--cuts", "2")
    assert code == 0, output[-8000:]
    parsed = _result(output)
    assert parsed["failure"] is None, output[-8000:]
    result = parsed["result"]
    assert isinstance(result, dict)
    assert len(result["cut -> first step without replica 2 (s)"]) == 2
    assert result["requests held across a cut"] == 1, result
    told = result["replica 2 was told"]
    assert isinstance(told, list) and len(told) == 2
    for message in told:
        assert "cut off" in message or "is not in epoch" in message, message
