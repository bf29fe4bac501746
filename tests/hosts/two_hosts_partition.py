"""A peer partitioned away while its partners ask for a new group: what does each rank see?

Run by the two-host harness, once with the liveness watch and once without::

    bash .ci/two_hosts .venv/bin/python tests/hosts/two_hosts_partition.py --watch
    bash .ci/two_hosts .venv/bin/python tests/hosts/two_hosts_partition.py --no-watch

Each host starts two ranks (ranks 0, 1 on host A, 2, 3 on host B; world 4, gloo,
the TCPStore on host A). Every rank lays ``ProcessGroupMesh(2, 2, names=("dp",
"tp"))`` over the world (``dp`` crosses the hosts: groups [0, 2] and [1, 3]),
guarded by a ``LivenessWatch`` with ``--watch``, and all-reduces once along each
axis. Then rank 0 asks the harness for a partition (silent by default: nothing
reaches either side any more), and every rank asks a fresh mesh for its ``dp``
group, which needs a rank across the cut. Each rank prints one JSON line: the
exception its request raised (type and message), the seconds from the request to
the error (and from the cut), and what its watch knows by then.

Host A's ranks keep the store and exit 0 once they have reported. Host B's ranks
lose the store with the link: they exit 3 ("cut off", which the harness accepts
only after a partition), and host B with them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD = 4
PER_HOST = 2
CUT_OFF = 3  # the harness's exit code for "this host was expected to be cut off"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    watch = parser.add_mutually_exclusive_group(required=True)
    watch.add_argument("--watch", dest="watch", action="store_true", help="guard with a watch")
    watch.add_argument("--no-watch", dest="watch", action="store_false", help="no watch")
    parser.add_argument("--timeout", type=float, default=20.0, help="mesh and watch timeout (s)")
    parser.add_argument(
        "--store-timeout", type=float, default=30.0, help="the TCPStore client's timeout (s)"
    )
    parser.add_argument(
        "--observe",
        type=float,
        default=35.0,
        help="kill a rank still blocked this long after the cut",
    )
    parser.add_argument(
        "--expect-unreachable",
        type=float,
        default=None,
        metavar="SECONDS",
        help="host A's ranks fail unless their error names the peer across the cut as "
        "unreachable or dead within SECONDS (issue 22's acceptance check)",
    )
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ the host


def host_main(args: argparse.Namespace, argv: list[str]) -> int:
    """Start this host's two ranks, relay their output, and sum up their exit codes.

    A rank still blocked ``--observe`` seconds after the cut is killed, and this
    process reports for it: where it was blocked (its stack, dumped by
    ``faulthandler``) and, with ``--watch``, what its watch knew.
    """
    host = int(os.environ["HOST_INDEX"])
    shared = Path(os.environ["TWO_HOSTS_DIR"])
    done_path = Path(os.environ["PARTITION_DONE"])
    env = dict(os.environ)
    if not os.environ.get("TWO_HOSTS_NO_IFNAME"):
        # gloo binds to the address the host name resolves to, or else to loopback and
        # advertises 127.0.0.1 to the other host: name the veth (see tests/hosts/README.md).
        env.setdefault("GLOO_SOCKET_IFNAME", os.environ["HOST_IFNAME"])
    env["WORLD_SIZE"] = str(WORLD)
    procs = {}
    for local in range(PER_HOST):
        rank = host * PER_HOST + local
        env_rank = {**env, "RANK": str(rank), "LOCAL_RANK": str(local)}
        command = [sys.executable, os.path.abspath(__file__), *argv, "--rank", str(rank)]
        procs[rank] = subprocess.Popen(command, env=env_rank)
    limit = time.monotonic() + 60 + args.observe  # before the cut, nothing should take long
    codes = {}
    while len(codes) < len(procs):
        for rank, proc in procs.items():
            if rank not in codes and proc.poll() is not None:
                codes[rank] = proc.returncode
        cut_age = time.time() - done_path.stat().st_mtime if done_path.exists() else None
        overdue = cut_age is not None and cut_age > args.observe + 1
        if overdue or time.monotonic() > limit:
            for rank, proc in procs.items():
                if rank not in codes:
                    proc.kill()
                    proc.wait(timeout=10)
                    codes[rank] = blocked(rank, host, shared, cut_age)
        time.sleep(0.05)
    ordered = [codes[rank] for rank in sorted(codes)]
    print(f"host {os.environ['HOST_NAME']}: ranks exited {ordered}", file=sys.stderr)
    if any(code not in (0, CUT_OFF) for code in ordered):
        return 1
    return CUT_OFF if CUT_OFF in ordered else 0


def blocked(rank: int, host: int, shared: Path, cut_age: float | None) -> int:
    """Report for a rank killed while still blocked; its exit code as the harness sees it."""
    stack = shared / f"stack-{rank}.txt"
    threads: dict[str, list[str]] = {}
    if stack.exists():  # faulthandler's dump, after the threads' names (first line)
        head, _, dump = stack.read_text().partition("\n")
        names = json.loads(head)
        frames: list[str] = []
        for line in dump.splitlines():
            if line.startswith(("Thread 0x", "Current thread 0x")):
                ident = line.split("0x", 1)[1].split()[0]
                frames = threads.setdefault(names.get(f"0x{ident}", f"0x{ident}"), [])
            elif line.strip().startswith("File") and "threading.py" not in line and len(frames) < 4:
                frames.append(line.strip())
    watch = shared / f"watch-{rank}.json"
    report = {
        "rank": rank,
        "host": socket.gethostname(),
        "type": None,
        "message": "no error: still blocked when its host killed it",
        "seconds from the cut": None if cut_age is None else round(cut_age, 2),
        "blocked in (innermost first)": threads,
        "watch state": json.loads(watch.read_text()) if watch.exists() else None,
    }
    emit(report)
    return CUT_OFF if host == 1 and cut_age is not None else 1


# ------------------------------------------------------------------ a rank


def emit(report: dict[str, Any]) -> None:
    """One JSON line in one write: the two ranks of a host share one output file."""
    os.write(sys.stdout.fileno(), (json.dumps(report) + "\n").encode())


def wait_for(what: str, ready: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {seconds:g} s")
        time.sleep(0.02)


def watch_state(watch: Any) -> dict[str, Any] | None:
    """What the watch knows: the lost ranks (and when it learned), its ring link, its errors."""
    if watch is None:
        return None
    link = watch._ring.succ  # private, for this report only: which rank this one watches
    failure = watch._failure
    cut = Path(os.environ["PARTITION_DONE"])
    cut_at = cut.stat().st_mtime if cut.exists() else None
    learned = {r: watch.learned_at(r) for r in sorted(watch.lost())}
    return {
        "lost": sorted(watch.lost()),
        "learned (s after the cut)": {
            r: None if t is None or cut_at is None else round(t - cut_at, 2)
            for r, t in learned.items()
        },
        "watches rank": None if link is None else link[0],
        "thread's last error": None if failure is None else f"{type(failure).__name__}: {failure}",
    }


def keep_writing_state(watch: Any, path: Path) -> None:
    """Write what ``watch`` knows to ``path`` every second, for a report if this rank hangs."""

    def loop() -> None:
        while True:
            state = watch_state(watch)
            path.with_suffix(".tmp").write_text(json.dumps(state))
            path.with_suffix(".tmp").replace(path)
            time.sleep(1.0)

    threading.Thread(target=loop, name="two-hosts-watch-state", daemon=True).start()


def unmet(report: dict[str, Any], ranks: list[int], rank: int, seconds: float) -> str | None:
    """Why ``report`` misses issue 22's bar (the peer named unreachable or dead, in time)."""
    peer = next(r for r in ranks if r != rank)
    message = str(report["message"])
    named = re.search(rf"\brank {peer}\b[^\n]*\b(unreachable|dead|died)\b", message)
    if report["type"] is None or not named:
        return f"the error does not name rank {peer} as unreachable or dead"
    if "different orders" in message or "deadlock" in message:
        return "the error blames the order of requests"
    if report["seconds to the error"] > seconds:
        return f"the error came after {report['seconds to the error']} s, not within {seconds:g} s"
    return None


