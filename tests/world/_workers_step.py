"""Workers for tests/world/test_step.py: a step's verdict on guarded meshes, on gloo and the double."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the double beside this module

from _nccl_double import BACKEND, Log, register, wait_for
from _workers_common import in_doubt

from scopedmesh import LostRankError, ProcessGroupMesh
from scopedmesh.c10d import groups as _c10d
from scopedmesh.fault.liveness import LivenessWatch

STEPS = 6


def _train(mesh: ProcessGroupMesh, w: torch.Tensor, step: int) -> torch.Tensor:
    """The step's update: each dp replica's gradient (its row of a fixed batch), tp-summed
    then dp-averaged; what the loop applies only if the step commits."""
    grad = torch.full_like(w, float(step + 1 + mesh.coordinate("dp")))
    dist.all_reduce(grad, group=mesh.get_group_along_axis("tp"))
    dist.all_reduce(grad, group=mesh.get_group_along_axis("dp"))
    return grad / mesh.size("dp")


def a_step_raises(
    rank: int, world: int, raiser: int, at: int, kind: str = "ValueError"
) -> dict[str, Any]:
    """A 2 x 2 (dp, tp) loop with ``watch.step``; rank ``raiser``'s step ``at`` raises
    ``kind`` after its tp all_reduce, so its dp peer waits for it in the dp one, in every
    attempt of that step until the error reaches the loop. Returns each step's verdict, the
    weights, and what the raising rank caught."""
    error_type = {"ValueError": ValueError, "RuntimeError": RuntimeError}[kind]
    out: dict[str, Any] = {"verdicts": [], "raised": None}
    w = torch.zeros(2, dtype=torch.float64)
    with LivenessWatch(interval=0.02, timeout=60) as watch:
        mesh = watch.guard(ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=60))
        step, started = 0, time.monotonic()
        while step < STEPS:
            try:
                with watch.step(mesh, "dp") as s:
                    grad = torch.full_like(w, float(step + 1))
                    dist.all_reduce(grad, group=s.mesh.get_group_along_axis("tp"))
                    if rank == raiser and step == at and not out["raised"]:
                        raise error_type("a bug in this rank's step")
                    dist.all_reduce(grad, group=s.mesh.get_group_along_axis("dp"))
            except error_type as error:
                out["raised"] = [step, str(error), s.committed, s.healed]
            mesh = s.mesh
            out["verdicts"].append([step, s.committed, s.healed, list(s.mesh.shape)])
            if s.committed:
                w += grad
                step += 1
        out["seconds"] = time.monotonic() - started
        out["committed"] = watch.committed
        mesh.close()
    out["w"] = w.tolist()
    return out


def killed_in_a_step(rank: int, world: int, looks_done: bool) -> dict[str, Any] | None:
    """A guarded 2 x 2 mesh on the NCCL double whose collectives, once aborted, look done
    (``wait()`` returns, ``is_success()`` is True, the buffer as the cut left it), as an
    NCCL kernel an abort ends early does. Rank 3 is SIGKILLed from rank 0's thread while
    every rank waits on a kept handle inside its step. Returns how the handle ended and
    the step's verdict."""
    register()
    store = _c10d.default_store()
    store.set(f"step/{rank}/pid", str(os.getpid()))
    log = Log()
    log.looks_done = looks_done
    with LivenessWatch(interval=0.02, timeout=60) as watch:
        mesh = ProcessGroupMesh(2, 2, names=("dp", "tp"), backend=BACKEND, pg_options=log)
        watch.guard(mesh)
        out: dict[str, Any] = {"sat_out": False}
        step = watch.step(mesh, "dp")
        try:
            with step:
                buffer = torch.ones(1)
                tp = mesh.get_group_along_axis("tp")
                work = dist.all_reduce(buffer, group=tp, async_op=True)
                store.add("step/ready", 1)
                if rank == 0:
                    threading.Thread(target=_kill, args=(store,), daemon=True).start()
                if rank == 3:
                    wait_for(lambda: False, 60, "the SIGKILL")  # killed while it waits
                out["waited"] = bool(work.wait())  # the double: True once aborted, as NCCL's
                out["success"] = bool(work.is_success())
                out["buffer"] = buffer.tolist()
        except LostRankError:  # rank 2 shared the dropped dp slice with rank 3
            out["sat_out"] = True
        out["committed"], out["healed"] = step.committed, step.healed
        out["lost"], out["shape"] = sorted(step.lost), list(step.mesh.shape)
        step.mesh.close()
    return out


def _kill(store: Any) -> None:
    wait_for(lambda: int(store.add("step/ready", 0)) >= 4, 60, "every rank in its step")
    os.kill(int(store.get("step/3/pid")), signal.SIGKILL)


def every_step_commits(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """``rounds`` scoped blocks in a row, each a guarded mesh with three steps: all commit."""
    verdicts = []
    with LivenessWatch(interval=0.02, timeout=60) as watch:
        for _ in range(rounds):
            with watch.guard(ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=60)) as mesh:
                w = torch.zeros(1, dtype=torch.float64)
                for i in range(3):
                    with watch.step(mesh, "dp") as s:
                        grad = _train(mesh, w, i)
                    verdicts.append(s.committed)
                    w += grad
        lines = sorted(watch._ledger.committed)  # one line: each block's mesh went on it
        return {"verdicts": verdicts, "committed": watch.committed, "lines": lines}


def doubt_on_one_rank(rank: int, world: int, at: int, heal_by_hand: bool = False) -> dict[str, Any]:
    """Rank 1's vote on step ``at`` completes (its flag counted by every peer), then rank 1's
    mesh is aborted before it reads the answer, as when a death's abort lands just after
    the vote: the peers commit, rank 1 is in doubt. It must learn from the survivors'
    agreement (or, after the last step, from the count each peer left as it closed its
    watch) that the step committed, and commit it too.

    With ``heal_by_hand``, after every step the loop runs a collective of its own on the
    mesh (an eval, a log) and heals with ``watch.heal`` where it fails: rank 1 heals the
    mesh its peers heal, with the same lost set (the agreement already held), without
    waiting for an agreement nobody joins."""
    out: dict[str, Any] = {"verdicts": [], "healed": []}
    w = torch.zeros(1, dtype=torch.float64)
    with LivenessWatch(interval=0.02, timeout=30) as watch:
        mesh = watch.guard(ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=60))
        step = 0
        while step < STEPS:
            verdict = watch.step(mesh, "dp")
            if rank == 1 and step == at and "vote" not in out:
                in_doubt(verdict, mesh, out)
            with verdict:
                grad = _train(mesh, w, step)
            mesh = verdict.mesh
            out["verdicts"].append([step, verdict.committed, verdict.healed])
            if verdict.committed:
                w += grad
                step += 1
            if not heal_by_hand:
                continue
            try:  # the loop's own collective between steps
                dist.all_reduce(torch.ones(1), group=mesh.get_group_along_axis("dp"))
            except RuntimeError:
                began = time.monotonic()
                mesh = watch.heal(mesh, "dp")
                out["healed"].append([step, list(mesh.shape), time.monotonic() - began])
        out["committed"] = watch.committed
        mesh.close()
    out["w"] = w.tolist()
    return out
