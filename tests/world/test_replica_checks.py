"""Replicas that cannot take part, told so at once and by name (issue 43, finding 6).

Each job here is a :class:`~scopedmesh.testing.replicas.ReplicaJob` of 2 replicas of
one gloo rank: a replica started with another ``replicas=`` than the job's is
refused before it writes anything, and the replica that waits for it names it;
a replica whose registered tensor has another shape than the source's is told
which tensor and both shapes, and is not restarted; replicas that restart after
every replica of the job died are told that no live replica is left.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import _workers_grow as grow_workers
import _workers_replica_checks as workers
import pytest
import torch
import torch.distributed as dist

from scopedmesh import job_view
from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.errors import JobMismatchError
from scopedmesh.fault.protocol.membership import JobShape
from scopedmesh.fault.records import check_shape
from scopedmesh.testing.replicas import ReplicaJob

KEYS = ReplicaKeys()
BOUND = 60.0  # seconds: a "never hang" bound for one job, not a performance figure


def _until(job: ReplicaJob, what: str, condition: Callable[[], bool], bound: float) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        job.poll()
        if time.monotonic() > deadline:
            raise AssertionError(
                f"waited {bound:g} s for {what}; restarts {job.restarts}; "
                f"failures: {job.failures[-2:]}"
            )
        time.sleep(0.01)


def test_a_replica_started_with_other_replicas_is_refused_and_the_other_names_it() -> None:
    job = ReplicaJob(
        workers.join_with, replicas=2, local=1, args=({0: 2, 1: 3}, 3.0), max_restarts=0
    )
    job.start()
    try:
        _until(job, "replica 1's refusal", lambda: 1 in job.final, BOUND)
        _until(job, "replica 0's report", lambda: (0, 0) in job.results, BOUND)
        store = job.store
        # Refused before any side effect: no announcement, no join counted (the listener and
        # the collectives: test_replicas_of_another_shape_opens_nothing_and_joins_no_collective).
        assert read(store, KEYS.join(1, 0)) is None
        assert read(store, KEYS.joins) == "1"
        assert JobShape.parse(read(store, KEYS.shape) or "") == JobShape(2, 1, replica=0)
    finally:
        job.stop()
    (report,) = job.final[1]
    assert (
        "JobMismatchError: replica 1: replicas=3 differs from the job's replicas=2, set by replica 0"
        in report
    )
    assert "a restart with these arguments will not help" in report
    assert job.restarts == []
    # The replica that waited names the one that never announced itself.
    waited = job.results[(0, 0)]["timeout"]
    assert "replicas [1] to announce themselves" in waited, waited
    assert "announced: [0]" in waited, waited


def test_a_replica_of_another_local_is_refused_without_writing() -> None:
    """``local`` is the replica's group size; in one process, on a real store."""
    store = dist.HashStore()  # type: ignore[attr-defined]  # public; not in torch's stub exports
    assert check_shape(store, KEYS, JobShape(3, 2, replica=1)) == JobShape(3, 2, replica=1)
    keys = store.num_keys()
    with pytest.raises(
        JobMismatchError,
        match=r"^replica 0: local=4 \(this replica's ranks\) differs from the job's local=2, "
        r"set by replica 1\.",
    ):
        check_shape(store, KEYS, JobShape(3, 4, replica=0))
    with pytest.raises(ValueError, match=r"replicas=2 differs .*; local=1 .* local=2"):
        check_shape(store, KEYS, JobShape(2, 1, replica=2))
    assert store.num_keys() == keys
    assert check_shape(store, KEYS, JobShape(3, 2, replica=2)) == JobShape(3, 2, replica=1)


def test_replicas_of_another_shape_opens_nothing_and_joins_no_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal comes before the slot's listener, the token's broadcast and any key."""
    from scopedmesh.fault import replicas as module

    opened: list[object] = []  # side effects: a listener, a collective
    monkeypatch.setattr(socket, "create_server", lambda *a, **k: opened.append(("listener", a)))
    monkeypatch.setattr(module.dist, "broadcast", lambda *a, **k: opened.append(("bcast", a)))
    monkeypatch.setattr(module.dist, "all_reduce", lambda *a, **k: opened.append(("reduce", a)))
    monkeypatch.setattr(module.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(module.dist, "get_backend", lambda group=None: "gloo")
    store = dist.HashStore()  # type: ignore[attr-defined]
    store.set(KEYS.shape, JobShape(3, 2, replica=0).text())
    model = torch.nn.Linear(1, 1)
    with pytest.raises(
        JobMismatchError, match=r"^replica 1: replicas=4 differs from the job's replicas=3, set by"
    ):
        module.Replicas(store, replica=1, replicas=4, state={"model": model})
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 3)
    with pytest.raises(
        ValueError, match=r"local=3 \(this replica's ranks\) differs from the job's local=2"
    ):
        module.Replicas(store, replica=1, replicas=3, state={"model": model})
    assert opened == [] and store.num_keys() == 1


def test_a_tensor_of_another_shape_is_named_and_its_replica_is_not_restarted() -> None:
    job = ReplicaJob(
        workers.mismatched, replicas=2, local=1, args=({0: 1024, 1: 512}, 5), max_restarts=2
    )
    job.start()
    try:
        _until(job, "replica 1's refusal and replica 0's end", lambda: 1 in job.final, BOUND)
        _until(job, "replica 0's end", lambda: (0, 0) in job.results, BOUND)
        time.sleep(0.5)
        job.poll()  # a restart would show now
    finally:
        job.stop()
    (report,) = job.final[1]
    assert "JobMismatchError" in report, report
    assert "the source's tensor state['buf']['buf'] has shape (1024,), this replica's (512,)" in (
        report
    )
    assert "a restart will not help" in report and "restart it to rejoin" not in report
    assert job.restarts == []
    assert job.results[(0, 0)] == {"steps": 5, "replicas": (0,)}  # the source went on alone


def test_replicas_restarted_after_every_replica_died_are_told_no_live_replica_is_left() -> None:
    job = ReplicaJob(
        grow_workers.train, replicas=2, local=1, args=(2, -1, 0.02), max_restarts=2,
        restart_delay=0.5,
    )  # fmt: skip
    job.start()
    try:
        _until(job, "the first epoch", lambda: job_view(job.store) is not None, BOUND)
        assert job.kill(0, 0) is not None and job.kill(1, 0) is not None
        killed = time.monotonic()
        _until(job, "both restarts to stop", lambda: set(job.final) == {0, 1}, BOUND)
        told = time.monotonic() - killed
    finally:
        job.stop()
    assert sorted(r for r, _ in job.restarts) == [0, 1]
    for replica in (0, 1):
        (report,) = job.final[replica]
        assert "NoLiveReplicaError" in report, report
        assert f"replica {replica}: no live replica: every replica of the job's newest epoch" in (
            report
        )
        assert "restart the job from a checkpoint" in report
    assert told < 30, told  # at once, not after the joiners' 60 s timeout
    print(f"\nRELIABILITY no live replica: told {told:.1f} s after both kills")
