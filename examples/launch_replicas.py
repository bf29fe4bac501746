"""Three torchrun agents, one per replica group, and two crashes healed in place.

    .venv/bin/python examples/launch_replicas.py
    .venv/bin/python examples/launch_replicas.py --agents 3 --nproc-per-node 2 --kills 2

Starts ``--agents`` torchrun agents on this machine (``--nnodes N
--nproc-per-node P``, c10d rendezvous on 127.0.0.1; the first agent started
hosts the rendezvous, ``--rdzv-conf is_host=1``), each running
``examples/heal_replicas.py``: the workers of the agent the rendezvous makes
node ``n`` are the tp ranks of dp slice ``n``. The workers' store lives in
node 0's agent, which the rendezvous need not give to the first agent
started, so the kills go by node: once every worker has taken a few steps, a
worker of node 1 is SIGKILLed; its agent stops its other worker and exits. The
workers of the other agents learn of it through their liveness watch, drop
that dp slice and go on. Then a worker of node 2 is killed, and the workers of
node 0 heal again.

torchrun's agents wait (300 s, not configurable) at exit for agents that
failed, so once every surviving worker has said ``done`` this script stops the
surviving agents (SIGTERM, then SIGKILL). Every process of the launch carries a
marker in its environment; any left at the end is reported and killed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "SCOPEDMESH_LAUNCH_ID"
LINE = re.compile(r"rank (\d+) pid (\d+) agent (\d+) node (\d+): (.*)$")


@dataclass
class Launch:
    """What the launch did: the lines (with the agent they came from), kills, leftovers."""

    lines: list[tuple[int, str]] = field(default_factory=list)
    kills: list[tuple[int, int, float]] = field(default_factory=list)  # (rank, agent, time)
    nodes: dict[int, int] = field(default_factory=dict)  # agent index -> its node (GROUP_RANK)
    returncodes: list[int | None] = field(default_factory=list)
    leftovers: list[int] = field(default_factory=list)
    timed_out: bool = False

    def text(self) -> str:
        return "\n".join(f"[agent {a}] {line}" for a, line in self.lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def marked(launch_id: str) -> list[int]:
    """The live processes whose environment carries ``launch_id`` (a scan of /proc)."""
    needle = f"{MARKER}={launch_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def launch(
    *, agents: int = 3, nproc: int = 2, kills: int = 2, steps: int = 60, timeout: float = 300.0
) -> Launch:
    """Run the agents, kill a worker of nodes 1, 2, ... in turn; return what happened."""
    launch_id, port = uuid.uuid4().hex, free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **{MARKER: launch_id})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    result = Launch()
    procs: list[subprocess.Popen[str]] = []
    lock = threading.Lock()
    progress: dict[int, int] = {}  # rank -> steps taken since the last kill was healed
    workers: dict[int, tuple[int, int]] = {}  # rank -> (pid, agent index)
    done: set[int] = set()
    dead: set[int] = set()

    def on_line(agent: int, line: str) -> None:
        match = LINE.search(line)
        if not match:
            return
        rank, pid = int(match[1]), int(match[2])
        with lock:
            workers[rank] = (pid, agent)
            result.nodes[agent] = int(match[4])
            text = match[5]
            if text.startswith("step ") and " sums " in text:
                progress[rank] = progress.get(rank, 0) + 1
            if text.startswith("done") or text.startswith("sits out"):
                done.add(rank)
            # Node 0's agent holds the workers' store: the kills hit nodes 1, 2, ...
            victim_node = len(result.kills) + 1
            node_of = {r: result.nodes[a] for r, (_, a) in workers.items()}
            alive = [r for r in workers if node_of[r] not in range(1, victim_node)]
            ready = len(workers) == agents * nproc and all(progress.get(r, 0) >= 5 for r in alive)
            if len(result.kills) < kills and victim_node < agents and ready:
                victim_agent = next(a for a, n in result.nodes.items() if n == victim_node)
                rank_b = min(r for r, (_, a) in workers.items() if a == victim_agent)
                os.kill(workers[rank_b][0], signal.SIGKILL)
                result.kills.append((rank_b, victim_agent, time.time()))
                dead.update(r for r, (_, a) in workers.items() if a == victim_agent)
                progress.clear()

    def read(agent: int, stream: object) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            line = raw.rstrip("\n")
            result.lines.append((agent, line))
            on_line(agent, line)

    readers = []
    start = time.monotonic()
    try:
        for agent in range(agents):
            command = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(agents), "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", launch_id, "--node-rank", str(agent), "--max-restarts", "0",
                "--rdzv-conf", f"is_host={int(agent == 0)}",
                str(HERE / "heal_replicas.py"), "--steps", str(steps),
            ]  # fmt: skip
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, start_new_session=True,
            )  # fmt: skip
            procs.append(proc)
            reader = threading.Thread(target=read, args=(agent, proc.stdout), daemon=True)
            reader.start()
            readers.append(reader)
        # A worker's lines come through its agent's pipe, so the index is known; the
        # rendezvous orders the agents itself (GROUP_RANK need not equal the index:
        # Launch.nodes maps one to the other).
        deadline = start + timeout
        while time.monotonic() < deadline:
            with lock:
                survivors = {r for r in workers if r not in dead}
                finished = len(workers) == agents * nproc and survivors <= done
            if finished or all(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        else:
            result.timed_out = True
        # The survivors' agents then sit in torchrun's exit barrier: once their
        # workers have exited, stop them.
        with lock:
            pids = [pid for rank, (pid, _) in workers.items() if rank not in dead]
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in procs:
            if proc.poll() is None:
                with_grace(proc)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        leftovers = marked(launch_id)
        for _ in range(50):
            if not leftovers:
                break
            time.sleep(0.1)
            leftovers = marked(launch_id)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        result.leftovers = leftovers
    result.returncodes = [p.returncode for p in procs]
    return result


def with_grace(proc: subprocess.Popen[str], grace: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def heal_times(result: Launch) -> list[float]:
    """Per kill, seconds from the kill to the last survivor's ``healed at`` line before the next."""
    healed = [
        float(m[1]) for _, line in result.lines if (m := re.search(r"healed at (\d+\.\d+)", line))
    ]
    times = []
    for i, (_, _, at) in enumerate(result.kills):
        until = result.kills[i + 1][2] if i + 1 < len(result.kills) else float("inf")
        mine = [t for t in healed if at < t < until]
        times.append(max(mine) - at if mine else float("nan"))
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--nproc-per-node", type=int, default=2, metavar="N")
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    result = launch(
        agents=args.agents,
        nproc=args.nproc_per_node,
        kills=args.kills,
        steps=args.steps,
        timeout=args.timeout,
    )
    print(result.text())
    for (rank, agent, _), took in zip(result.kills, heal_times(result)):
        print(
            f"killed rank {rank} (a worker of agent {agent}) with SIGKILL; "
            f"every survivor healed within {took:.3f} s"
        )
    if result.leftovers:
        print(f"killed {len(result.leftovers)} leftover processes: {result.leftovers}")
    return 1 if result.timed_out or result.leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
