"""What each rank runs in tests/world/test_formation.py: deaths while groups form.

A world of forked gloo ranks trains on a guarded mesh (every step all-reduces
along ``tp``, then a 1 MiB bucket along ``dp``) and heals as often as it takes:
a failure (a collective, a formation, an abort) leads to one agreement per
mesh, a re-formed mesh, its groups, and the next step. The test process, which
hosts the store as torchrun's agent does, SIGKILLs ranks from outside at a
random moment (:func:`launch`), and reads back what each rank reports: its
events (when it failed, agreed, formed its groups, made its first step) and
the mesh it ended on.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.heal_common import Ranks
from scopedmesh import LostRankError, ProcessGroupMesh, reform
from scopedmesh.fault.liveness import LivenessWatch

BUCKET = 1024 * 1024 // 8  # float64 elements of the dp all-reduce: a collective in flight


def _where(outdir: str, rank: int, what: str) -> None:
    """Tell the launcher where this rank is: ``<step>`` or ``forming``."""
    path = Path(outdir, f"at{rank}")
    Path(outdir, f"at{rank}.new").write_text(what)
    os.replace(Path(outdir, f"at{rank}.new"), path)


def _step(mesh: ProcessGroupMesh, names: Sequence[str]) -> list[int]:
    """One step: a one summed along each axis (the member counts), and the dp bucket."""
    counts = []
    for axis in names:
        one = torch.ones(1)
        dist.all_reduce(one, group=mesh.get_group_along_axis(axis))
        counts.append(int(one.item()))
    bucket = torch.ones(BUCKET, dtype=torch.float64)
    dist.all_reduce(bucket, group=mesh.get_group_along_axis(names[0]))
    return counts


def _slow_at_barrier(outdir: str, rank: int) -> None:
    """Make this rank slow to arrive at its next formation barrier (descheduled, say):
    connected, then 30 s before its arrival; the launcher kills it there."""
    from scopedmesh.c10d import groups

    arrive = groups._all_formed

    def late(*args: Any, **kwargs: Any) -> None:
        groups._all_formed = arrive  # once
        _where(outdir, rank, "barrier")
        time.sleep(30.0)
        arrive(*args, **kwargs)

    groups._all_formed = late


def trainer(rank: int, world: int, outdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Train on a guarded mesh; heal after every failure; report the events and the end mesh.

    ``plan``: ``shape``, ``names`` (the first one is healed along), ``interval``,
    ``timeout`` (the mesh's), ``after`` (steps to make on the last mesh before
    stopping), ``max_steps``; ``idle`` {rank: s} (user code before the first
    formation), ``slow_barrier`` (a rank slow to arrive at its first barrier).
    """
    names = tuple(plan["names"])
    if plan.get("slow_barrier") == rank:
        _slow_at_barrier(outdir, rank)
    watch = LivenessWatch(interval=plan["interval"], timeout=60)
    mesh = watch.guard(ProcessGroupMesh(*plan["shape"], names=names, timeout=plan["timeout"]))
    events: list[dict[str, Any]] = []
    report: dict[str, Any] = {"rank": rank, "events": events}
    if str(rank) in plan.get("idle", {}):  # its watch runs, its mesh is made; it asks late
        _where(outdir, rank, "idle")
        time.sleep(plan["idle"][str(rank)])
    formed = False
    step = after = 0
    while step < plan["max_steps"] and after < plan["after"]:
        try:
            if not formed:
                _where(outdir, rank, "re-forming" if events else "forming")
                mesh.create_groups(*names)
                formed = True
                if events:
                    events[-1]["formed_at"] = time.time()
            _where(outdir, rank, str(step))
            report["counts"] = _step(mesh, names)
            step += 1
            if events:
                events[-1].setdefault("first_step_at", time.time())
                after += 1
        except RuntimeError as error:
            events.append({"error_at": time.time(), "error": f"{type(error).__name__}: {error}"})
            try:
                lost = watch.agree(mesh, tag=f"event{len(events)}")
                events[-1]["lost"] = sorted(lost)
                mesh = watch.guard(reform(mesh, lost, names[0]))
                formed, after = False, 0
            except LostRankError as sat_out:
                report["sat_out"] = str(sat_out)
                break
    report["ranks"] = list(mesh.layout.ranks)
    report["shape"] = list(mesh.shape)
    report["lost"] = sorted(watch.lost())
    mesh.close()
    watch.close()
    return report


def _child(
    fn: Callable[..., dict[str, Any]], rank: int, world: int, port: int, outdir: str, plan: Any
) -> None:
    report: dict[str, Any]
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        torch.set_num_threads(1)
        report = fn(rank, world, outdir, plan)
    except BaseException:
        report = {"unexpected": traceback.format_exc()}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # a world with dead members cannot tear down together


def _at(outdir: str, rank: int) -> str:
    try:
        return Path(outdir, f"at{rank}").read_text()
    except OSError:
        return ""


Kill = tuple[str, int, float, float]  # (when, victim, least pause, most pause)


def launch(
    plan: dict[str, Any], kills: Sequence[Kill], *, rng: Any, timeout: float = 240.0
) -> dict[str, Any]:
    """Run :func:`trainer` on ``prod(shape)`` ranks; SIGKILL each victim of ``kills`` in turn.

    A kill ``(when, victim, low, high)`` waits for ``when``, then a random pause
    between ``low`` and ``high`` seconds: ``"step"``, every rank has made 2
    steps; ``"forming"``, every rank is forming its first groups (or idles
    before); ``"barrier"``, the victim is slow at its barrier; ``"re-forming"``,
    a rank other than the victim forms groups after a heal; ``"now"``, at
    once. Returns the reports by rank, the kill times (``time.time()``) and
    the exit codes.
    """
    world = 1
    for size in plan["shape"]:
        world *= size
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    times: list[float] = []
    with TemporaryDirectory() as outdir:
        args = [(trainer, r, world, store.port, outdir, plan) for r in range(world)]
        with Ranks(_child, args, timeout) as ranks:
            for when, victim, low, high in kills:
                _wait_for(outdir, world, when, victim, ranks.deadline, ranks.procs)
                time.sleep(rng.uniform(low, high))
                ranks.kill(victim)
                times.append(time.time())
            ranks.join()
        reports = {
            int(f.stem[4:]): json.loads(f.read_text()) for f in Path(outdir).glob("rank*.json")
        }
    return {
        "reports": reports,
        "kills": times,
        "exitcodes": ranks.exitcodes,
    }


def _reached(at: list[str], when: str, victim: int) -> bool:
    if when == "now":
        return True
    if when == "step":
        return all(a.isdigit() and int(a) >= 2 for a in at)
    if when == "forming":
        return all(a in ("forming", "idle") for a in at) and "forming" in at
    if when == "barrier":
        return at[victim] == "barrier"
    if when == "re-forming":
        return any(a == "re-forming" for r, a in enumerate(at) if r != victim)
    raise ValueError(f"when must be one of now, step, forming, barrier, re-forming, got {when!r}")


def _wait_for(
    outdir: str, world: int, when: str, victim: int, deadline: float, procs: list[Any]
) -> None:
    while time.monotonic() < deadline:
        at = [_at(outdir, r) for r in range(world)]
        if _reached(at, when, victim):
            return
        if not procs[victim].is_alive():
            break
        time.sleep(0.001)
    raise RuntimeError(f"the world did not reach {when!r} for rank {victim}: {at}")
