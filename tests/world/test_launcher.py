"""Tests for scopedmesh.testing.launcher: worlds forked from the warm server, and spawned ones."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scopedmesh.testing import WorldError, free_port, run_world
from scopedmesh.testing.launcher import _describe_exit

# ------------------------------------------------------------ what each rank runs

BIG = 4 * 1024 * 1024  # bytes in the large result: more than any pipe buffer


def _record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def all_reduce_ranks(rank: int, world_size: int, pid_dir: str) -> dict[str, object]:
    _record_pid(pid_dir, rank)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": t.item(),
        "env_rank": os.environ["RANK"],
        "env_world_size": os.environ["WORLD_SIZE"],
        "env_local_rank": os.environ["LOCAL_RANK"],
        "flag": os.environ.get("SCOPEDMESH_TEST_FLAG"),
        "dist_rank": dist.get_rank(),
        "big": bytes([rank]) * BIG,
        "tensor": t,  # reaches the parent after this process has gone
    }


def raise_or_unpicklable(rank: int, world_size: int) -> object:
    # Both ranks finish joining WORLD first: under load, rank 1 could otherwise raise and
    # exit while rank 0 was still connecting to it (seen on a loaded compat run, 2.12.1).
    dist.barrier()
    if rank == 1:
        raise ValueError("boom from rank 1")
    return threading.Lock()  # cannot be pickled


def exit_on_rank(rank: int, world_size: int, bad_rank: int, code: int, pid_dir: str) -> int:
    _record_pid(pid_dir, rank)
    if rank == bad_rank:
        os._exit(code)
    time.sleep(3600)  # stands in for a collective that never completes
    return rank


def kill_self_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    # Every rank is connected first: gloo's connect of a slower peer fails once one has died.
    dist.barrier()
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank * 10


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def store_after_rank0_left(rank: int, world_size: int) -> int:
    """Rank 0 returns at once; the others use the store once its process has ended."""
    from _workers_common import wait_gone

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("rank0-pid", str(os.getpid()))
        return 0
    pid = int(store.get("rank0-pid"))
    if not wait_gone(pid):  # reported, torn down and exited: a zombie counts as gone
        raise AssertionError(f"rank 0 (pid {pid}) still running 30 s after it returned")
    return int(store.add("late-rank-count", 1))


# ------------------------------------------------------------ the tests


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]


def _assert_gone(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_results_in_rank_order_with_all_reduce_env_and_large_result(tmp_path: Path) -> None:
    results = run_world(
        all_reduce_ranks,
        2,
        args=(str(tmp_path),),
        env={"SCOPEDMESH_TEST_FLAG": "on"},
        timeout=120.0,
    )
    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert r["world_size"] == 2
        assert r["sum"] == 3.0
        env = (r["env_rank"], r["env_world_size"], r["env_local_rank"])
        assert env == (str(rank), "2", str(rank))
        assert r["dist_rank"] == rank
        assert r["flag"] == "on"
        assert r["big"] == bytes([rank]) * BIG
        assert r["tensor"].tolist() == [3.0]
    _assert_gone(_pids(tmp_path))


def test_exception_names_rank_and_text() -> None:
    with pytest.raises(WorldError) as info:
        run_world(raise_or_unpicklable, 2, timeout=120.0)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert set(err.failures) == {0, 1}
    assert "ValueError: boom from rank 1" in err.failures[1]
    assert "raise_or_unpicklable" in err.failures[1]  # the traceback, not just the message
    assert "could not be sent" in err.failures[0]
    assert "ranks [0, 1]" in str(err)
    assert "--- rank 1 ---" in str(err)
    assert "boom from rank 1" in str(err)
    assert multiprocessing.active_children() == []


def test_dead_rank_is_reported_promptly_and_nothing_is_left(tmp_path: Path) -> None:
    timeout = 90.0
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(exit_on_rank, 2, args=(1, 7, str(tmp_path)), timeout=timeout, grace=2.0)
    elapsed = time.monotonic() - start
    assert elapsed < timeout
    err = info.value
    assert set(err.failures) == {1}
    assert "exited with code 7" in err.failures[1]
    assert str(err).startswith("rank 1 of a world of 2 failed")
    assert err.still_running == [0]  # hung survivor: terminated after the grace period
    assert len(_pids(tmp_path)) == 2
    _assert_gone(_pids(tmp_path))


def test_allow_exit_returns_none_for_the_dead_rank() -> None:
    results = run_world(kill_self_on_rank, 2, args=(1,), allow_exit={1}, timeout=120.0)
    assert results == [0, None]
    assert multiprocessing.active_children() == []


def test_overall_timeout_kills_everyone() -> None:
    timeout = 1.0  # only needs to fire: the ranks sleep for an hour
    start = time.monotonic()
    with pytest.raises(WorldError, match="timed out") as info:
        run_world(sleep_forever, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 30.0  # SIGTERM, then SIGKILL after a couple of seconds
    assert "world of 2 ranks timed out after 1 s" in str(info.value)
    assert info.value.still_running == [0, 1]
    assert multiprocessing.active_children() == []


def test_the_store_outlives_a_rank_that_finished_first() -> None:
    # Rank 0 used to host the store: once it exited, a slower rank's store
    # request failed with "Connection was likely closed".
    results = run_world(store_after_rank0_left, 3, timeout=120)
    assert results[0] == 0
    assert sorted(results[1:]) == [1, 2]


def test_describe_exit() -> None:
    assert _describe_exit(7) == "its process exited with code 7"
    assert "SIGKILL" in _describe_exit(-int(signal.SIGKILL))


def test_free_port() -> None:
    assert 0 < free_port() < 65536


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"world_size": 0}, ValueError, "world_size"),
        ({"world_size": -1}, ValueError, "world_size"),
        ({"world_size": 2.0}, TypeError, "world_size"),
        ({"world_size": True}, TypeError, "world_size"),
        ({"fn": 3}, TypeError, "fn"),
        ({"fn": lambda rank, ws: rank}, TypeError, "fn"),
        ({"args": [1]}, TypeError, "args"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": -1.0}, ValueError, "timeout"),
        ({"timeout": float("inf")}, ValueError, "timeout"),
        ({"timeout": "10"}, TypeError, "timeout"),
        ({"init_timeout": 0}, ValueError, "init_timeout"),
        ({"grace": -1}, ValueError, "grace"),
        ({"env": {"A": 1}}, TypeError, "env"),
        ({"env": ["A"]}, TypeError, "env"),
        ({"allow_exit": {2}}, ValueError, "allow_exit"),
        ({"allow_exit": 1}, TypeError, "allow_exit"),
        ({"backend": ""}, TypeError, "backend"),
        ({"start_method": "fork"}, ValueError, "start_method"),
        ({"start_method": None}, TypeError, "start_method"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], exc: type[Exception], name: str) -> None:
    call: dict[str, object] = {"fn": sleep_forever, "world_size": 2, **kwargs}
    with pytest.raises(exc, match=name):
        run_world(**call)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []


def environment_and_pid(rank: int, world_size: int, name: str) -> tuple[str | None, int]:
    """A rank's view of one environment variable, and its process id (run on the ranks)."""
    dist.barrier()  # no rank leaves while a peer still connects (spawned ranks start apart)
    return os.environ.get(name), os.getpid()


