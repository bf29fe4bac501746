"""Replicas on NCCL (issue 39): a killed replica rejoins over NCCL dp groups, CUDA tensors.

2 replicas of one rank each (on one GPU: two processes, a host id each), the job's
store in this process (tests/world/_workers_grow.py: ``kill_and_rejoin``). Replica 1
is SIGKILLed at a random moment and restarted at once. The survivor's dp
collectives wait on a communicator whose peer will never come: its waits find the
peer dead, abort, and it heals; each epoch's group forms by its own init over the
epoch's store; the restarted replica is admitted and receives the survivor's CUDA
tensors straight over NCCL. Counts and equality are asserted, never a time.
Skipped without a GPU (tests/gpu/conftest.py). The CPU proof of the same rank code
is tests/world/test_grow_nccl.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gpu_workers as workers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "world"))

import _workers_grow as grow

from scopedmesh.c10d.store import ReplicaKeys, read


def test_a_killed_replica_rejoins_over_nccl_and_every_replica_ends_equal() -> None:
    results, final, restarts, store = grow.kill_and_rejoin(workers.replicas_rank, 2, 240.0)
    assert restarts == [1]
    survivor, joiner = results[(0, 0)], results[(1, 0)]
    history = survivor["history"]
    assert joiner["digest"] == survivor["digest"], "the replicas' states differ"
    assert joiner["history"] == history
    assert [s for s, _, _ in history] == list(range(len(history)))  # no step twice, none lost
    # A one-process replay on the CPU: the same schedule, CUDA's arithmetic within tolerance.
    losses, state = grow.reference(history, 0)
    recorded = torch.tensor([v for _, _, v in history])
    torch.testing.assert_close(torch.tensor(losses), recorded, rtol=1e-3, atol=1e-4)
    for name, tensor in state.items():
        torch.testing.assert_close(survivor["state"][name], tensor, rtol=1e-3, atol=1e-4)
    # The joiner received the state once (a catch-up, or the heal's broadcast).
    received = [t for t in joiner["transfers"] if t[1] == "received"]
    assert received and all(nbytes > 0 for _, _, nbytes, _ in received), joiner["transfers"]
    assert survivor["step"] == joiner["step"] == len(history)
    assert final is not None and final.finished and final.step == len(history)
    # Each epoch's clean-up deleted the ids torch's ProcessGroupNCCL put in the store.
    keys = ReplicaKeys()
    left = [keys.nccl_id(e, 0) for e in range(final.epoch + 1)]
    assert [k for k in left if read(store, k) is not None] == []
    print("transfers (epoch, role, bytes, s):", survivor["transfers"], joiner["transfers"])
