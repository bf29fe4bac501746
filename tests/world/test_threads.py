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


def flatten_while_another_thread_forms(rank: int, world: int) -> dict[str, Any]:
    """``_flatten`` on one mesh while another thread forms a group of another mesh.

    torch's ``new_group``, as ``_flatten`` calls it, is wrapped so that on its first
    call another thread forms the ``all`` group of a second mesh, and ``_flatten``
    goes on only once that group exists: the second mesh's group appears in torch's
    registry during ``_flatten``. It must stay the second mesh's: alive and usable
    after the first mesh has closed, destroyed only when its own mesh closes.
    """
    from torch.distributed import device_mesh as torch_device_mesh

    baseline = _c10d.live_group_count()
    other = ProcessGroupMesh(world, names=("all",), timeout=30)
    formed: dict[str, Any] = {}

    def form_other() -> None:
        formed["group"] = other.get_group_along_axis("all")

    real = torch_device_mesh.new_group

    def new_group_with_a_formation_between(*args: Any, **kwargs: Any) -> Any:
        if "group" not in formed:
            thread = threading.Thread(target=form_other)
            thread.start()
            thread.join(60)
        return real(*args, **kwargs)

    torch_device_mesh.new_group = new_group_with_a_formation_between  # type: ignore[attr-defined]
    out: dict[str, Any] = {}
    try:
        with ProcessGroupMesh(2, world // 2, 1, names=("dp", "cp", "tp"), timeout=30) as mesh:
            dm = mesh.to_device_mesh("cpu")
            flat = dm["cp", "tp"]._flatten("cp_tp")
            out["flat_ranks"] = dist.get_process_group_ranks(flat.get_group())
            out["flat_sum"] = summed(flat.get_group())
            out["live_in_block"] = _c10d.live_group_count() - baseline
    finally:
        torch_device_mesh.new_group = real  # type: ignore[attr-defined]
    group = formed["group"]
    out["other_live_after_close"] = _c10d.is_live(group)
    out["other_sum"] = summed(group) if out["other_live_after_close"] else None
    other.close()
    out["other_live_after_its_close"] = _c10d.is_live(group)
    out["leaked"] = _c10d.live_group_count() - baseline
    return out


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


def test_a_group_formed_by_another_thread_during_flatten_stays_its_owners() -> None:
    results = run_world(flatten_while_another_thread_forms, WORLD, timeout=300, init_timeout=60)
    for rank, out in enumerate(results):
        assert out["flat_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert out["flat_sum"] == 2
        # the mesh's dp, cp and tp groups, torch's flattened group and the other mesh's group
        assert out["live_in_block"] == 5
        assert out["other_live_after_close"], "the first mesh's close destroyed another's group"
        assert out["other_sum"] == WORLD
        assert not out["other_live_after_its_close"]
        assert out["leaked"] == 0  # torch's flattened group went with its scope


@pytest.mark.slow
def test_threads_long() -> None:
    results = run_world(threads_world, WORLD, args=(200, 1), timeout=3000, init_timeout=60)
    _check(results, 200)
