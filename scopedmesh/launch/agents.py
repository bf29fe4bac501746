"""One torchrun agent per replica: started, watched, reported on, and stopped with nothing left.

:class:`ReplicaAgents` runs ``python -m torch.distributed.run --nnodes 1
--nproc-per-node P --max-restarts N --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:0`` for each replica this host runs (port 0: each agent's rendezvous store
binds a port of its own; a port picked free beforehand can be taken by then, and an
agent that found another's store there joined that rendezvous and waited on it): each
replica is a world of
its own, and when one of its ranks dies torchrun stops the others and starts the
replica again as a fresh world (``--max-restarts``). Every agent gets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each start of a replica's workers gets a
store of its own (in the agent's shared store a restarted worker can read its
predecessor's gloo address and fail or hang; pytorch#135712), and the variables of
:mod:`scopedmesh.launch.environment`. Each line an agent or its workers print comes
out prefixed with ``[replica R]``; the last lines are kept for the report of a
replica that failed.

>>> ReplicaAgents(["train.py"], replicas=2, nproc=2, host_replicas=[2], address="127.0.0.1:1")
Traceback (most recent call last):
...
ValueError: host_replicas must be replicas of 0..1, got [2]
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scopedmesh.errors import shown
from scopedmesh.launch.environment import BACKENDS, worker_environment

__all__ = [
    "LAUNCH_VARIABLE",
    "TAIL_LINES",
    "Agent",
    "ReplicaAgents",
    "free_port",
    "last_words",
    "marked",
]

LAUNCH_VARIABLE = "SCOPEDMESH_LAUNCH_ID"  # marks every process of one launch (see marked())
TAIL_LINES = 20  # lines of a failed replica's output in its report
_KEPT_LINES = 400  # lines kept per agent: its own traceback may follow the workers' last words
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it
    before you use it: good enough for a rendezvous on this host, and for tests).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def marked(launch_id: str) -> list[int]:
    """The live processes (not zombies) whose environment carries ``launch_id``; empty
    where ``/proc`` is absent.

    >>> marked("no-such-launch")
    []
    """
    needle = f"{LAUNCH_VARIABLE}={launch_id}".encode()
    pids = []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


@dataclass
class Agent:
    """One replica's torchrun agent: its process, the last lines it printed, and the
    rank and exit code torchrun's failure summary named (if it printed one)."""

    replica: int
    process: subprocess.Popen[bytes]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_KEPT_LINES))
    failed_rank: str | None = None
    failed_exitcode: str | None = None
    reader: threading.Thread | None = None

    def report(self) -> str:
        """What went wrong with this replica, for the launcher's last words."""
        code = self.process.returncode
        how = f"its agent exited with code {code}"
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
            how = f"its agent was killed by signal {name}"
        rank = "" if self.failed_rank is None else f", rank {self.failed_rank}"
        exit_code = "" if self.failed_exitcode is None else f" (exit code {self.failed_exitcode})"
        lines = "\n".join(f"  {line}" for line in last_words(list(self.tail)))
        return f"replica {self.replica}{rank} failed{exit_code}; {how}. Its last lines:\n{lines}"


def last_words(lines: list[str], count: int = TAIL_LINES) -> list[str]:
    """The last ``count`` of ``lines`` before torchrun's own traceback (which ends in its
    ``ChildFailedError`` summary), if there is one: the workers' last words, not the agent's.

    >>> last_words(["a", "b", "Traceback (most recent call last):", "x", "...ChildFailedError:"], 1)
    ['b']
    """
    failed = [i for i, line in enumerate(lines) if "ChildFailedError" in line]
    if failed:
        starts = [i for i in range(failed[-1]) if lines[i].startswith("Traceback (most recent")]
        lines = lines[: starts[-1]] if starts else lines
    return lines[-count:]


