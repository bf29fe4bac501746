"""Who a peer's process is, as the diagnosis sees it: its record, or its launch environment.

No world: a ``HashStore`` stands for torch's store, and a child process launched as
torchrun launches a rank stands for a peer that has made no mesh yet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from scopedmesh.c10d import processes
from scopedmesh.c10d.diagnosis import Request, Watch, _LaunchedHere
from scopedmesh.c10d.store import process_key


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's launch variables, naming a job no other process on this host is in."""
    variables = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
        "WORLD_SIZE": "3",
        "TORCHELASTIC_RUN_ID": f"test-{uuid.uuid4().hex}",
    }
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    return variables


@pytest.fixture
def rank_1(job: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A process launched as rank 1 of ``job`` that has made no mesh (it sleeps), returned
    once it runs: until its ``exec`` is done, ``/proc`` shows it with this process's
    environment, without ``RANK`` (under load, CI once found no rank there)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "print('running', flush=True); import time; time.sleep(60)"],
        env={**job, "RANK": "1"},
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    child.stdout.readline()  # printed by the launched program: its exec is done
    yield child
    child.kill()
    child.wait()


def test_a_rank_launched_on_this_host_is_found_by_its_launch_environment(
    job: dict[str, str], rank_1: subprocess.Popen[bytes]
) -> None:
    assert processes.launched_here() == {1: rank_1.pid}  # and no other rank of this job
    other = {**job, "TORCHELASTIC_RUN_ID": "another-job"}
    assert processes.launched_here(other) == {}  # rank 1 of another job is not it
    assert processes.job_of({"RANK": "1"}) is None  # no MASTER_PORT: no job to match
    rank_1.kill()
    rank_1.wait()
    assert processes.launched_here() == {}  # gone: not running here any more


def test_a_ranks_own_children_are_not_taken_for_it(job: dict[str, str]) -> None:
    """A DataLoader's workers inherit their rank's launch environment: the rank is the one
    of them that none of the others started."""
    code = (
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", code], env={**job, "RANK": "1"}, stdout=subprocess.PIPE, text=True
    )
    worker = 0
    try:
        assert rank.stdout is not None
        worker = int(rank.stdout.readline())  # once the worker runs
        assert processes.launched_here() == {1: rank.pid}, worker
    finally:
        if worker:
            os.kill(worker, signal.SIGKILL)
        rank.kill()
        rank.wait()


def _doing(store: dist.Store, rank: int) -> tuple[str, bool]:
    """What rank 0's timeout message says of ``rank`` (a member of [0, 1, 2] that did not arrive)."""
    request = Request(
        rank=0, name="g", generation=0, ranks="[0, 1, 2]", backend="gloo",
        what="axis 'x'", description="scopedmesh:x",
    )  # fmt: skip
    watch = Watch(store, request, [0, 1, 2], timedelta(seconds=1), timedelta(seconds=1))
    return watch._doing(rank, _LaunchedHere())


def test_a_peer_without_a_record_is_never_said_to_be_on_another_host(
    job: dict[str, str], rank_1: subprocess.Popen[bytes]
) -> None:
    """Issue 37, item 2, without a world: no record and launched here reads as running here
    (known); no record and not found as not shown here, never "another host"; a record
    that names another host keeps the other-host wording; one of this host reads as alive."""
    store = dist.HashStore()
    said = {1: _doing(store, 1), 2: _doing(store, 2)}
    elsewhere = {"host": "another-host", "ns": "", "pid": 1, "start": ""}
    store.set(process_key(2), json.dumps(elsewhere))
    said[3] = _doing(store, 2)
    store.set(process_key(2), json.dumps(processes.this_process()))
    said[4] = _doing(store, 2)
    print(said)
    assert said[1] == (
        f"is running on this host (process {rank_1.pid}) but has not asked for this group: "
        "it has made no mesh yet",
        True,
    )
    assert said[2] == (
        "has made no mesh yet (it wrote no process record), and whether it runs cannot be "
        "told from here (no process of this host names rank 2 of this job in the environment "
        "it started with, and no liveness watch guards the mesh)",
        False,
    )
    assert "another host" in said[3][0] and not said[3][1], said[3]
    assert said[4][0].startswith("is alive and outside any group request") and said[4][1]
