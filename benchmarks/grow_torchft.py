"""torchft 0.2.0 growing back, on the workload of ``benchmarks.grow``:
``python -m benchmarks.grow_torchft [--kills 3]``.

4 replicas x 1 rank, each a ``torchft.Manager`` (``ProcessGroupGloo``) under a
Lighthouse in this process (its tests' values: join timeout and quorum tick
100 ms, heartbeat timeout 200 ms; heartbeats every 100 ms), a 4 MiB all-reduce
per step and a ``--pace`` sleep, ranks forked from the same warm server as
``benchmarks.grow``. Once every replica has committed steps with all 4, a
random replica other than 0 is SIGKILLed at a random moment, and a fresh
process with the same replica id starts 1 s later; it recovers from a healthy
replica (torchft's checkpoint transport). Printed per kill, as ``benchmarks.grow``
prints them: death -> the survivors' first commit without it; the new process's
start -> its first commit with all 4; the survivors' longest step around the
rejoin minus their median step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import time
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

from scopedmesh.testing.launcher import world_context

REPLICAS = 4
LIGHTHOUSE = {"join_timeout_ms": 100, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 200}


def replica_main(index: int, outdir: str, lighthouse: str, numel: int, pace: float) -> None:
    """Train under a Manager until the launcher's stop file; commits to ``<outdir>``."""
    started = time.time()
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    weights = torch.zeros(numel)

    def load_state_dict(state: dict[str, Any]) -> None:
        weights.copy_(state["weights"])

    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"weights": weights},
        min_replica_size=2,
        replica_id=f"replica_{index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=100),
        timeout=timeout,
        init_sync=False,
    )
    commits: list[tuple[float, int]] = []
    out = Path(outdir, f"replica{index}-{os.getpid()}.json")
    try:
        while not Path(outdir, "stop").exists():
            manager.start_quorum()
            grad = torch.full_like(weights, float(index + 1))
            manager.allreduce(grad).wait()
            if manager.should_commit():
                weights.sub_(grad, alpha=0.1)
                commits.append((time.time(), manager.num_participants()))
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps({"started": started, "commits": commits}))
                tmp.replace(out)
            time.sleep(pace)
    finally:
        manager.shutdown(wait=False)
        os._exit(0)


def _commits(outdir: str, index: int, pid: int) -> list[tuple[float, int]]:
    path = Path(outdir, f"replica{index}-{pid}.json")
    try:
        return [tuple(c) for c in json.loads(path.read_text())["commits"]]  # type: ignore[misc]
    except (OSError, ValueError):
        return []


def _wait(condition: Any, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchft: waited {limit:g} s for {what}")
        time.sleep(0.01)


def one_kill(numel: int, pace: float, rng: random.Random) -> dict[str, float]:
    """One run: 4 replicas, one kill, one restart 1 s later; the figures."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, **LIGHTHOUSE)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    ctx = world_context()
    with TemporaryDirectory() as outdir:
        procs = {}
        for i in range(REPLICAS):
            procs[i] = ctx.Process(target=replica_main, args=(i, outdir, address, numel, pace))
            procs[i].start()
        try:
            pids = {i: p.pid for i, p in procs.items()}
            warm = lambda: all(  # noqa: E731
                sum(n == REPLICAS for _, n in _commits(outdir, i, pids[i])) >= 5 for i in pids
            )
            _wait(warm, 300, "every replica to commit with all 4")
            time.sleep(rng.uniform(0.5, 1.5))
            victim = rng.randrange(1, REPLICAS)
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.time()
            time.sleep(1.0)
            joiner = ctx.Process(target=replica_main, args=(victim, outdir, address, numel, pace))
            joiner.start()
            restarted = time.time()
            procs[REPLICAS] = joiner
            full = lambda: any(n == REPLICAS for _, n in _commits(outdir, victim, joiner.pid))  # noqa: E731
            _wait(full, 300, "the restarted replica's first commit with all 4")
            first_full = next(t for t, n in _commits(outdir, victim, joiner.pid) if n == REPLICAS)
            _wait(
                lambda: (
                    len(_commits(outdir, 0, pids[0])) > 0
                    and _commits(outdir, 0, pids[0])[-1][0] > first_full + 5 * pace
                ),
                60,
                "a few more steps",
            )
            Path(outdir, "stop").touch()
        finally:
            for p in procs.values():
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
        survivor = _commits(outdir, 0, pids[0])
    times = [t for t, _ in survivor]
    steps = [b - a for a, b in itertools.pairwise(times)]
    reduced = next(t for t, n in survivor if t > killed and n < REPLICAS)
    around = [
        b - a for a, b in itertools.pairwise(times) if b > restarted and a < first_full + pace
    ]
    return {
        "death_to_reduced": reduced - killed,
        "start_to_full": first_full - restarted,
        "stall": max(around) - statistics.median(steps),
        "median_step": statistics.median(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--pace", type=float, default=0.05)
    args = parser.parse_args()
    load = os.getloadavg()
    print(
        f"torchft 0.2.0 grow: {REPLICAS} replicas x 1 rank, gloo, "
        f"{args.numel * 4 / 2**20:g} MiB all_reduce per step, {args.kills} kills "
        f"(a run each), Lighthouse {LIGHTHOUSE}; load {load[0]:.1f}/{load[1]:.1f}"
    )
    rng = random.Random()
    print("kill  death->reduced  start->full  stall over median")
    for i in range(1, args.kills + 1):
        row = one_kill(args.numel, args.pace, rng)
        print(
            f"{i:4}  {row['death_to_reduced']:8.3f} s  {row['start_to_full']:8.3f} s  "
            f"{row['stall']:8.3f} s (median step {row['median_step']:.3f} s)"
        )
    load = os.getloadavg()
    print(f"load {load[0]:.1f}/{load[1]:.1f} after")


if __name__ == "__main__":
    main()
