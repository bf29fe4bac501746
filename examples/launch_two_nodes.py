"""Launch ``examples/multinode.py`` as two torchrun nodes on this machine, over loopback.

    .venv/bin/python examples/launch_two_nodes.py
    .venv/bin/python examples/launch_two_nodes.py --late 5        # node 1's agent starts 5 s late

Starts two torchrun agents (``--nnodes 2 --nproc-per-node 4``, c10d rendezvous on
127.0.0.1 at a free port, one ``--rdzv-id``, a ``--node-rank`` each; node 0's agent
hosts the rendezvous store, ``--rdzv-conf is_host=1``), prints their output
prefixed by node, and exits with the first non-zero status of the agents.
The rendezvous orders the agents itself (by process id on one machine), so
``GROUP_RANK`` need not equal ``--node-rank``; the example checks the real value.

Every process of the launch (agents and workers) carries a marker in its
environment; when the agents have exited, any process left with it is reported
and killed, so nothing outlives the launch. Needs Linux (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "SCOPEDMESH_LAUNCH_ID"


@dataclass
class Launch:
    """What a two-node launch did: per-node output and status, time, leftover processes."""

    returncodes: list[int | None]
    output: list[list[str]]
    seconds: float
    leftovers: list[int] = field(default_factory=list)  # pids found (and killed) after the end
    timed_out: bool = False

    def text(self) -> str:
        return "\n".join(
            f"[node {n}] {line}" for n, lines in enumerate(self.output) for line in lines
        )


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
        except OSError:  # gone, or not ours
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def launch(
    *,
    nproc: int = 4,
    late: float = 0.0,
    timeout: float = 300.0,
    worker_args: Sequence[str] = (),
    on_line: Callable[[int, str], None] | None = None,
    on_agent: Callable[[int, int], None] | None = None,
) -> Launch:
    """Run the two agents; ``on_line(node, line)`` sees each output line as it comes,
    ``on_agent(node, pid)`` each agent as it starts."""
    launch_id = uuid.uuid4().hex
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **{MARKER: launch_id})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    output: list[list[str]] = [[], []]
    agents: list[subprocess.Popen[str]] = []
    readers = []

    def read(node: int, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            output[node].append(line.rstrip("\n"))
            if on_line is not None:
                on_line(node, line.rstrip("\n"))

    start = time.monotonic()
    deadline = start + timeout
    timed_out = False
    try:
        for node in (0, 1):
            if node == 1 and late:
                time.sleep(late)
            command = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", launch_id, "--node-rank", str(node), "--max-restarts", "0",
                "--rdzv-conf", f"is_host={int(node == 0)}",
                str(HERE / "multinode.py"), *worker_args,
            ]  # fmt: skip
            agent = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its own process group: killpg ends the agent
            )
            agents.append(agent)
            if on_agent is not None:
                on_agent(node, agent.pid)
            reader = threading.Thread(target=read, args=(node, agent.stdout), daemon=True)
            reader.start()
            readers.append(reader)
        for agent in agents:
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for reader in readers:
            reader.join(timeout=10)
        seconds = time.monotonic() - start
        leftovers = marked(launch_id)
        for _ in range(50):  # workers may still be on their way out: up to 5 s
            if not leftovers:
                break
            time.sleep(0.1)
            leftovers = marked(launch_id)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    codes: list[int | None] = [agent.returncode for agent in agents]
    return Launch(codes, output, seconds, leftovers, timed_out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", type=int, default=4, metavar="N")
    parser.add_argument("--late", type=float, default=0.0, help="start node 1's agent S s later")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole launch")
    args, worker_args = parser.parse_known_args(argv)
    result = launch(
        nproc=args.nproc_per_node,
        late=args.late,
        timeout=args.timeout,
        worker_args=worker_args,
        on_line=lambda node, line: print(f"[node {node}] {line}", flush=True),
    )
    codes = ", ".join(f"node {n}: {c}" for n, c in enumerate(result.returncodes))
    print(f"agents exited ({codes}) after {result.seconds:.1f} s", flush=True)
    if result.leftovers:
        print(f"killed {len(result.leftovers)} leftover processes: {result.leftovers}")
    if result.timed_out:
        print(f"timed out after {args.timeout} s")
        return 1
    return next((c for c in result.returncodes if c), 0) or (1 if result.leftovers else 0)


if __name__ == "__main__":
    sys.exit(main())
