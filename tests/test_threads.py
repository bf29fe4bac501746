"""What one mesh promises under threads (see ``ProcessGroupMesh``'s THREADS note), in a gloo world."""

from __future__ import annotations

from typing import Any

import _workers_threads as workers
import pytest

from scopedmesh.testing import run_world

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
    return run_world(workers.threads_world, WORLD, args=(10, 0), timeout=600, init_timeout=60)


def test_threads_share_one_mesh_and_meshes_per_thread_are_independent(
    short: list[dict[str, Any]],
) -> None:
    _check(short, 10)


@pytest.mark.slow
def test_threads_long() -> None:
    results = run_world(workers.threads_world, WORLD, args=(200, 1), timeout=3000, init_timeout=60)
    _check(results, 200)