def test_the_callers_current_environment_reaches_forked_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_world(environment_and_pid, 2, args=("SCOPEDMESH_PROBE",))  # the server is up
    monkeypatch.setenv("SCOPEDMESH_PROBE", "set after the fork server started")
    first = run_world(environment_and_pid, 2, args=("SCOPEDMESH_PROBE",))
    assert [value for value, _ in first] == ["set after the fork server started"] * 2
    monkeypatch.delenv("SCOPEDMESH_PROBE")
    second = run_world(environment_and_pid, 2, args=("SCOPEDMESH_PROBE",))
    assert [value for value, _ in second] == [None, None]
    assert {pid for _, pid in first}.isdisjoint(pid for _, pid in second)  # fresh ranks


def test_spawn_still_starts_ranks_as_new_interpreters() -> None:
    results = run_world(environment_and_pid, 2, args=("PATH",), start_method="spawn")
    assert [value for value, _ in results] == [os.environ.get("PATH")] * 2
    assert len({pid for _, pid in results}) == 2


def test_the_fork_server_imports_start_no_thread() -> None:
    code = (
        "import importlib, os\n"
        "from scopedmesh.testing.launcher import WARM_MODULES\n"
        "for name in WARM_MODULES:\n"
        "    importlib.import_module(name)\n"
        "print(len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "1", out.stderr
