"""Time to diagnosis: how long a rank waits before a group that can never form is reported.

    python -m benchmarks.diagnosis              # 20 runs of each case
    python -m benchmarks.diagnosis --runs 5

Cases, each on real gloo ranks over loopback, with the mesh's default timeout
(torch's 30 minutes for gloo, which is what a user waited before) and the
default grace period (0.5 s):

* **cycle3**: three ranks ask for the groups {0,1}, {1,2}, {0,2} in rotated
  orders, a certain deadlock. One world; each run is one deadlock, and its
  figure is the slowest rank's wait, from its request to its
  ``GroupFormationError``. The runs follow each other in the same world, so they
  also show that the groups are usable right after a diagnosis.
* **cycle4**: four ranks of a 2 x 2 mesh ask for dp and tp in opposite orders.
* **dead**: two ranks; rank 1 exits (``os._exit``) after forming a group with
  rank 0, which then asks for another. A new world per run; the figure is rank
  0's wait, from its request (made once rank 1's process is gone) to its error.

Medians and maxima of the runs are printed as a table; nothing is asserted on
them (``tests/world/test_diagnosis.py`` runs two of each and checks the counts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d.diagnosis import process_gone
from scopedmesh.errors import GroupFormationError

CYCLE3 = {0: [0, 1], 1: [1, 2], 2: [0, 2]}


def _wait(mesh: Any, axis: Any, indices: Any = None) -> tuple[float, str]:
    """Seconds from the request to its error, and the error's text."""
    started = time.perf_counter()
    try:
        mesh.get_group_along_axis(axis, indices_at_axis=indices)
    except GroupFormationError as error:
        return time.perf_counter() - started, str(error)
    return time.perf_counter() - started, "formed"


def cycles(rank: int, world_size: int, runs: int) -> list[tuple[float, str]]:
    """``runs`` deadlocks in a row on this world: this rank's wait for each."""
    from scopedmesh import ProcessGroupMesh

    out = []
    for _ in range(runs):
        dist.barrier()
        if world_size == 3:
            with ProcessGroupMesh(3, names=("x",)) as mesh:
                out.append(_wait(mesh, "x", CYCLE3[rank]))
        else:
            order = ("dp", "tp") if rank in (0, 3) else ("tp", "dp")
            with ProcessGroupMesh(2, 2, names=("dp", "tp")) as mesh:
                out.append(_wait(mesh, order[0]))
    dist.barrier()
    return out


def dead(rank: int, world_size: int) -> tuple[float, str] | None:
    """Rank 1 forms a group with rank 0, then exits; rank 0 asks for another group."""
    from scopedmesh import ProcessGroupMesh
    from scopedmesh.c10d.groups import default_store

    store = default_store()
    with ProcessGroupMesh(2, names=("x",)) as mesh:
        mesh.get_group_along_axis("x")
    store.set(f"bench-diagnosis/pid/{rank}", str(os.getpid()))
    dist.barrier()
    if rank == 1:
        os._exit(0)
    pid = int(store.get("bench-diagnosis/pid/1"))
    end = time.monotonic() + 30
    while not process_gone(pid) and time.monotonic() < end:
        time.sleep(0.01)
    with ProcessGroupMesh(2, names=("x",)) as mesh:
        return _wait(mesh, "x")


def measure(runs: int) -> dict[str, list[float]]:
    """Per case, the seconds of each run (the slowest rank's, for the cycles)."""
    from scopedmesh.testing import run_world

    figures: dict[str, list[float]] = {}
    for case, size in (("cycle3", 3), ("cycle4", 4)):
        results = run_world(cycles, size, args=(runs,), timeout=60.0 + 10.0 * runs)
        for run in range(runs):
            waits = [results[rank][run] for rank in range(size)]
            if any(not text.startswith("deadlock in group formation") for _, text in waits):
                raise RuntimeError(f"{case} run {run}: not diagnosed as a deadlock: {waits}")
            figures.setdefault(case, []).append(max(seconds for seconds, _ in waits))
    for _ in range(runs):
        result = run_world(dead, 2, timeout=120.0, allow_exit=[1])[0]
        if result is None or "rank 1 has died" not in result[1]:
            raise RuntimeError(f"dead: not diagnosed: {result}")
        figures.setdefault("dead", []).append(result[0])
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diagnosis")
    parser.add_argument("--runs", type=int, default=20, help="runs of each case (default 20)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    torch.set_num_threads(1)
    figures = measure(args.runs)
    print(
        f"time to diagnosis, {args.runs} runs each (default grace 0.5 s, default timeout "
        f"30 min; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})"
    )
    print("| case | median | max |")
    print("|---|---|---|")
    for case, seconds in figures.items():
        print(f"| {case} | {statistics.median(seconds):.2f} s | {max(seconds):.2f} s |")


if __name__ == "__main__":
    main()
