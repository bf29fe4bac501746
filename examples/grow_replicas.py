"""Grow back under torchrun: one agent per replica with ``--max-restarts``; a killed replica
restarts, rejoins the running job and catches up from a live one.

    .venv/bin/python examples/grow_replicas.py                 # 3 replicas x 2 workers, one kill

This script is the launcher: it hosts the job's store (a ``TCPStore`` that
outlives every replica; the replicas decide their membership in it) and starts
one ``torchrun --standalone --nproc-per-node 2 --max-restarts 3`` agent per
replica, each running this file with ``--worker``, and with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each start of a replica's workers gets
a store of its own (docs/healing.md says why). Each agent's workers are one
replica (their own WORLD); ``Replicas`` forms the cross-replica groups outside
it. Once the job has trained a little, a worker of replica 1 is SIGKILLed: its
agent stops the replica and starts it again; the other replicas go on without
it, then admit it at a step boundary and send it their live state. Every worker
ends with the same digest of its weights and optimizer state as its peers of the
same coordinate in the other replicas.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

PIDS = re.compile(r"^replica (\d+) coordinate (\d+) pid (\d+) ")
DONE = re.compile(r"^replica (\d+) coordinate (\d+) pid \d+ done: (\d+) steps, .* digest (\w+)$")


# ------------------------------------------------------------------ the worker


def say(line: str) -> None:
    """Print ``line`` in one write: the lines of workers that share a pipe never interleave."""
    os.write(1, (line + "\n").encode())


class Progress:
    """The registered extras: the step and the membership each step trained with."""

    def __init__(self) -> None:
        self.step, self.shapes = 0, [0]

    def state_dict(self) -> dict[str, object]:
        return {"step": self.step, "shapes": list(self.shapes)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step, self.shapes = int(state["step"]), list(state["shapes"])  # type: ignore[call-overload, arg-type]


def worker(steps: int, pace: float) -> None:
    import torch
    import torch.distributed as dist

    from scopedmesh import JobFinishedError, Replicas

    # this replica's own WORLD (its agent's rendezvous); gloo's default wait is 30 minutes
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    replica, coordinate = int(os.environ["REPLICA"]), dist.get_rank()
    host, port = os.environ["JOB_STORE"].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    tag = f"replica {replica} coordinate {coordinate} pid {os.getpid()}"
    say(f"{tag} started (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
    torch.manual_seed(coordinate)
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    progress = Progress()
    state = {"model": model, "optim": optim, "progress": progress}
    replicas = int(os.environ["REPLICAS"])
    try:
        with Replicas(store, replica=replica, replicas=replicas, state=state) as grow:
            while True:
                decision = grow.boundary()
                # `steps` steps, then on until every replica is back (a bound: 20 times as
                # many); the step and the epoch's size are agreed: every member decides alike
                whole = decision.size == replicas or progress.step >= 20 * steps
                if progress.step >= steps and whole:
                    if grow.finish():  # every replica ends on this step
                        break
                    continue  # a member redid the last step: boundary() re-syncs
                optim.zero_grad()
                # each replica its own data: seeded by (replica, coordinate, step)
                g = torch.Generator().manual_seed(
                    replica * 7919 + coordinate * 104729 + progress.step
                )
                x = torch.randn(16, 64, generator=g)
                model(x).square().mean().backward()
                if grow.all_reduce_([p.grad for p in model.parameters() if p.grad is not None]):
                    optim.step()
                    progress.step += 1
                    progress.shapes.append(decision.size)
                time.sleep(pace)
    except JobFinishedError as error:  # started after the end: nothing to rejoin, exit 0
        say(f"{tag} {error}")
        dist.destroy_process_group()
        return
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, buffer)
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()[:16]
    sizes = "".join(str(s) for s in progress.shapes[1:])
    say(f"{tag} done: {progress.step} steps, sizes {sizes} digest {digest}")
    dist.destroy_process_group()


# ------------------------------------------------------------------ the launcher


@dataclass
class Launch:
    """What the launch saw: each agent's lines, the kill, the agents' exit codes."""

    lines: list[tuple[int, str]] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)  # when each line came (time.monotonic)
    killed: tuple[int, int, int] | None = None  # (replica, coordinate, pid)
    killed_at: float | None = None
    returncodes: list[int | None] = field(default_factory=list)
    timed_out: bool = False

    def done(self) -> dict[tuple[int, int], tuple[int, str]]:
        found = {}
        for _, line in self.lines:
            m = DONE.match(line)
            if m:
                found[(int(m[1]), int(m[2]))] = (int(m[3]), m[4])
        return found


def _read(agent: int, proc: subprocess.Popen[str], launch: Launch, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:
            launch.lines.append((agent, line.rstrip()))
            launch.seen.append(time.monotonic())


def _pid_of(launch: Launch, replica: int, lock: threading.Lock) -> tuple[int, int] | None:
    with lock:
        for _, line in reversed(launch.lines):
            m = PIDS.match(line)
            if m and int(m[1]) == replica:
                return int(m[2]), int(m[3])
    return None


def launch(replicas: int = 3, nproc: int = 2, steps: int = 100, timeout: float = 400.0) -> Launch:
    """Start the job, kill a worker of replica 1 once it trains, wait for the end."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, JOB_STORE=f"127.0.0.1:{store.port}", REPLICAS=str(replicas))
    # A fresh store for each start of a replica's workers: in the agent's shared store
    # (torchrun's default) a restarted worker can read its predecessor's gloo address:
    # init_process_group fails ("Connection refused") or hangs (pytorch#135712).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "--max-restarts", "3", "--monitor-interval", "0.1"]
    command += [__file__, "--worker", "--steps", str(steps)]
    result, lock = Launch(), threading.Lock()
    procs = []
    for replica in range(replicas):
        proc = subprocess.Popen(
            command, env=dict(env, REPLICA=str(replica)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        procs.append(proc)
        threading.Thread(target=_read, args=(replica, proc, result, lock), daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while result.killed is None and time.monotonic() < deadline:
            if store.check(["scopedmesh-replicas/latest"]) and (found := _pid_of(result, 1, lock)):
                time.sleep(random.uniform(0.5, 2.0))  # a random moment of its training
                os.kill(found[1], signal.SIGKILL)
                result.killed, result.killed_at = (1, *found), time.monotonic()
            time.sleep(0.05)
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        result.timed_out = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        result.returncodes = [proc.returncode for proc in procs]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help="run as a torchrun worker")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.pace)
        return
    result = launch(replicas=args.replicas, steps=args.steps)
    for agent, line in result.lines:
        if "done:" in line or "started" in line:
            print(f"[agent {agent}] {line}")
    print(f"killed {result.killed}; agents exited {result.returncodes}")
    digests = {c: {d for (_, cc), (_, d) in result.done().items() if cc == c} for c in range(2)}
    print("every replica holds the same state:", all(len(d) == 1 for d in digests.values()))


if __name__ == "__main__":
    main()
