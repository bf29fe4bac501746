"""Workers of test_grow.py's FSDP2 case: each replica shards its model with FSDP2 over a
scoped DeviceMesh of its own WORLD, and replicas grow back around it.

Every rank of every replica builds the same model (one seed); ``fully_shard``
splits it along the replica's ranks. A step: each rank's loss on its data
(replica, coordinate, step); FSDP2 averages the gradients over the replica's
ranks (its reduce-scatter); :class:`Replicas` averages each rank's local shard
of them over the step's contributors, along the epoch's dp group. The
registered state is FSDP2's own ``state_dict`` (DTensors) and the optimizer's.
"""

from __future__ import annotations

import hashlib
import io
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _workers_grow import LR, STEP, STOP, Progress, accumulate, loss_of
from torch.distributed.fsdp import fully_shard

from scopedmesh.c10d.store import read
from scopedmesh.fault.replicas import Replicas
from scopedmesh.fault.state_transfer import local
from scopedmesh.mesh import ProcessGroupMesh


def model_of() -> torch.nn.Module:
    torch.manual_seed(2024)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _digest(state: Any) -> str:
    buffer = io.BytesIO()
    torch.save(local(state), buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def train_fsdp(
    replica: int, coordinate: int, job_port: int, replicas: int, pace: float
) -> dict[str, Any]:
    """One rank: train under FSDP2 until the test's stop step, once the job is whole."""
    store = dist.TCPStore("127.0.0.1", job_port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    local = dist.get_world_size()
    progress = Progress()
    with ProcessGroupMesh(local, names=("fsdp",), timeout=60) as inside:
        model = model_of()
        fully_shard(model, mesh=inside.to_device_mesh("cpu"))
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        state = {"model": model, "optim": optim, "progress": progress}
        with Replicas(store, replica=replica, replicas=replicas, state=state, timeout=60) as grow:
            while True:
                decision = grow.boundary()
                stop = read(store, STOP)
                last = progress.history[-1][1] if progress.history else ()
                if stop is not None and progress.step >= int(stop) and len(last) == replicas:
                    break
                optim.zero_grad()
                loss = loss_of(model, replica, coordinate, progress.step)
                loss.backward()  # FSDP2: the replica's mean, this rank's shard
                shown = loss.detach().reshape(1).clone()
                shards = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
                if grow.all_reduce_([*shards, shown]):
                    optim.step()
                    progress.history.append((progress.step, grow.contributors, float(shown[0])))
                    progress.step += 1
                    if decision.source == replica and coordinate == 0:
                        store.set(STEP, str(progress.step))
                time.sleep(pace)
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            return {
                "digest": _digest({"model": model.state_dict(), "optim": optim.state_dict()}),
                "history": progress.history,
                "replicas": grow.decision.replicas if grow.decision else (),
                "transfers": [(t.epoch, t.role, t.nbytes, t.seconds) for t in grow.transfers],
                "full": full,
            }


def reference(
    history: list[tuple[int, tuple[int, ...], float]], local: int
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Replay ``history`` in one process, unsharded: per step each coordinate's loss
    averaged over the contributors, and the final weights."""
    model = model_of()
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step, members, _ in history:
        optim.zero_grad()
        grads = [torch.zeros_like(p) for p in model.parameters()]
        per_coordinate = []
        for coordinate in range(local):
            total = torch.zeros(())
            for r in members:
                total = total + accumulate(model, grads, r, coordinate, step)
            per_coordinate.append(float(total / len(members)))
        for g, p in zip(grads, model.parameters()):
            p.grad = g / (len(members) * local)
        optim.step()
        losses.append(per_coordinate)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