class ReplicaAgents:
    """The torchrun agents of ``host_replicas`` (replicas of a job of ``replicas``),
    each running ``command`` (a script and its arguments, or ``-m module ...``) on
    ``nproc`` ranks, with the job store at ``address``.

    ``start()``; then ``poll()`` (the agents still running) until it is empty, or
    ``stop()`` them (SIGTERM, then SIGKILL after ``grace`` seconds; every process of
    the launch is gone when it returns). ``failed()`` lists the agents that did not
    exit 0. Lines go to ``write`` (default: this process's stdout)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        replicas: int,
        nproc: int,
        host_replicas: Sequence[int],
        address: str,
        backend: str = "gloo",
        max_restarts: int = 3,
        write: Callable[[str], None] | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        if isinstance(command, str) or not command or not all(isinstance(c, str) for c in command):
            raise TypeError(f"command must be a non-empty list of str, got {shown(command)}")
        for name, value, low in (("replicas", replicas, 1), ("nproc", nproc, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {shown(value)}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {shown(max_restarts)}")
        chosen = list(host_replicas)
        if not chosen or any(
            isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < replicas for r in chosen
        ):
            raise ValueError(f"host_replicas must be replicas of 0..{replicas - 1}, got {chosen}")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"host_replicas names a replica twice: {chosen}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {shown(backend)}")
        self.command, self.replicas, self.nproc = list(command), replicas, nproc
        self.host_replicas, self.address, self.backend = chosen, address, backend
        self.max_restarts = max_restarts
        self.launch_id = uuid.uuid4().hex
        self.agents: dict[int, Agent] = {}
        self._write = write or _print
        self._environ = dict(os.environ if environ is None else environ)
        self._lock = threading.Lock()

    def agent_command(self) -> list[str]:
        """The torchrun command line of one replica's agent (its rendezvous store binds a
        port of its own: port 0)."""
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", str(self.nproc),
            "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            *self.command,
        ]  # fmt: skip

    def start(self) -> None:
        """Start one agent per replica of this host."""
        for replica in self.host_replicas:
            env = dict(self._environ)
            env.update(
                worker_environment(
                    self.address, replica=replica, replicas=self.replicas, backend=self.backend
                )
            )
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            env[LAUNCH_VARIABLE] = self.launch_id
            process = subprocess.Popen(
                self.agent_command(), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            agent = Agent(replica, process)
            agent.reader = threading.Thread(
                target=self._read, args=(agent,), name=f"replica{replica}-output", daemon=True
            )
            agent.reader.start()
            self.agents[replica] = agent

    def poll(self) -> list[int]:
        """The replicas whose agents are still running."""
        return [r for r, agent in self.agents.items() if agent.process.poll() is None]

    def failed(self) -> list[Agent]:
        """The agents that ended with a non-zero code (after their output was read)."""
        ended = [a for a in self.agents.values() if a.process.poll() is not None]
        for agent in ended:
            if agent.reader is not None:
                agent.reader.join(timeout=5)
        return [a for a in ended if a.process.returncode != 0]

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM every agent still running (torchrun stops its workers), SIGKILL what is
        left after ``grace`` seconds, then every other process of this launch."""
        running = [a for a in self.agents.values() if a.process.poll() is None]
        for agent in running:
            _signal_group(agent.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for agent in running:
            try:
                agent.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(agent.process.pid, signal.SIGKILL)
                agent.process.wait()
        self.reap()

    def reap(self, wait: float = 5.0) -> list[int]:
        """SIGKILL the processes of this launch still running once their agents ended
        (a worker whose agent was killed); the pids killed."""
        deadline = time.monotonic() + wait
        left = marked(self.launch_id)
        while left and time.monotonic() < deadline:  # an agent's workers, on their way out
            time.sleep(0.1)
            left = marked(self.launch_id)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for agent in self.agents.values():
            if agent.reader is not None:
                agent.reader.join(timeout=5)
        return left

    def _read(self, agent: Agent) -> None:
        stream = agent.process.stdout
        if stream is None:
            return
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                agent.tail.append(line)
                if (found := _RANK.match(line)) and agent.failed_rank is None:
                    agent.failed_rank = found[1]
                elif (found := _EXITCODE.match(line)) and agent.failed_exitcode is None:
                    agent.failed_exitcode = found[1]
                self._write(f"[replica {agent.replica}] {line}")
        stream.close()


def _print(line: str) -> None:
    """Write one line to stdout in one write: lines of different replicas never interleave."""
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode(errors="replace"))
    except BrokenPipeError:  # e.g. piped into head
        pass


def _signal_group(pid: int, sign: signal.Signals) -> None:
    try:
        os.killpg(pid, sign)
    except ProcessLookupError:
        pass
