"""``scopedmesh replicas``: a replicated job on this host, one torchrun agent per replica.

    scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- train.py --arg ...
    scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- -m package.module --arg ...
    # several hosts: one command per host; the first hosts the job store
    scopedmesh replicas --replicas 4 --nproc-per-replica 8 --host-replicas 0,1 \\
        --job-store 10.0.0.1:29400 --host-job-store -- train.py
    scopedmesh replicas --replicas 4 --nproc-per-replica 8 --host-replicas 2,3 \\
        --job-store 10.0.0.1:29400 -- train.py

The command hosts the job's store (unless another host's command does), starts
:class:`~scopedmesh.launch.agents.ReplicaAgents` and waits. It exits 0 when every
replica's workers exited 0; otherwise 1, naming each failed replica, the rank
torchrun reported and its last lines. SIGINT or SIGTERM stops every agent (exit
130 or 143); ``--timeout`` bounds the whole run (exit 1). The command that hosts the
store waits, once its own replicas are done, for the other hosts' replicas to end:
the store must outlive every replica. Bad arguments print one line,
``scopedmesh replicas: error: ...``, and exit 2.

>>> main(["--replicas", "3", "--nproc-per-replica", "2"])
2
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from scopedmesh.launch.agents import ReplicaAgents
from scopedmesh.launch.environment import BACKENDS, parse_address

__all__ = ["ENDED_KEY", "Options", "main", "parse"]

PROG = "scopedmesh replicas"
ENDED_KEY = "scopedmesh-launch/ended/"  # + replica: its agent's exit code, in the job store
MAX_REPLICAS = 1024
_POLL = 0.1  # seconds between looks at the agents


class UsageError(ValueError):
    """A bad argument of ``scopedmesh replicas``: one line on stderr, exit status 2."""


@dataclass(frozen=True)
class Options:
    """The parsed command line of ``scopedmesh replicas``."""

    replicas: int
    nproc: int
    host_replicas: tuple[int, ...]
    job_store: tuple[str, int] | None  # None: 127.0.0.1 and a free port, hosted here
    host_job_store: bool
    max_restarts: int
    backend: str
    timeout: float | None
    command: tuple[str, ...]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,  # --nproc is a mistake, not --nproc-per-replica
        usage=f"{PROG} --replicas R --nproc-per-replica P [options] -- SCRIPT|-m MODULE [ARGS...]",
        description=(
            "Run a replicated job: host its store, run one torchrun agent per replica, and\n"
            "restart a replica one of whose ranks dies (torchrun's --max-restarts). Workers\n"
            "get SCOPEDMESH_JOB_STORE, SCOPEDMESH_REPLICA, SCOPEDMESH_REPLICAS and\n"
            "SCOPEDMESH_BACKEND: scopedmesh.launch.job_from_environment() reads them."
        ),
        epilog=(
            "examples:\n"
            "  scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- train.py --steps 100\n"
            "  scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- -m package.module\n"
            "  # several hosts: one command per host; the first hosts the job store\n"
            "  scopedmesh replicas --replicas 4 --nproc-per-replica 8 --host-replicas 0,1 \\\n"
            "      --job-store 10.0.0.1:29400 --host-job-store -- train.py\n"
            "  scopedmesh replicas --replicas 4 --nproc-per-replica 8 --host-replicas 2,3 \\\n"
            "      --job-store 10.0.0.1:29400 -- train.py"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--replicas", type=int, required=True, metavar="R", help="the job's size")
    parser.add_argument(
        "--nproc-per-replica", type=int, required=True, metavar="P", help="ranks per replica"
    )
    parser.add_argument(
        "--host-replicas",
        metavar="LIST",
        help="the replicas this host runs, e.g. 0,1 (default: all R)",
    )
    parser.add_argument(
        "--job-store",
        metavar="HOST:PORT",
        help="the job store's address (default: 127.0.0.1 and a free port, hosted here)",
    )
    parser.add_argument(
        "--host-job-store",
        action="store_true",
        help="this command hosts the job store (implied without --job-store)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="restarts per replica (3)"
    )
    parser.add_argument(
        "--backend", default="gloo", help="the cross-replica groups' backend: gloo or nccl"
    )
    parser.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="stop everything after this long"
    )
    return parser


def parse(argv: Sequence[str]) -> Options:
    """The options of ``argv`` (what follows ``scopedmesh replicas``); UsageError if bad.

    >>> parse(["--replicas", "2", "--nproc-per-replica", "1", "--", "-m", "pkg.train"]).command
    ('-m', 'pkg.train')
    """
    argv = list(argv)
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            _parser().print_help()
            raise SystemExit(0)
        raise UsageError("give the training command after --, e.g. -- train.py --steps 100")
    split = argv.index("--")
    own, command = argv[:split], tuple(argv[split + 1 :])
    if any(a in ("-h", "--help") for a in own):
        _parser().print_help()
        raise SystemExit(0)
    args = _parser().parse_args(own)
    replicas, nproc = args.replicas, args.nproc_per_replica
    if not 1 <= replicas <= MAX_REPLICAS:
        raise UsageError(f"--replicas must be 1 to {MAX_REPLICAS}, got {replicas}")
    if nproc < 1:
        raise UsageError(f"--nproc-per-replica must be >= 1, got {nproc}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    host_replicas = tuple(range(replicas))
    if args.host_replicas is not None:
        host_replicas = _replica_list(args.host_replicas, replicas)
    job_store = None
    if args.job_store is not None:
        try:
            job_store = parse_address(args.job_store, "--job-store")
        except ValueError as error:
            raise UsageError(str(error)) from None
    hosting = args.host_job_store or job_store is None
    if not command:
        raise UsageError("the training command after -- is empty: give a script or -m MODULE")
    if command[0] == "-m":
        if len(command) < 2 or command[1].startswith("-"):
            raise UsageError("-m needs a module name, e.g. -- -m package.train")
    elif command[0].startswith("-"):
        raise UsageError(f"the command after -- must be a script or -m MODULE, got {command[0]!r}")
    elif not Path(command[0]).is_file():
        raise UsageError(f"the script {command[0]!r} does not exist")
    return Options(
        replicas, nproc, host_replicas, job_store, hosting, args.max_restarts, args.backend,
        args.timeout, command,
    )  # fmt: skip


def _replica_list(text: str, replicas: int) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"--host-replicas must be replica indices like 0,1, got {text!r}")
    chosen = tuple(int(p) for p in parts)
    outside = [r for r in chosen if r >= replicas]
    if outside:
        raise UsageError(
            f"--host-replicas {text}: replica {outside[0]} is not in the job "
            f"(--replicas {replicas}: 0 to {replicas - 1})"
        )
    if len(set(chosen)) != len(chosen):
        raise UsageError(f"--host-replicas {text} names a replica twice")
    return chosen


# ---------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``scopedmesh replicas ARGS``; return the exit status."""
    try:
        options = parse(sys.argv[2:] if argv is None else argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # --help
        return stop.code if isinstance(stop.code, int) else 0
    return run(options)


def run(options: Options, write: Callable[[str], None] | None = None) -> int:
    """Host the store (if this command does), run the agents, wait; the exit status."""
    from scopedmesh.launch.store import host_job_store

    say = write or (lambda line: print(line, flush=True))
    store: Any = None
    if options.host_job_store:
        host, port = options.job_store or ("127.0.0.1", 0)
        try:
            store = host_job_store(host, port, timeout=60.0)
        except (RuntimeError, OSError) as error:
            print(
                f"{PROG}: error: cannot host the job store on {host}:{port}: {error}",
                file=sys.stderr,
            )
            return 2
        address = f"{host}:{store.port}"
    else:  # parse() implies hosting without --job-store
        host, port = options.job_store or ("127.0.0.1", 0)
        address = f"{host}:{port}"
    agents = ReplicaAgents(
        options.command,
        replicas=options.replicas,
        nproc=options.nproc,
        host_replicas=options.host_replicas,
        address=address,
        backend=options.backend,
        max_restarts=options.max_restarts,
        write=write,
    )
    stopped: list[int] = []  # the signal that asked us to stop, if one did

    def on_signal(number: int, frame: FrameType | None) -> None:
        stopped.append(number)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = math.inf if options.timeout is None else time.monotonic() + options.timeout
    say(
        f"{PROG}: {len(options.host_replicas)} of {options.replicas} replicas here "
        f"({','.join(map(str, options.host_replicas))}) x {options.nproc} ranks; job store "
        f"{address}{' (hosted here)' if store is not None else ''}"
    )
    try:
        agents.start()
        while agents.poll() and not stopped and time.monotonic() < deadline:
            time.sleep(_POLL)
        _mark_ended(agents, store, options)
        if store is not None and not stopped:
            _outlive_other_hosts(store, options, deadline, stopped, say)
        timed_out = not stopped and time.monotonic() >= deadline
    finally:
        agents.stop()
        for number, handler in previous.items():
            signal.signal(number, handler)
    if stopped:
        say(f"{PROG}: stopped by {signal.Signals(stopped[0]).name}: every agent was stopped")
        return 128 + stopped[0]
    if timed_out:
        say(f"{PROG}: timed out after {options.timeout:g} s: every agent was stopped")
        return 1
    failed = agents.failed()
    for agent in failed:
        say(f"{PROG}: {agent.report()}")
    if not failed:
        say(f"{PROG}: every replica's workers exited 0")
    return 1 if failed else 0


def _mark_ended(agents: ReplicaAgents, store: Any, options: Options) -> None:
    """Write each ended replica's exit code into the job store, for the store's host."""
    from scopedmesh.launch.store import connect_store

    ended = {
        r: a.process.returncode for r, a in agents.agents.items() if a.process.poll() is not None
    }
    if not ended:
        return
    try:
        client = store
        if client is None:
            host, port = options.job_store or ("127.0.0.1", 0)
            client = connect_store(host, port, 10.0)
        for replica, code in ended.items():
            client.set(f"{ENDED_KEY}{replica}", str(code))
    except (RuntimeError, OSError, TimeoutError):
        pass  # the store's host is gone already: nobody is waiting for these marks


def _outlive_other_hosts(
    store: Any, options: Options, deadline: float, stopped: list[int], say: Callable[[str], None]
) -> None:
    """On the store's host: wait until every other host's replicas have ended."""
    others = [r for r in range(options.replicas) if r not in options.host_replicas]
    if not others:
        return
    say(
        f"{PROG}: waiting for replica{'s' if len(others) > 1 else ''} "
        f"{','.join(map(str, others))} on other hosts to end "
        "(the job store must outlive them; SIGINT stops)"
    )
    while not stopped and time.monotonic() < deadline:
        if store.check([f"{ENDED_KEY}{r}" for r in others]):
            return
        time.sleep(_POLL)
