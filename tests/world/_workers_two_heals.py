"""Workers for tests/world/test_two_heals.py: two meshes under one watch, one death, both healed.

As users run us: one :class:`LivenessWatch` guards two meshes over the same 4
ranks (a 2 x 2 ``dp`` x ``tp`` mesh for one model, a 4-rank ``dp`` mesh for
another), each trained in its own ``watch.step`` loop, one step of each per
iteration. The launcher (this process) SIGKILLs a rank at a random moment once it
has done a few steps. Both meshes must heal, each to its own survivors: killing
rank 3 drops ``dp`` slice 1 of the 2 x 2 mesh (rank 2 sits out of it) while the
4-rank mesh keeps ranks 0, 1, 2. Each model's weights must then equal plain
data parallelism with one replica fewer from the step at which it lost it.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _workers_heal import _child

from benchmarks.heal_common import Ranks
from scopedmesh import LostRankError, ProcessGroupMesh
from scopedmesh.fault.liveness import LivenessWatch

STEPS = 40
TIMEOUT = 20.0  # the meshes' collective timeout and the watch's agreement deadline


def _progress(outdir: str, rank: int, step: int) -> None:
    path = Path(outdir, f"progress{rank}")
    path.with_suffix(".tmp").write_text(str(step))
    os.replace(path.with_suffix(".tmp"), path)


def two_meshes_one_death(rank: int, world: int, outdir: str) -> dict[str, Any]:
    """Train two models, one per mesh, under one watch until each did ``STEPS`` steps.

    Model "a" on the 2 x 2 mesh: each step's gradient is ``step + 1 + dp`` summed
    over ``tp`` then ``dp`` (the 2 tp members of a replica add the same value).
    Model "b" on the 4-rank mesh: ``step + 1 + rank`` summed over ``dp``. Per
    model: the steps committed, each with the replicas it was summed over.
    """
    out: dict[str, Any] = {"a": [], "b": [], "sat_out": [], "events": []}
    with LivenessWatch(interval=0.02, timeout=TIMEOUT) as watch:
        meshes: dict[str, ProcessGroupMesh | None] = {
            "a": watch.guard(ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=TIMEOUT)),
            "b": watch.guard(ProcessGroupMesh(4, names=("dp",), timeout=TIMEOUT)),
        }
        steps = {"a": 0, "b": 0}
        weights = {"a": 0.0, "b": 0.0}
        while any(m is not None and steps[n] < STEPS for n, m in meshes.items()):
            _progress(outdir, rank, min(steps.values()))
            for name, mesh in meshes.items():
                if mesh is None or steps[name] >= STEPS:
                    continue
                verdict = watch.step(mesh, "dp")
                try:
                    with verdict:
                        me = mesh.coordinate("dp") if name == "a" else rank
                        grad = torch.full((1,), float(steps[name] + 1 + me), dtype=torch.float64)
                        if name == "a":
                            dist.all_reduce(grad, group=mesh.get_group_along_axis("tp"))
                            grad /= mesh.size("tp")
                        dist.all_reduce(grad, group=mesh.get_group_along_axis("dp"))
                except LostRankError:
                    out["sat_out"].append(name)
                    meshes[name] = None
                    continue
                meshes[name] = verdict.mesh
                if verdict.committed:
                    out[name].append([steps[name], grad.item(), sorted(verdict.mesh.layout.ranks)])
                    weights[name] += grad.item()
                    steps[name] += 1
                else:
                    out["events"].append([name, steps[name], sorted(verdict.mesh.layout.ranks)])
            time.sleep(0.01)  # a step's compute: the kill lands mid-training
        for mesh in meshes.values():
            if mesh is not None:
                mesh.close()
        out["weights"] = weights
        out["watch_committed"] = watch.committed
    return out


def launch_and_kill(outdir: str, victim: int, seed: int, timeout: float = 240) -> dict[str, Any]:
    """Host the store here and run :func:`two_meshes_one_death` on 4 forked ranks; SIGKILL
    ``victim`` from here at a random moment (``seed``: up to 0.25 s) once it has done 2
    steps of each model. The reports by rank, the exit codes, and the victim's step when
    killed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = 4
    args = [(two_meshes_one_death, r, world, store.port, (), outdir) for r in range(world)]
    delay = random.Random(seed).uniform(0.0, 0.25)
    progress = Path(outdir, f"progress{victim}")
    killed_at = -1
    with Ranks(_child, args, timeout) as ranks:
        while ranks.all_alive() and ranks.left() > 0:
            if progress.exists() and int(progress.read_text() or "0") >= 2:
                time.sleep(delay)
                killed_at = int(progress.read_text() or "0")
                ranks.kill(victim)
                break
            time.sleep(0.002)
        ranks.join()
    reports = {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(outdir).glob("rank*.json")}
    return {"reports": reports, "exitcodes": ranks.exitcodes, "killed_at": killed_at}
