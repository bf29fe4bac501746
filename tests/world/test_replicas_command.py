"""``scopedmesh replicas`` run as a user runs it: a failed replica's report, a clean stop.

The workers here are tiny scripts that never import torch; the cost is the
launcher's and the agents' interpreters (torchrun imports torch): 5 to 28 s and 11
to 15 s for the first two tests on 2 cores shared with other jobs (load 13 to 16). The kill-and-grow-back run is tests/world/test_grow.py's
``test_the_example_under_the_launcher_grows_back_with_equal_state``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

LAUNCH = [sys.executable, "-m", "scopedmesh", "replicas"]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text("import os, sys, time\n" + body)
    return str(path)


def test_a_failed_replica_is_named_with_its_rank_and_last_lines(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "replica, rank = os.environ['SCOPEDMESH_REPLICA'], os.environ['RANK']\n"
        "seen = [os.environ[f'SCOPEDMESH_{v}'] for v in ('REPLICAS', 'BACKEND', 'JOB_STORE')]\n"
        "os.write(1, f'worker {replica}/{rank} of {\" \".join(seen)}\\n'.encode())\n"
        "if (replica, rank) == ('1', '1'):\n"
        "    os.write(1, b'the last words of replica 1 rank 1\\n')\n"
        "    sys.exit(3)\n",
    )
    job = ["--replicas", "2", "--nproc-per-replica", "2", "--max-restarts", "0", "--timeout", "120"]
    done = subprocess.run(
        [*LAUNCH, *job, "--", script], capture_output=True, text=True, timeout=180
    )
    out = done.stdout
    assert done.returncode == 1, (done.returncode, out, done.stderr)
    store = re.search(r"job store (127\.0\.0\.1:\d+) \(hosted here\)", out)
    assert store is not None, out
    for replica in (0, 1):
        for rank in (0, 1):  # every worker saw the job's variables, prefixed by its replica
            line = f"[replica {replica}] worker {replica}/{rank} of 2 gloo {store[1]}"
            assert line in out, out
    report = out[out.index("scopedmesh replicas: replica 1") :]
    assert report.startswith("scopedmesh replicas: replica 1, rank 1 failed (exit code 3)"), out
    assert "the last words of replica 1 rank 1" in report, report
    assert "replica 0" not in report.split("\n", 1)[0], report


def test_sigterm_stops_every_agent_and_worker(tmp_path: Path) -> None:
    # One write per line: the two workers of a replica share their agent's stdout, and
    # under torchrun's ``python -u`` a print writes its pieces one by one (seen:
    # "pidpid 18000 18001").
    script = _script(tmp_path, "os.write(1, f'pid {os.getpid()}\\n'.encode())\ntime.sleep(600)\n")
    proc = subprocess.Popen(
        [*LAUNCH, "--replicas", "2", "--nproc-per-replica", "2", "--", script],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    pids: list[int] = []
    deadline = time.monotonic() + 120
    while len(pids) < 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
        found = (re.match(r"\[replica \d\] pid (\d+)$", line.strip()) for line in list(lines))
        pids = [int(m[1]) for m in found if m]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
    reader.join(timeout=10)
    rest = "".join(lines)
    assert len(pids) == 4, (pids, rest)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, rest)
    assert "stopped by SIGTERM" in rest, rest
    alive = [pid for pid in pids if _alive(pid)]
    assert not alive, f"workers left behind: {alive}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def _read_job(replica: int, coordinate: int, job_port: int) -> tuple[int, int, str, int]:
    from scopedmesh.launch import job_from_environment

    job = job_from_environment(timeout=30.0)
    job.store.set(f"read/{replica}/{coordinate}", "yes")
    return job.replica, job.replicas, job.backend, int(job.address.rsplit(":", 1)[1]) - job_port


def test_replica_job_ranks_get_the_launchers_variables() -> None:
    """The test-side launcher (ranks forked from a warm server) tells its ranks what
    ``scopedmesh replicas`` tells its workers."""
    from scopedmesh.testing.replicas import ReplicaJob

    job = ReplicaJob(_read_job, replicas=2, local=2)
    job.start()
    try:
        deadline = time.monotonic() + 60
        while not job.done and not job.failures and time.monotonic() < deadline:
            job.poll()
            time.sleep(0.01)
    finally:
        job.stop()
    assert not job.failures, job.failures
    assert job.results == {(r, c): (r, 2, "gloo", 0) for r in range(2) for c in range(2)}
    assert all(job.store.get(f"read/{r}/{c}") == b"yes" for r in range(2) for c in range(2))
