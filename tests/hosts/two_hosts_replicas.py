"""A replica cut off from the network: the job goes on without it, and it rejoins (issue 39).

Run by the two-host harness (``tests/hosts/test_hosts.py`` runs it in the ``hosts`` lane)::

    bash .ci/two_hosts .venv/bin/python tests/hosts/two_hosts_replicas.py --cuts 3

Three replicas of one gloo rank each train a small model with
:class:`~scopedmesh.fault.replicas.Replicas`: replicas 0 and 1 on host A, which
also hosts the job's store (this script's host process there), and replica 2 on
host B. Host A's process directs the run:

1. **A stop is not a loss.** It stops replica 1 (SIGSTOP) for ``--stop`` seconds
   while the others wait for it in their all-reduce, then continues it; the
   job must still be in the same epoch, at full size.
2. **Each cut** (``--cuts``): it asks the harness for a silent partition (every
   packet across the veth dropped), then waits for replica 0 to commit a step
   of the reduced job (replicas 0 and 1), and records the seconds from the cut to
   that step. Replica 2 must learn that it was cut off (``LostRankError``), and
   commit nothing while cut off. After a few reduced steps the link is healed;
   replica 2 then starts a new incarnation (a new ``Replicas``) that rejoins,
   and the job is back to 3 replicas. The last ``--held`` cuts land while
   replica 2 waits for the job's store after a step's all-reduce (its request
   for the count of joins is held until the cut is made, then sent across it):
   a store request across a cut never returns by itself.
3. **The end.** Every replica ends on the same step with the same weights: one
   history of the job, never two.

Host A prints one JSON line, ``{"result": ...}``, with the figures; it exits 1 (and
says why) if any check fails. Every wait is bounded (``--bound``).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPLICAS = 3
CUT_REPLICA = 2  # the replica on host B
STOPPED_REPLICA = 1


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuts", type=int, default=3, help="cuts to make, one after another")
    parser.add_argument(
        "--held", type=int, default=1, help="the last N cuts land in replica 2's store request"
    )
    parser.add_argument("--stop", type=float, default=3.0, help="seconds replica 1 is stopped")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds a step sleeps")
    parser.add_argument("--timeout", type=float, default=30.0, help="Replicas' timeout (s)")
    parser.add_argument("--bound", type=float, default=60.0, help="bound on every wait (s)")
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def shared() -> Path:
    return Path(os.environ["TWO_HOSTS_DIR"])


def log_path(replica: int) -> Path:
    return shared() / f"replica-{replica}.jsonl"


def emit(replica: int, **event: Any) -> None:
    """One event of a replica, one line in one write, with the wall time."""
    line = json.dumps({"t": time.time(), **event}) + "\n"
    fd = os.open(log_path(replica), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def stack_path(replica: int) -> Path:
    return shared() / f"replica-{replica}.stacks"


def events(replica: int) -> list[dict[str, Any]]:
    path = log_path(replica)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------ a replica


def replica_main(args: argparse.Namespace) -> int:
    """One replica: train until the agreed end step, rejoining after a cut."""
    warnings.filterwarnings("ignore", "Failed to initialize NumPy")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from scopedmesh.c10d.store import ReplicaKeys
    from scopedmesh.errors import LostRankError
    from scopedmesh.fault.replicas import Replicas

    replica = args.replica
    stacks = stack_path(replica).open("w")  # host B's bound asks for them (SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    class Progress:
        def __init__(self) -> None:
            self.step, self.end = 0, 0

        def state_dict(self) -> dict[str, int]:
            return {"step": self.step, "end": self.end}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.step, self.end = int(state["step"]), int(state["end"])

    progress = Progress()
    state = {"model": model, "optim": optim, "progress": progress}
    end_file = shared() / "end"
    joins = ReplicaKeys().joins
    stepping = False  # inside all_reduce_: its only read of the joins is the step's own

    class HoldingStore(dist.TCPStore):
        """The job's store, whose read of the joins waits, when host A asks (``hold-N``),
        until host A has cut the link (``release-N``): the request goes across the cut."""

        def add(self, key: str, value: int) -> int:
            if stepping and replica == CUT_REPLICA and key == joins and value == 0:
                asked = sorted(h for h in shared().glob("hold-*") if not h.suffix)
                held = [h for h in asked if not h.with_name(h.name + ".held").exists()]
                if held:
                    held[0].with_name(held[0].name + ".held").touch()
                    release = held[0].with_name(held[0].name.replace("hold", "release"))
                    wait_for("host A's release of the held request", release.exists, args.bound)
                    emit(replica, event="held", token=grow.token)
            return int(super().add(key, value))

    incarnation = 0
    while True:
        store = HoldingStore(host, port, is_master=False, timeout=timedelta(seconds=args.bound))
        grow = Replicas(
            store, replica=replica, replicas=REPLICAS, state=state, timeout=args.timeout
        )
        emit(replica, event="start", incarnation=incarnation, token=grow.token)
        try:
            with grow:
                while True:
                    decision = grow.boundary()
                    if progress.end and progress.step >= progress.end:
                        if grow.finish():
                            break
                        continue
                    g = torch.Generator().manual_seed(progress.step * 7 + replica)
                    x = torch.randn(16, 8, generator=g)
                    optim.zero_grad()
                    model(x).pow(2).mean().backward()
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    flag = torch.tensor([1.0 if end_file.exists() else 0.0])
                    began, stepping = time.time(), True
                    committed = grow.all_reduce_([*grads, flag])
                    stepping = False
                    if committed:
                        optim.step()
                        progress.step += 1
                        if float(flag) > 0 and not progress.end:
                            progress.end = progress.step + 5  # agreed: the same on every member
                        emit(
                            replica,
                            event="step",
                            step=progress.step,
                            epoch=decision.epoch,
                            size=decision.size,
                            token=grow.token,
                        )
                    else:
                        emit(
                            replica,
                            event="failed",
                            epoch=decision.epoch,
                            why=grow.failure,
                            began=began,
                        )
                    time.sleep(args.pace)
        except LostRankError as error:
            emit(replica, event="lost", token=grow.token, message=str(error))
            deadline = time.monotonic() + args.bound
            while not reachable(host, port):  # the store's host: back once the cut heals
                if time.monotonic() > deadline:
                    emit(replica, event="error", message=f"no store after {args.bound:g} s")
                    return 1
                time.sleep(0.1)
            incarnation += 1
            continue
        digest = hashlib.sha256()
        for tensor in model.state_dict().values():
            digest.update(bytes(tensor.detach().contiguous().flatten().view(torch.uint8).tolist()))
        emit(replica, event="end", step=progress.step, digest=digest.hexdigest())
        return 0


# ------------------------------------------------------------------ the hosts


def spawn(replica: int, argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    # gloo binds to the address the host name resolves to: name the veth (tests/hosts/README.md)
    env.setdefault("GLOO_SOCKET_IFNAME", os.environ["HOST_IFNAME"])
    command = [sys.executable, os.path.abspath(__file__), *argv, "--replica", str(replica)]
    return subprocess.Popen(command, env=env)


def wait_for(what: str, ready: Any, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {seconds:g} s")
        time.sleep(0.02)


def steps_of(replica: int, since: float = 0.0, size: int | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in events(replica)
        if e["event"] == "step" and e["t"] > since and (size is None or e["size"] == size)
    ]


def direct(args: argparse.Namespace, procs: dict[int, subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Host A's part: the stop, the cuts, the end; the figures, or AssertionError."""
    bound = args.bound
    wait_for("10 steps at full size", lambda: len(steps_of(0, size=REPLICAS)) >= 10, bound)

    # 1. A stopped process answers through its kernel: it is never lost.
    before = steps_of(0)[-1]
    os.kill(procs[STOPPED_REPLICA].pid, signal.SIGSTOP)
    time.sleep(args.stop)
    os.kill(procs[STOPPED_REPLICA].pid, signal.SIGCONT)
    wait_for("5 steps after the stop", lambda: len(steps_of(0, since=before["t"])) >= 5, bound)
    after = steps_of(0, since=before["t"])
    if {(e["epoch"], e["size"]) for e in after} != {(before["epoch"], REPLICAS)}:
        raise AssertionError(f"a stopped replica changed the job: {before} then {after[:5]}")

    detections, lost_after, messages = [], [], []
    failed_after: list[float | None] = []
    cut_in_place: list[float] = []
    for cut in range(1, args.cuts + 1):
        start = steps_of(CUT_REPLICA)
        wait_for(
            f"cut {cut}: replica 2 in step",
            lambda since=start[-1]["t"] if start else 0.0: len(steps_of(CUT_REPLICA, since)) >= 5,
            bound,
        )
        held = cut > args.cuts - args.held
        if held:  # replica 2's next read of the joins waits until the cut is made
            (shared() / f"hold-{cut}").touch()
            wait_for(
                f"cut {cut}: replica 2's request held",
                (shared() / f"hold-{cut}.held").exists,
                bound,
            )
        (shared() / f"cut-{cut}").touch()
        done = shared() / f"cut-{cut}.done"
        wait_for(f"cut {cut} made", done.exists, 10)
        if held:
            (shared() / f"release-{cut}").touch()
        cut_at = float(done.read_text())  # the cut began (before the harness's commands)
        cut_in_place.append(round(done.stat().st_mtime - cut_at, 3))  # ... and was made
        reduced = wait_for(
            f"cut {cut}: a step without replica 2",
            lambda cut_at=cut_at: steps_of(0, since=cut_at, size=REPLICAS - 1),
            args.timeout,  # a functional bound: the heal no longer waits out the timeout
        )
        detections.append(round(reduced[0]["t"] - cut_at, 3))
        failed = [e for e in events(0) if e["event"] == "failed" and e["t"] > cut_at]
        failed_after.append(round(failed[0]["t"] - cut_at, 3) if failed else None)
        lost = wait_for(
            f"cut {cut}: replica 2 told it was cut off",
            lambda cut_at=cut_at: [
                e for e in events(CUT_REPLICA) if e["event"] == "lost" and e["t"] > cut_at
            ],
            bound,
        )
        lost_after.append(round(lost[0]["t"] - cut_at, 3))
        messages.append(lost[0]["message"])
        wait_for(
            f"cut {cut}: 5 reduced steps",
            lambda cut_at=cut_at: len(steps_of(0, since=cut_at, size=REPLICAS - 1)) >= 5,
            bound,
        )
        (shared() / f"heal-{cut}").touch()
        healed = shared() / f"heal-{cut}.done"
        wait_for(f"heal {cut} made", healed.exists, 10)
        healed_at = float(healed.read_text())
        # Never two views: whatever the cut-off incarnation committed from the cut on (a step
        # whose verdict crossed before the link went) the survivors committed too.
        theirs = {(e["epoch"], e["step"]) for e in steps_of(0)}
        alone = [
            e
            for e in steps_of(CUT_REPLICA, since=cut_at)
            if e["t"] < healed_at and (e["epoch"], e["step"]) not in theirs
        ]
        if alone:
            raise AssertionError(f"cut {cut}: replica 2 committed steps on its own: {alone}")
        regrown = wait_for(
            f"cut {cut}: the job back to 3 replicas",
            lambda healed_at=healed_at: steps_of(0, since=healed_at, size=REPLICAS),
            bound,
        )
        tokens = {e["token"] for e in steps_of(CUT_REPLICA, since=healed_at)}
        if lost[0]["token"] in tokens:
            raise AssertionError(f"cut {cut}: the cut-off incarnation went on: {tokens}")
        del regrown
    (shared() / "end").touch()
    return {
        "load average": os.getloadavg(),
        "cuts": args.cuts,
        "cut -> first step without replica 2 (s)": detections,
        "median (s)": statistics.median(detections) if detections else None,
        "max (s)": max(detections) if detections else None,
        "cut began -> both sides' rules in place (s)": cut_in_place,
        "cut -> replica 0's step failed (s)": failed_after,
        "cut -> replica 2 raised LostRankError (s)": lost_after,
        "replica 2 was told": messages,
        "requests held across a cut": len([e for e in events(CUT_REPLICA) if e["event"] == "held"]),
    }


