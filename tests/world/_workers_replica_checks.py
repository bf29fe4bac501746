"""Workers of test_replica_checks.py: replicas that do not match their job (another
``replicas=``, a registered tensor of another shape), and a job left with no live
replica."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.fault.replicas import Replicas

SHAPE = ReplicaKeys().shape


def _store(job_port: int) -> Any:
    return dist.TCPStore("127.0.0.1", job_port, is_master=False, timeout=timedelta(seconds=30))  # type: ignore[attr-defined]


def join_with(
    replica: int, coordinate: int, job_port: int, started: dict[int, int], timeout: float
) -> dict[str, Any]:
    """Start replica ``replica`` with ``replicas=started[replica]`` once the job's shape is
    set (replica 0 first); report what its first ``boundary()`` raised."""
    store = _store(job_port)
    deadline = time.monotonic() + 30
    while replica != 0 and read(store, SHAPE) is None:  # the job's first slot sets it
        if time.monotonic() > deadline:
            raise TimeoutError("the job's shape was never set")
        time.sleep(0.01)
    model = torch.nn.Linear(2, 2)
    try:
        with Replicas(
            store, replica=replica, replicas=started[replica], state={"m": model}, timeout=timeout
        ) as grow:
            grow.boundary()
            return {"joined": grow.decision.text() if grow.decision else None}
    except TimeoutError as error:  # the replica that waits: what its error names
        return {"timeout": str(error)}


class Buffer:
    """A registered object that loads into its own tensor (``copy_``), as a loop's extras
    (a running statistic, a data position) may."""

    def __init__(self, size: int) -> None:
        self.buf = torch.zeros(size)

    def state_dict(self) -> dict[str, Any]:
        return {"buf": self.buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buf.copy_(state["buf"])


def mismatched(
    replica: int, coordinate: int, job_port: int, sizes: dict[int, int], steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps with a registered buffer of ``sizes[replica]`` values: the
    replica whose size is not the source's fails to load the source's state."""
    store = _store(job_port)
    model = torch.nn.Linear(2, 1)
    state = {"model": model, "buf": Buffer(sizes[replica])}
    done = 0
    with Replicas(store, replica=replica, replicas=len(sizes), state=state, timeout=30) as grow:
        while done < steps:
            grow.boundary()
            model.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            if grow.all_reduce_([p.grad for p in model.parameters() if p.grad is not None]):
                done += 1
        return {"steps": done, "replicas": grow.decision.replicas if grow.decision else ()}
