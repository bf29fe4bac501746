"""The liveness watch's thread and shared state: a crashed thread, and the two threads'
races on what the watch knows. Hooks stand in for a thread switch at the one moment a
race needs it; deaths are SIGKILLs from another process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from scopedmesh.c10d.store import WatchKeys
from scopedmesh.fault.liveness.deaths import CLOSED, DeathRecord


@pytest.fixture
def one_rank() -> Iterator[Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def _other_thread(target: Any, *args: Any) -> threading.Thread:
    """Run ``target`` on another thread, waiting up to half a second for it to finish (it
    may be waiting for the caller, who holds a lock: then it finishes later)."""
    thread = threading.Thread(target=target, args=args)
    thread.start()
    thread.join(0.5)
    return thread


class _SwitchAtSecondRead(DeathRecord):
    """A death record whose ``lost`` hands over to another thread (learning rank 7) right
    after this thread's second read of it: between reading the set and storing its union."""

    def __init__(self) -> None:
        self.reads, self.other, self.main = 0, None, threading.current_thread()
        super().__init__(WatchKeys("w"), 0, lambda new: None)

    @property  # type: ignore[override]
    def lost(self) -> frozenset[int]:
        value: frozenset[int] = self.__dict__["lost"]
        if threading.current_thread() is self.main and self.other is None:
            self.reads += 1
            if self.reads == 2:
                self.other = _other_thread(self.learn, {7: CLOSED})
        return value

    @lost.setter
    def lost(self, value: frozenset[int]) -> None:
        self.__dict__["lost"] = value


def test_two_threads_learning_deaths_at_once_lose_neither() -> None:
    """The watch's thread and a caller's thread both learn deaths; one's update was lost
    when the other stored its union in between."""
    record = _SwitchAtSecondRead()
    record.learn({3: CLOSED})
    assert record.other is not None
    record.other.join(5.0)
    assert record.lost == {3, 7}
    assert set(record.learned) == set(record.why) == {3, 7}


def test_a_failure_reported_while_the_last_one_is_raised_is_kept(one_rank: Any) -> None:
    """The thread reports a failure while a caller reads the previous one: the caller must
    not clear the new one with the old (it surfaces in the next query)."""
    from scopedmesh.fault.liveness.watch import LivenessWatch

    class SwitchOnRead(LivenessWatch):
        hook: Any = None

        @property  # type: ignore[override]
        def _failure(self) -> Any:
            value = self.__dict__.get("_failure")
            hook, SwitchOnRead.hook = SwitchOnRead.hook, None
            if hook is not None:
                self.__dict__["other"] = _other_thread(hook)
            return value

        @_failure.setter
        def _failure(self, value: Any) -> None:
            self.__dict__["_failure"] = value

    with SwitchOnRead(interval=0.05, timeout=timedelta(seconds=5)) as watch:
        watch._report("failed while watching (it goes on)", RuntimeError("first"))
        SwitchOnRead.hook = lambda: watch._report("failed while watching", RuntimeError("second"))
        with pytest.raises(RuntimeError, match="first"):
            watch.lost()
        watch.__dict__["other"].join(5.0)
        with pytest.raises(RuntimeError, match="second"):
            watch.lost()
        assert watch.lost() == frozenset()  # each reported once


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_crashed_watch_thread_is_no_goodbye_its_later_death_is_declared() -> None:
    """Rank 1's watch thread crashes: its peers still see it alive, and once rank 0 kills
    it, both declare it lost. The thread used to say goodbye as it ended, so the peers
    recorded rank 1 as gone and never declared its death."""
    import _workers_liveness

    from scopedmesh.testing import run_world

    results = run_world(_workers_liveness.crashed_thread_then_killed, 3, allow_exit=[1])
    for out in (results[0], results[2]):
        assert out["lost_while_alive"] == [], out  # a crash is not a death
        assert out["lost"] == [1], out
        assert out["why"] is not None and "has died" in out["why"], out


def test_a_mesh_aborted_through_its_public_method_refuses_its_groups(one_rank: Any) -> None:
    """What the guard calls: ``abort`` is a state of the mesh's tree; ``settle`` and
    ``set_liveness`` are local and idempotent."""
    from scopedmesh import LivenessWatch, MeshClosedError, ProcessGroupMesh

    with pytest.raises(TypeError, match="because must be a non-empty str, got 3"):
        ProcessGroupMesh(1, names=("dp",)).abort(3)  # type: ignore[arg-type]
    with LivenessWatch(interval=0.05, timeout=timedelta(seconds=5)) as watch:
        with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
            assert mesh.liveness is None
            watch.guard(mesh)
            assert mesh.liveness is watch
            mesh.get_group_along_axis("dp")
            mesh.abort("in a test")
            mesh.settle()
            with pytest.raises(MeshClosedError, match="shut down in a test"):
                mesh.get_group_along_axis("tp")
            with pytest.raises(MeshClosedError, match="shut down in a test"):
                mesh.submesh("dp").get_group_along_axis("dp")
        assert mesh.liveness is watch  # a closed mesh keeps it until the watch lets go
    assert mesh.liveness is None
