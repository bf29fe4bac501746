"""What one mesh promises under threads (see ``ProcessGroupMesh``'s THREADS note), in a gloo world."""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.mesh import ProcessGroupMesh
from scopedmesh.testing import run_world

# ------------------------------------------------------------ what each rank runs

NAMES = ("dp", "tp")


def summed(group: dist.ProcessGroup | None) -> int:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _run_threads(targets: list[Callable[[], Any]]) -> list[Any]:
    """Run each target in its own thread; return results (or the traceback text) in order."""
    results: list[Any] = [None] * len(targets)

    def body(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException:
            results[i] = "error: " + traceback.format_exc()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return ["error: thread still running" if t.is_alive() else r for t, r in zip(threads, results)]


def threads_world(rank: int, world: int, schedules: int, seed: int) -> dict[str, Any]:
    baseline = _c10d.live_group_count()
    report: dict[str, Any] = {"rank": rank}
    rng = random.Random(seed)  # the same jitter on every rank: schedules differ per round
    same: list[dict[str, Any]] = []
    for _ in range(schedules):
        jitter = [rng.random() * 0.02 for _ in range(6)]
        with ProcessGroupMesh(2, world // 2, names=NAMES, timeout=30) as mesh:
            gate = threading.Barrier(len(jitter))

            def ask(
                delay: float, mesh: ProcessGroupMesh = mesh, gate: threading.Barrier = gate
            ) -> int:
                gate.wait(30)
                time.sleep(delay)
                return id(mesh.get_group_along_axis("tp"))

            ids = _run_threads([lambda d=d: ask(d) for d in jitter])
            made = _c10d.live_group_count() - baseline
            tp = mesh.get_group_along_axis("tp")
            same.append(
                {
                    "distinct": len({str(i) for i in ids}),
                    "errors": [i for i in ids if isinstance(i, str)],
                    "made": made,
                    "sum": summed(tp),
                }
            )
        dist.barrier()
    report["same_group"] = same

    # A background thread makes dp while the main thread keeps using tp.
    with ProcessGroupMesh(2, world // 2, names=NAMES, timeout=30) as mesh:
        tp = mesh.get_group_along_axis("tp")
        box: dict[str, Any] = {}

        def background() -> None:
            box["dp_sum"] = summed(mesh.get_group_along_axis("dp"))

        worker = threading.Thread(target=background)
        worker.start()
        tp_sums = [summed(tp) for _ in range(20)]
        worker.join(60)
        report["background"] = {"tp_sums": sorted(set(tp_sums)), **box}
    dist.barrier()

    # Independent meshes in two threads, over different ranks at any moment: one makes
    # tp groups, the other dp groups, each in its own open/use/close cycles.
    def cycles(axis: str) -> list[int]:
        out = []
        for _ in range(5):
            with ProcessGroupMesh(2, world // 2, names=NAMES, timeout=30) as own:
                out.append(summed(own.get_group_along_axis(axis)))
        return out

    report["independent"] = _run_threads([lambda: cycles("tp"), lambda: cycles("dp")])
    dist.barrier()
    report["leaked"] = _c10d.live_group_count() - baseline
    return report


# ------------------------------------------------------------ the tests

WORLD = 4


def _check(results: list[dict[str, Any]], schedules: int) -> None:
    for r in results:
        assert len(r["same_group"]) == schedules
        for round_ in r["same_group"]:
            assert round_["errors"] == [], round_["errors"]
            assert round_["distinct"] == 1, round_  # 6 threads asked, one group object
            assert round_["made"] == 1, round_  # made once
            assert round_["sum"] == WORLD // 2
        assert r["background"] == {"tp_sums": [WORLD // 2], "dp_sum": 2}, r["background"]
        assert r["independent"] == [[WORLD // 2] * 5, [2] * 5], r["independent"]
        assert r["leaked"] == 0
    print(f"\nRELIABILITY thread schedules: {schedules} x 6 threads per rank, {WORLD} ranks")


@pytest.fixture(scope="module")
def short() -> list[dict[str, Any]]:
    return run_world(threads_world, WORLD, args=(10, 0), timeout=600, init_timeout=60)


def test_threads_share_one_mesh_and_meshes_per_thread_are_independent(
    short: list[dict[str, Any]],
) -> None:
    _check(short, 10)


@pytest.mark.slow
def test_threads_long() -> None:
    results = run_world(threads_world, WORLD, args=(200, 1), timeout=3000, init_timeout=60)
    _check(results, 200)