def rank_main(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", "Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    from scopedmesh import LivenessWatch, ProcessGroupMesh

    rank = args.rank
    host = os.environ["HOST_NAME"]
    request_path = Path(os.environ["PARTITION_REQUEST"])
    done_path = Path(os.environ["PARTITION_DONE"])
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=args.store_timeout),
    )
    store = dist.distributed_c10d._get_default_store()
    mesh = ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=args.timeout)
    watch = LivenessWatch(timeout=args.timeout) if args.watch else None
    if watch is not None:
        watch.guard(mesh)
    sums = {}
    for axis in ("tp", "dp"):
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=mesh.get_group_along_axis(axis))
        sums[axis] = int(tensor.item())
    if sums != {"tp": 2, "dp": 2}:
        raise RuntimeError(f"rank {rank}: first all-reduces gave {sums}, expected 2 on each")

    # Every rank has finished its first collectives; then rank 0 asks for the cut.
    store.add("two-hosts/ready", 1)
    wait_for("every rank ready", lambda: store.add("two-hosts/ready", 0) == WORLD, args.timeout)
    if rank == 0:
        request_path.touch()
    wait_for("the partition", done_path.exists, args.timeout)
    cut_at = done_path.stat().st_mtime

    fresh = ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=args.timeout)
    if watch is not None:
        watch.guard(fresh)
    ranks = list(fresh.layout.group(fresh.coordinate(), "dp"))
    shared = Path(os.environ["TWO_HOSTS_DIR"])
    if watch is not None:  # the watch has its thread already: one more changes nothing
        keep_writing_state(watch, shared / f"watch-{rank}.json")
    stack_file = (shared / f"stack-{rank}.txt").open("w")
    names = {f"0x{t.ident:016x}": t.name for t in threading.enumerate()}  # for the dump
    stack_file.write(json.dumps(names) + "\n")
    stack_file.flush()
    # A C-level timer, not a Python thread: the library forms groups differently when
    # other Python threads run, and the run without a watch must have none.
    faulthandler.dump_traceback_later(args.observe - 0.5, file=stack_file)
    started, started_wall = time.monotonic(), time.time()
    report: dict[str, Any] = {
        "rank": rank,
        "host": socket.gethostname(),
        "watch": args.watch,
        "request": f"a fresh mesh's dp group over ranks {ranks}",
        "requested after the cut (s)": round(started_wall - cut_at, 2),
    }
    try:
        fresh.get_group_along_axis("dp")
    except Exception as error:  # the point: what the rank is told
        report["type"] = f"{type(error).__module__}.{type(error).__qualname__}"
        report["message"] = str(error)
    else:
        report["type"] = None
        report["message"] = "the group formed across a partition"
    report["seconds to the error"] = round(time.monotonic() - started, 2)
    report["seconds from the cut"] = round(time.time() - cut_at, 2)
    report["watch state"] = watch_state(watch)
    faulthandler.cancel_dump_traceback_later()
    failed = None
    if args.expect_unreachable is not None and host == "hostA":
        failed = unmet(report, ranks, rank, args.expect_unreachable)
        report["expectation"] = failed or "met"
    emit(report)

    if host == "hostB":
        # Cut off from the store: closing anything here would wait for it. Leave now.
        sys.stdout.flush()
        os._exit(CUT_OFF)
    if report["type"] is None or failed:
        return 1  # a group formed across a partition (the harness is broken), or a miss
    fresh.close()
    mesh.close()
    if watch is not None:
        watch.close()
    # Rank 0 serves the store: it stays until rank 1's last store request is answered.
    if rank == 1:
        store.set("two-hosts/bye/1", "1")
    else:
        store.wait(["two-hosts/bye/1"], timedelta(seconds=30))
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    if args.rank is None:
        return host_main(args, argv)
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
