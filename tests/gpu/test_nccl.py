"""NCCL on real GPUs: the gloo suite's guarantees, one for one (see gpu_workers.py).

World size = the GPUs present (an even number of them is used), or two ranks on one GPU
(``heal_nccl.place``). Skipped without a GPU.
``test_cpu_dry_run`` runs the same rank code on gloo so that the logic is proven here too.
"""

from __future__ import annotations

from typing import Any

import gpu_workers as workers
import pytest

from scopedmesh.testing import run_world


def world_size() -> int:
    return max(2, workers.gpus() - workers.gpus() % 2)  # two ranks on a lone GPU


def check_mesh(results: list[dict[str, Any]], kept_handle_fails: bool = True) -> None:
    n = len(results)
    for rank, f in enumerate(results):
        pair = rank - rank % 2
        assert f["tp_sum"] == pair + pair + 1
        assert f["dp_sum"] == sum(range(rank % 2, n, 2))
        assert f["tp_ranks"] == [pair, pair + 1]
        assert f["close_seconds"] < 30.0  # a never-hang bound, not a speed claim
        assert (f["kept_handle"] != "worked") is kept_handle_fails
        assert f["world_sum"] == n * (n - 1) // 2
        assert f["cycle_sums"] == [pair + pair + 1] * 5


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "device_id"])
def test_nccl_mesh_groups_close_and_recreate(bound: bool) -> None:
    n = world_size()
    check_mesh(run_world(workers.mesh_world, n, args=("nccl", bound), backend="nccl", timeout=180))


def test_nccl_fsdp2_and_tp_train_as_with_init_device_mesh() -> None:
    for f in run_world(
        workers.interop_world, world_size(), args=("nccl",), backend="nccl", timeout=180
    ):
        assert f["full_ok"] is True
        assert f["ours"] == pytest.approx(f["torchs"], rel=1e-12)


def test_nccl_heal_survivors_reform_and_train() -> None:
    n = world_size()
    results = run_world(
        workers.heal_world, n, args=("nccl",), backend="nccl", timeout=180, allow_exit=[n - 1]
    )
    for rank, f in enumerate(results):
        if rank == n - 1:
            assert f is None
            continue
        assert f is not None and f["lost"] == [n - 1]
        if rank // 2 == (n - 1) // 2:
            assert f["sat_out"] is True
        else:
            assert f["shape"] == (n // 2 - 1, 2)


def test_nccl_node_aware_mesh() -> None:
    for rank, f in enumerate(
        run_world(workers.nodes_world, world_size(), args=("nccl",), backend="nccl", timeout=180)
    ):
        assert rank in f["tp_ranks"] and len(f["tp_ranks"]) == 2
        assert f["tp_sum"] == sum(f["tp_ranks"])


def test_cpu_dry_run_of_the_mesh_checks() -> None:
    """The NCCL suite's rank code on gloo (CPU): its assertions hold where they can run.

    A kept gloo handle fails after close where this torch lets gloo groups be
    closable (from 2.12); before that it still works, as torch's own would.
    """
    from scopedmesh.c10d import closable

    results = run_world(workers.mesh_world, 4, args=("gloo", True), timeout=300)
    check_mesh(results, kept_handle_fails=closable.supported())
