"""The liveness watch at 256 .. 4,096 members on one machine: store load, detection, agreement.

    python -m benchmarks.watch_scale                      # 256, 1024 and 4096 members
    python -m benchmarks.watch_scale --sizes 1024 --kills 20
    python -m benchmarks.watch_scale --sizes 4096 --idle-only   # the idle load alone

One real ``TCPStore`` (this process), and worker processes
(:mod:`benchmarks.watch_members`) hosting the members: most in processes of up
to ``--per-process`` members, the last ``--nodes`` x 8 in processes of 8 (a
node each). Every member is a real :class:`~scopedmesh.LivenessWatch` with its
ring sockets and threads, and no process group. Per size, one row:

* **idle**: store requests per second while nothing happens (counted by the
  members' clients over ``--idle`` seconds);
* **detect**: from a kill until every live member has learned it, median and
  max over ``--kills`` kills at random moments, sent from here: a member
  vanishing as a SIGKILL would make it (its sockets closed, no goodbye), and
  every fifth kill a node's process SIGKILLed (8 members at once);
* **agree**: every live member calls ``agree`` after one death, after two at
  once and after a node's 8: the slowest member's time, the store requests per
  member, and whether every member decided the same lost set, the one killed.

torch's store server looks up each new client in DNS on its one thread (5 s
when the resolver drops the query: docs/measured.md, "The 5 s outliers"), and a
harness opens thousands of clients at once. Run as root where ``unshare`` is
available, the benchmark re-runs itself in a mount namespace whose resolver
answers at once (``--resolver system`` keeps the machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
NODE = 8  # members per node process


class Worker:
    """One worker process: its members, and a line protocol over its stdin and stdout."""

    def __init__(self, port: int, world: int, first: int, last: int, interval: float) -> None:
        self.first, self.last = first, last
        self.members = set(range(first, last))
        command = ["benchmarks.watch_members", port, world, first, last, "--interval", interval]
        self.process = subprocess.Popen(
            [sys.executable, "-m", *map(str, command)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.dead = False

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.first}..{self.last - 1} ended")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str) -> dict[str, Any]:
        self.send(command)
        return self.reply()


def _ask_all(workers: list[Worker], command: str) -> list[dict[str, Any]]:
    live = [w for w in workers if not w.dead]
    for worker in live:
        worker.send(command)
    return [worker.reply() for worker in live]


def _wait_known(workers: list[Worker], victims: list[int], limit: float = 60.0) -> float:
    """Wait until every live member knows every victim died; the latest learning time."""
    deadline = time.monotonic() + limit
    while True:
        latest, missing = 0.0, 0
        for victim in victims:
            for answer in _ask_all(workers, f"known {victim}"):
                missing += answer["alive"] - answer["known"]
                latest = max(latest, answer["latest"])
        if missing == 0:
            return latest
        if time.monotonic() > deadline:
            raise TimeoutError(f"{missing} learnings of {victims} missing after {limit} s")
        time.sleep(0.05)


def _agree(workers: list[Worker], tag: str, lost: set[int]) -> dict[str, Any]:
    answers = _ask_all(workers, f"agree {tag}")
    decisions = {tuple(d) for a in answers for d in a["decisions"]}
    members = sum(a["members"] for a in answers)
    return {
        "took": max(a["took"] for a in answers),
        "per_member": sum(a["requests"] for a in answers) / members,
        "same": decisions == {tuple(sorted(lost))},
    }


def run_size(size: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(size)
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    nodes = min(args.nodes, size // (4 * NODE))
    big = size - nodes * NODE
    bounds = [(a, min(a + args.per_process, big)) for a in range(0, big, args.per_process)]
    bounds += [(big + i * NODE, big + (i + 1) * NODE) for i in range(nodes)]
    started = time.monotonic()
    workers = [Worker(server.port, size, a, b, args.interval) for a, b in bounds]
    for worker in workers:
        worker.reply()  # ready
    row: dict[str, Any] = {"members": size, "start_s": round(time.monotonic() - started, 1)}
    before = sum(a["requests"] for a in _ask_all(workers, "count"))
    time.sleep(args.idle)
    after = sum(a["requests"] for a in _ask_all(workers, "count"))
    row["idle_per_s"] = round((after - before) / args.idle, 1)
    if args.idle_only:
        _ask_all(workers, "close")
        for worker in workers:
            worker.process.wait(timeout=300)
        return row
    singles = [w for w in workers if len(w.members) > NODE]
    node_workers = [w for w in workers if len(w.members) == NODE]
    lost: set[int] = set()

    def vanish(count: int) -> tuple[float, list[int]]:
        victims = []
        for _ in range(count):
            worker = rng.choice(singles)
            victim = rng.choice(sorted(worker.members))
            worker.members.discard(victim)
            victims.append(victim)
        at = time.time()
        for victim in victims:
            owner = next(w for w in singles if w.first <= victim < w.last)
            owner.ask(f"vanish {victim}")
        return at, victims

    def kill_node() -> tuple[float, list[int]]:
        worker = node_workers.pop(rng.randrange(len(node_workers)))
        at = time.time()
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        worker.dead = True
        return at, sorted(worker.members)

    detect: list[float] = []
    agreements: dict[str, dict[str, Any]] = {}
    for kill in range(args.kills):
        time.sleep(rng.uniform(0.05, 0.3))  # a random moment
        at, victims = kill_node() if kill % 5 == 4 and node_workers else vanish(1)
        lost.update(victims)
        detect.append(_wait_known(workers, victims) - at)
        if kill == 0:
            agreements["one death"] = _agree(workers, "one", lost)
    at, victims = vanish(2)
    lost.update(victims)
    detect.append(_wait_known(workers, victims) - at)
    agreements["two at once"] = _agree(workers, "two", lost)
    if node_workers:
        at, victims = kill_node()
        lost.update(victims)
        detect.append(_wait_known(workers, victims) - at)
        agreements["a node's 8"] = _agree(workers, "node", lost)
    row["detect_median_s"] = round(statistics.median(detect), 3)
    row["detect_max_s"] = round(max(detect), 3)
    row["kills"] = len(detect)
    row["agree"] = {
        name: {"took_s": round(a["took"], 3), "requests_per_member": round(a["per_member"], 1)}
        | ({} if a["same"] else {"DIFFERENT": True})
        for name, a in agreements.items()
    }
    _ask_all(workers, "close")
    for worker in workers:
        worker.process.wait(timeout=120)
    return row


def _in_private_resolver(argv: list[str]) -> None:
    """Re-run this command in a mount namespace whose resolver fails at once (no DNS wait)."""
    conf = Path(tempfile.mkdtemp()) / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\n")
    inner = " ".join(
        [sys.executable, "-m", "benchmarks.watch_scale", *argv, "--resolver", "system"]
    )
    script = f"mount --bind {conf} /etc/resolv.conf && exec {inner}"
    os.execvp("unshare", ["unshare", "-m", "sh", "-c", script])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--per-process", type=int, default=512)
    parser.add_argument("--nodes", type=int, default=6, help="node processes of 8 members")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle counted")
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--idle-only", action="store_true", help="start, count idle, close")
    parser.add_argument("--resolver", choices=["private", "system"], default="private")
    args = parser.parse_args()
    if args.resolver == "private" and os.geteuid() == 0 and shutil.which("unshare"):
        _in_private_resolver([a for a in sys.argv[1:] if a not in ("--resolver", "private")])
    for size in args.sizes:
        print(json.dumps(run_size(size, args)), flush=True)


if __name__ == "__main__":
    main()
