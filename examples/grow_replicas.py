"""Grow back under the launcher: ``scopedmesh replicas`` runs examples/replicas_loop.py as
3 replicas x 2 workers; a worker of a random replica is SIGKILLed at a random moment, its
replica restarts, rejoins the running job and catches up from a live one.

    .venv/bin/python examples/grow_replicas.py                 # 3 replicas x 2 workers, one kill

This script runs, as a user would (``--host-job-store`` on a port it chose, so it
can watch the job's membership in the store):

    scopedmesh replicas --replicas 3 --nproc-per-replica 2 \\
        --job-store 127.0.0.1:PORT --host-job-store -- examples/replicas_loop.py --steps 100

The launcher hosts the job's store and runs one torchrun agent per replica
(``--max-restarts 3``). Once the job has formed, a random moment later, a worker of
a random replica is SIGKILLed from outside: its agent stops the replica and starts
it again; the other replicas go on without it, then admit it at a step boundary and
send it their live state. Every worker ends with the same digest of its weights and
optimizer state as its peers of the same coordinate in the other replicas, and the
launcher exits 0.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^\[replica (\d+)\] (.*)$")  # the launcher's prefix
PIDS = re.compile(r"^replica (\d+) coordinate (\d+) pid (\d+) ")
DONE = re.compile(r"^replica (\d+) coordinate (\d+) pid \d+ done: (\d+) steps, .* digest (\w+)$")


@dataclass
class Launch:
    """What the launch saw: each replica's lines, the kill, the launcher's exit code."""

    lines: list[tuple[int, str]] = field(default_factory=list)  # (replica, line); -1: launcher
    seen: list[float] = field(default_factory=list)  # when each line came (time.monotonic)
    killed: tuple[int, int, int] | None = None  # (replica, coordinate, pid)
    killed_at: float | None = None
    returncode: int | None = None
    timed_out: bool = False

    def done(self) -> dict[tuple[int, int], tuple[int, str]]:
        """(replica, coordinate) -> (steps, digest), from the workers' last lines."""
        found = {}
        for _, line in self.lines:
            m = DONE.match(line)
            if m:
                found[(int(m[1]), int(m[2]))] = (int(m[3]), m[4])
        return found

    def text(self) -> str:
        return "\n".join(f"[replica {r}] {line}" if r >= 0 else line for r, line in self.lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _read(proc: subprocess.Popen[str], launch: Launch, lock: threading.Lock) -> None:
    if proc.stdout is None:
        return
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        m = LINE.match(line)
        with lock:
            launch.lines.append((int(m[1]), m[2]) if m else (-1, line))
            launch.seen.append(time.monotonic())


def _pids(launch: Launch, replica: int, lock: threading.Lock) -> list[tuple[int, int]]:
    """(coordinate, pid) of the workers of ``replica`` that said they started, latest first."""
    with lock:
        found = [PIDS.match(line) for r, line in reversed(launch.lines) if r == replica]
    return [(int(m[2]), int(m[3])) for m in found if m]


def launch(
    replicas: int = 3,
    nproc: int = 2,
    steps: int = 100,
    timeout: float = 400.0,
    pace: float = 0.05,
    rng: random.Random | None = None,
) -> Launch:
    """Run ``scopedmesh replicas``; once the job formed, SIGKILL a worker of a random
    replica at a random moment; wait for the launcher to exit."""
    import torch.distributed as dist

    from scopedmesh import job_view

    rng = rng or random.Random()
    port = free_port()
    command = [
        sys.executable, "-m", "scopedmesh", "replicas",
        "--replicas", str(replicas), "--nproc-per-replica", str(nproc),
        "--job-store", f"127.0.0.1:{port}", "--host-job-store", "--timeout", str(timeout),
        "--", str(HERE / "replicas_loop.py"), "--steps", str(steps), "--pace", str(pace),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    result, lock = Launch(), threading.Lock()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    reader = threading.Thread(target=_read, args=(proc, result, lock), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    victim = rng.randrange(replicas)
    try:
        store = None
        while result.killed is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            if store is None:
                try:
                    store = dist.TCPStore(  # type: ignore[attr-defined]
                        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1)
                    )
                except RuntimeError:
                    continue  # the launcher is not up yet
            view = job_view(store)
            workers = _pids(result, victim, lock)
            if view is not None and len(workers) >= nproc:
                time.sleep(rng.uniform(0.2, 1.5))  # a random moment of its training
                coordinate, pid = rng.choice(workers[:nproc])
                os.kill(pid, signal.SIGKILL)
                result.killed, result.killed_at = (victim, coordinate, pid), time.monotonic()
        proc.wait(max(1.0, deadline + 30 - time.monotonic()))  # the launcher's own --timeout
    except subprocess.TimeoutExpired:
        result.timed_out = True
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops every agent it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
        result.returncode = proc.returncode
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    result = launch(replicas=args.replicas, steps=args.steps)
    for replica, line in result.lines:
        if "done:" in line or "started" in line or replica < 0:
            print(f"[replica {replica}] {line}" if replica >= 0 else line)
    print(f"killed (replica, coordinate, pid) {result.killed}; launcher exited {result.returncode}")
    done = result.done()
    digests = {c: {d for (_, cc), (_, d) in done.items() if cc == c} for c in range(2)}
    same = len(done) == 2 * args.replicas and all(len(d) == 1 for d in digests.values())
    print("every replica holds the same state:", same)
    sys.exit(0 if same and result.returncode == 0 else 1)


if __name__ == "__main__":
    main()