def host_main(args: argparse.Namespace, argv: list[str]) -> int:
    index = int(os.environ["HOST_INDEX"])
    if index == 1:  # host B: replica 2 only
        proc = spawn(CUT_REPLICA, argv)
        try:
            return proc.wait(timeout=args.bound * (args.cuts + 4))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # its threads' stacks (faulthandler), then its end
            time.sleep(2)
            proc.kill()
            print("host B: replica 2 still running at the bound", file=sys.stderr)
            stacks = stack_path(CUT_REPLICA)
            print(stacks.read_text() if stacks.exists() else "(no stacks)", file=sys.stderr)
            last = [json.dumps(e) for e in events(CUT_REPLICA)[-12:]]
            print("replica 2's last events:", *last, sep="\n  ", file=sys.stderr)
            return 1
    from datetime import timedelta

    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(  # the job's store, on host A: the majority's side of every cut
        os.environ["MASTER_ADDR"],
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.bound),
    )
    procs = {r: spawn(r, argv) for r in (0, 1)}
    failure = None
    result: dict[str, Any] = {}
    try:
        result = direct(args, procs)
        ends = wait_for(
            "every replica's end",
            lambda: (lambda e: e if len(e) == REPLICAS else None)(
                {r: x for r in range(REPLICAS) for x in events(r) if x["event"] == "end"}
            ),
            args.bound,
        )
        if len({(x["step"], x["digest"]) for x in ends.values()}) != 1:
            raise AssertionError(f"the replicas ended apart: {ends}")
        result["end"] = ends[0]["step"]
    except (AssertionError, TimeoutError) as error:
        failure = f"{type(error).__name__}: {error}"
    for r, proc in procs.items():
        if failure is not None:
            proc.kill()  # the job cannot end by itself now
        try:
            code = proc.wait(timeout=args.bound)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        if code != 0 and failure is None:
            failure = f"replica {r} exited {code}"
    errors = [e for r in range(REPLICAS) for e in events(r) if e["event"] == "error"]
    if errors and failure is None:
        failure = f"errors: {errors}"
    print(json.dumps({"result": result, "failure": failure}), flush=True)
    del store
    return 0 if failure is None else 1


def main() -> int:
    argv = sys.argv[1:]
    args = arguments(argv)
    if args.replica is not None:
        return replica_main(args)
    return host_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
