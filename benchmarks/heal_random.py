"""A SIGKILL from outside, at a random moment: from the death to the survivors' next step.

What :mod:`benchmarks.heal` runs. Each kill is a fresh world of forked gloo
ranks (the store hosted by the launcher, as torchrun's agent hosts it) training
one model on a guarded mesh (:class:`~scopedmesh.fault.liveness.LivenessWatch`,
20 ms). Every step ends with a 4 MiB ``all_reduce`` of the gradient along
``dp``, so a collective is in flight most of the time. Once every rank has
done a few steps, the launcher waits a random fraction of a few steps' time
and SIGKILLs a random rank: wherever it is, inside a collective or between two.
Each step runs in ``watch.step(mesh, "dp")``: the survivors' step fails on
every one of them (or, if the death came after every vote, commits on every
one), they agree on the lost set, re-form without the dead rank's ``dp``
slice, apply the step only where it committed, and train on. Their losses and weights must then equal plain data parallelism computed
here, with one replica fewer from that step on.

The model (float64): two linear layers, ``w1`` (8 x 8) and ``w2`` (4 x 8),
each sharded by input columns over ``tp``; with a ``pp`` axis of 2, stage 0
holds ``w1`` and stage 1 ``w2``, else a rank holds its shards of both; plus a
replicated vector ``big`` whose gradient fills the rest of the 4 MiB bucket.
Axes of size 1 have no collective.
"""

from __future__ import annotations

import contextlib
import gc
import math
import mmap
import os
import signal
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.heal_common import (
    BATCH,
    HID,
    IN,
    LR,
    PHASES,
    Ranks,
    batch,
    child,
    initial_weights,
    rank_reports,
)
from benchmarks.heal_common import reference as small_reference
from scopedmesh import LostRankError, ProcessGroupMesh
from scopedmesh.fault.liveness import LivenessWatch
from scopedmesh.mesh.standby import prepare_standby

BUCKET = 4 * 1024 * 1024 // 8  # float64 elements in the 4 MiB gradient bucket
SHAPES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "2x2x2": ((2, 2, 2), ("dp", "pp", "tp")),
    "4x2": ((4, 2), ("dp", "tp")),
    "8x1": ((8, 1), ("dp", "tp")),
    "4x4": ((4, 4), ("dp", "tp")),
    "4x1": ((4, 1), ("dp", "tp")),
}

# Where a rank is, in its slot of the status file the launcher reads before it kills.
WHERE = (
    "start",
    "compute",
    "tp all_reduce",
    "pp all_reduce",
    "dp all_reduce",
    "healing",
    "done",
    "quorum",
    "commit",
)
_SLOT = struct.Struct("<iid")  # step, where, time of the last change


# ============================================================ the status file


class Status:
    """Each rank's step and whereabouts, in a file every rank and the launcher map."""

    def __init__(self, path: Path, world: int, *, create: bool = False) -> None:
        size = _SLOT.size * world
        if create:
            path.write_bytes(bytes(size))
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, size)

    def set(self, rank: int, step: int, where: str) -> None:
        _SLOT.pack_into(self._map, rank * _SLOT.size, step, WHERE.index(where), time.time())

    def get(self, rank: int) -> tuple[int, str, float]:
        step, where, at = _SLOT.unpack_from(self._map, rank * _SLOT.size)
        return step, WHERE[where], at

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


# ============================================================ the model


@dataclass
class Weights:
    """A rank's part of the model: its shards of the layers it holds, and ``big``."""

    shards: dict[int, torch.Tensor]
    big: torch.Tensor

    def copy(self) -> Weights:
        return Weights({k: v.clone() for k, v in self.shards.items()}, self.big.clone())


def big_target(step: int, replica: int, replicas: int) -> float:
    """The scalar that replica ``replica``'s gradient of ``big`` pulls towards at ``step``."""
    return ((31 * step + 7 * replica + replicas) % 17) / 17.0


def big_size(shards: dict[int, torch.Tensor]) -> int:
    return BUCKET - sum(s.numel() for s in shards.values()) - 1


def big_initial(n: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n, dtype=torch.float64)


def stages(sizes: dict[str, int], coords: dict[str, int]) -> tuple[int, ...]:
    """The layers this rank holds: both, or its pipeline stage's one."""
    if sizes.get("pp", 1) == 1:
        return (0, 1)
    return (coords["pp"],)


def initial(sizes: dict[str, int], coords: dict[str, int]) -> Weights:
    """This rank's starting weights: for each layer it holds, its ``tp`` columns."""
    tp, at = sizes.get("tp", 1), coords.get("tp", 0)
    shards = {}
    for layer in stages(sizes, coords):
        w = initial_weights()[layer]
        width = w.shape[1] // tp
        shards[layer] = w[:, at * width : (at + 1) * width].clone()
    return Weights(shards, big_initial(big_size(shards)))


Reduce = Callable[[torch.Tensor, str], None]  # all_reduce (sum) along an axis, in place


def gradients(
    weights: Weights, step: int, sizes: dict[str, int], coords: dict[str, int], reduce: Reduce
) -> tuple[torch.Tensor, float]:
    """This rank's gradient bucket (layer shards, the loss, ``big``) before the dp sum."""
    tp, at = sizes.get("tp", 1), coords.get("tp", 0)
    replicas, replica = sizes["dp"], coords["dp"]
    held = stages(sizes, coords)
    piped = sizes.get("pp", 1) > 1
    x, y = batch(step, replica, replicas)
    grads: dict[int, torch.Tensor] = {}
    hidden = torch.zeros(BATCH, HID, dtype=torch.float64)
    if 0 in held:
        width = IN // tp
        s0 = weights.shards[0].clone().requires_grad_(True)
        part = x[:, at * width : (at + 1) * width] @ s0.T
        hidden = part.detach().clone()
        reduce(hidden, "tp")
    if piped:
        reduce(hidden, "pp")  # stage 0 sends h (stage 1 adds zeros)
    back = torch.zeros(BATCH * HID + 1, dtype=torch.float64)
    if 1 in held:
        width = HID // tp
        s1 = weights.shards[1].clone().requires_grad_(True)
        h = hidden.clone().requires_grad_(True)
        mine = h[:, at * width : (at + 1) * width] @ s1.T
        full = mine.detach().clone()
        reduce(full, "tp")
        out = mine + (full - mine.detach())  # the tp sum, with the gradient of this part
        loss = ((out - y) ** 2).mean()
        loss.backward()
        assert h.grad is not None and s1.grad is not None
        dh = h.grad.clone()
        reduce(dh, "tp")  # each tp rank's slice of dL/dh, disjoint
        back = torch.cat([dh.flatten(), loss.detach().reshape(1)])
        grads[1] = s1.grad
    if piped:
        reduce(back, "pp")  # stage 1 sends dL/dh and the loss back
    if 0 in held:
        part.backward(back[:-1].reshape(BATCH, HID))
        assert s0.grad is not None
        grads[0] = s0.grad
    head = [grads[layer].flatten() for layer in sorted(grads)]
    bucket = torch.cat([*head, back[-1:], weights.big - big_target(step, replica, replicas)])
    return bucket, float(back[-1])


def apply(weights: Weights, bucket: torch.Tensor, replicas: int) -> float:
    """Average the summed bucket over ``replicas``, step the weights; the mean loss."""
    bucket /= replicas
    at = 0
    for layer in sorted(weights.shards):
        shard = weights.shards[layer]
        shard -= LR * bucket[at : at + shard.numel()].reshape(shard.shape)
        at += shard.numel()
    loss = float(bucket[at])
    weights.big -= LR * bucket[at + 1 :]
    return loss


def reference_big(n: int, steps: int, replicas_at: Callable[[int], int]) -> torch.Tensor:
    """``big`` after ``steps`` steps of plain data parallelism on one process."""
    big = big_initial(n)
    for step in range(steps):
        r = replicas_at(step)
        target = sum(big_target(step, i, r) for i in range(r)) / r
        big -= LR * (big - target)
    return big


# ============================================================ one rank


def _tp_pp_dp(mesh: ProcessGroupMesh) -> tuple[dict[str, int], dict[str, int]]:
    names = mesh.layout.names or ()
    return (
        {a: mesh.size(a) for a in names},
        {a: mesh.coordinate(a) for a in names},
    )


def rank_main(rank: int, world: int, outdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Train until ``after`` steps past a heal (or ``max_steps``); report times and results."""
    shape, names = tuple(plan["shape"]), tuple(plan["names"])
    status = Status(Path(outdir, "status"), world)
    report: dict[str, Any] = {"rank": rank, "full_gc": _note_full_collections()}
    watch = LivenessWatch(interval=plan["interval"], timeout=plan["agree_timeout"])
    verdict_marks = _time_the_verdict()
    mesh = watch.guard(ProcessGroupMesh(*shape, names=names, timeout=plan["timeout"]))
    mesh.create_groups(*names)
    if plan.get("standby"):  # the survivors' groups for any dp slice lost, formed now
        prepare_standby(mesh, "dp")
    dist.barrier()  # every watch linked, every group formed
    sizes, coords = _tp_pp_dp(mesh)
    weights = initial(sizes, coords)
    losses: list[list[float]] = []
    events: list[dict[str, Any]] = []
    step, after = 0, 0
    where = ["compute"]

    def reduce(t: torch.Tensor, axis: str) -> None:
        if sizes.get(axis, 1) == 1:
            return
        where[0] = f"{axis} all_reduce"
        status.set(rank, step, where[0])
        dist.all_reduce(t, group=mesh.get_group_along_axis(axis))
        where[0] = "compute"
        status.set(rank, step, "compute")

    while step < plan["max_steps"] and not (events and after >= plan["after"]):
        status.set(rank, step, "compute")
        failure: dict[str, Any] = {}
        try:
            with watch.step(mesh, "dp") as verdict:
                try:
                    bucket, _ = gradients(weights, step, sizes, coords, reduce)
                    reduce(bucket, "dp")
                except RuntimeError as error:  # a peer died, or the watch aborted the mesh
                    failure.update(error_at=time.time(), type=type(error).__name__)
                    failure.update(message=str(error)[:300])
                    raise
                failure.update(error_at=time.time())  # the vote and its doubt come next
        except LostRankError as sat_out:
            lost = sorted(verdict.lost)  # agreed on before the re-formed mesh left it out
            events.append({"step": step, "in": where[0], **failure, "lost": lost})
            events[-1]["sat_out"] = str(sat_out)[:200]
            break
        mesh = verdict.mesh
        if verdict.healed:
            status.set(rank, step, "healing")
            event: dict[str, Any] = {"step": step, "in": where[0], **failure}
            event["agreed_at"], event["lost"] = time.time(), sorted(verdict.lost)
            event.update(verdict_marks)
            mesh.create_groups(*names)
            event["reformed_at"], event["shape"] = time.time(), list(mesh.shape)
            events.append(event)
        if verdict.committed:  # the step counts on every member: apply it
            loss = apply(weights, bucket, sizes["dp"])
            losses.append([step, loss])
            step += 1
        if verdict.healed:
            events[-1]["resume"] = step
            sizes, coords = _tp_pp_dp(mesh)
            after = 0
        elif events and verdict.committed:
            events[-1].setdefault("first_step_at", time.time())
            after += 1
    status.set(rank, step, "done")
    mesh.close()
    report["losses"] = losses
    report["events"] = events
    report["big"] = [float(weights.big[0]), float(weights.big[-1]), float(weights.big.sum())]
    report["big_size"] = weights.big.numel()
    report["lost"] = sorted(watch.lost())
    report["learned"] = {r: watch.learned_at(r) for r in watch.lost()}
    watch.close()
    status.close()
    return report


def _note_full_collections() -> list[list[float]]:
    """The list, filled as they happen, of this rank's full collections (Python's cyclic
    garbage collector, generation 2): ``[time.time() at its start, seconds]`` each.

    A full collection walks every object the rank holds (torch's included): one that
    falls in a heal costs each survivor that runs it tenths of a second on a loaded
    host, and the survivors' allocations move in step, so they tend to run it together.
    """
    full: list[list[float]] = []
    began = [0.0]

    def note(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            began[0] = time.time()
        else:
            full.append([began[0], time.time() - began[0]])

    gc.callbacks.append(note)
    return full


def _time_the_verdict() -> dict[str, float]:
    """Note, in the dict returned, when this rank's last vote ended (``voted_at``), when its
    verdict was decided (``decided_at``: the step's agreement, if any, is over) and when the
    old mesh was closed (``closed_at``). The benchmark's own wrappers around the library's
    ``Step._vote`` and the ``reform`` a step's watch calls, in this forked rank only."""
    from scopedmesh.fault.liveness import step as step_module
    from scopedmesh.fault.liveness import watch as watch_module

    marks: dict[str, float] = {}
    vote, reform = step_module.Step._vote, watch_module.reform

    def timed_vote(self: Any, flag: int) -> int | None:
        try:
            return vote(self, flag)
        finally:
            marks["voted_at"] = time.time()

    def timed_reform(mesh: Any, lost: Any, axis: Any) -> Any:
        marks["decided_at"] = time.time()
        try:
            return reform(mesh, lost, axis)
        finally:
            marks["closed_at"] = time.time()

    from scopedmesh.mesh.group_table import GroupTable

    shut_down = GroupTable._shut_down

    def timed_shut_down(table: GroupTable, groups: Any) -> None:
        began = time.perf_counter()
        try:
            shut_down(table, groups)
        finally:
            took = time.perf_counter() - began
            marks["abort_s"] = marks.get("abort_s", 0.0) + took

    step_module.Step._vote = timed_vote  # type: ignore[method-assign]
    watch_module.reform = timed_reform
    GroupTable._shut_down = timed_shut_down  # type: ignore[method-assign]
    return marks


# ============================================================ the launcher


@dataclass
class Kill:
    """One kill: whom, when, where it was, and what every rank reported."""

    victim: int
    killed_at: float
    where: str
    step: int
    delay: float
    reports: dict[int, dict[str, Any]]
    exitcodes: dict[int, int | None]
    marks: dict[str, float]  # the launcher's clock: started, warm, killed, ended
    per_step: float = math.nan  # the slowest rank's step time before the kill


def step_time(
    status: Status, ranks: int, warm_steps: int, deadline: float, procs: Sequence[Any]
) -> tuple[float | None, list[int]]:
    """Warm up: once every rank is past ``warm_steps``, the slowest rank's step time over 2
    more steps (the first steps also connect gloo's pairs); None if ``deadline`` passes or
    a process ends first. With the steps last seen."""
    first: float | None = None
    while True:
        steps = [status.get(r)[0] for r in range(ranks)]
        if first is None and min(steps) >= warm_steps:
            first = time.monotonic()
        if min(steps) >= warm_steps + 2 and first is not None:
            return (time.monotonic() - first) / 2, steps
        if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
            return None, steps
        time.sleep(0.002)


def launch(
    plan: dict[str, Any],
    rng: Any,
    *,
    warm_steps: int = 2,
    window_steps: float = 3.0,
    timeout: float = 300.0,
) -> Kill:
    """One world: train, SIGKILL a random rank at a random moment, let the rest heal."""
    world = math.prod(plan["shape"])
    victim = rng.randrange(world)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with TemporaryDirectory() as outdir:
        status = Status(Path(outdir, "status"), world, create=True)
        args = [(rank_main, r, world, store.port, outdir, plan) for r in range(world)]
        marks = {"started": time.monotonic()}
        killed_at, where, at_step, delay = 0.0, "never", -1, 0.0
        with contextlib.closing(status), Ranks(child, args, timeout) as ranks:
            per_step, steps = step_time(status, world, warm_steps, ranks.deadline, ranks.procs)
            if per_step is None:
                time.sleep(0.5)  # a rank that failed is writing its report
                why = {r: o.get("unexpected", o) for r, o in rank_reports(outdir).items()}
                raise RuntimeError(f"the world did not warm up (steps {steps}); reports: {why}")
            marks["warm"] = time.monotonic()
            delay = rng.uniform(0.0, window_steps * per_step)
            time.sleep(delay)
            at_step, where, _ = status.get(victim)
            killed_at = time.time()
            ranks.kill(victim)
            marks["killed"] = time.monotonic()
            ranks.join()
            marks["ended"] = time.monotonic()
        reports = rank_reports(outdir)
    return Kill(
        victim,
        killed_at,
        where,
        at_step,
        delay,
        reports,
        ranks.exitcodes,
        {k: v - marks["started"] for k, v in marks.items()},
        per_step,
    )


# ============================================================ checks and figures


def survivors_on(kill: Kill) -> dict[int, dict[str, Any]]:
    """The survivors that train on after the heal (not the victim, not those who sat out)."""
    return {
        rank: report
        for rank, report in kill.reports.items()
        if rank != kill.victim and "sat_out" not in report["events"][0]
    }


def check(kill: Kill, plan: dict[str, Any]) -> None:
    """Every survivor that trains on matches the reference and lost exactly the victim."""
    for rank, report in sorted(kill.reports.items()):
        if "unexpected" in report:
            raise RuntimeError(f"rank {rank} failed:\n{report['unexpected']}")
    missing = sorted(set(range(len(kill.exitcodes))) - set(kill.reports) - {kill.victim})
    if missing:
        raise RuntimeError(f"ranks {missing} wrote no report (exit codes {kill.exitcodes})")
    if kill.exitcodes[kill.victim] != -signal.SIGKILL:
        raise RuntimeError(f"the victim {kill.victim} ended with {kill.exitcodes[kill.victim]}")
    for rank, report in sorted(kill.reports.items()):
        if rank == kill.victim:
            continue
        if len(report["events"]) != 1 or report["events"][0].get("lost") != [kill.victim]:
            raise RuntimeError(f"rank {rank}: events {report['events']}, victim {kill.victim}")
    on = survivors_on(kill)
    resumes = {report["events"][0]["resume"] for report in on.values()}
    if len(resumes) != 1:
        raise RuntimeError(f"survivors resumed from steps {sorted(resumes)}")
    resume = resumes.pop()
    replicas = plan["shape"][0]
    last = resume + plan["after"]
    expected = small_reference(last, lambda s: replicas if s < resume else replicas - 1)
    for rank, report in sorted(on.items()):
        if [s for s, _ in report["losses"]] != list(range(last)):
            raise RuntimeError(f"rank {rank} trained steps {[s for s, _ in report['losses']]}")
        for step, loss in report["losses"]:
            if abs(loss - expected[step]) > 1e-9 * max(1.0, abs(expected[step])):
                raise RuntimeError(f"rank {rank} step {step}: loss {loss} != {expected[step]}")
        big = reference_big(
            report["big_size"], last, lambda s: replicas if s < resume else replicas - 1
        )
        want = [float(big[0]), float(big[-1]), float(big.sum())]
        if any(abs(a - b) > 1e-6 * max(1.0, abs(b)) for a, b in zip(report["big"], want)):
            raise RuntimeError(f"rank {rank}: big {report['big']} != {want}")


def phases(kill: Kill) -> list[float]:
    """Seconds from the kill to each phase, for the latest survivor that trains on."""
    rows = []
    for report in survivors_on(kill).values():
        event = report["events"][0]
        learned = report["learned"].get(str(kill.victim))
        rows.append(
            [
                learned if learned is not None else math.nan,
                event["error_at"],
                event["agreed_at"],
                event["reformed_at"],
                event["first_step_at"],
            ]
        )
    return [max(row[i] for row in rows) - kill.killed_at for i in range(len(PHASES))]


# Where the heal's time goes, finer than PHASES: the step's vote ended, the verdict was
# decided (the agreement over), the old mesh closed; "agree" of PHASES is "closed".
BREAKDOWN = ("detect", "abort", "voted", "decided", "closed", "re-form", "first step")


def breakdown(kill: Kill) -> list[float]:
    """Seconds from the kill to each of :data:`BREAKDOWN`, for the latest survivor."""
    keys = ("", "error_at", "voted_at", "decided_at", "closed_at", "reformed_at", "first_step_at")
    rows = []
    for report in survivors_on(kill).values():
        event = report["events"][0]
        learned = report["learned"].get(str(kill.victim))
        row = [learned if learned is not None else math.nan]
        rows.append(row + [event.get(key, math.nan) for key in keys[1:]])
    return [max(row[i] for row in rows) - kill.killed_at for i in range(len(BREAKDOWN))]


def breakdown_line(kills: Sequence[Kill]) -> str:
    """The medians of :func:`breakdown` over ``kills``, each phase with its share of the
    time since the one before, and the median step time before the kill."""
    import statistics

    rows = [breakdown(kill) for kill in kills]
    medians = [statistics.median(row[i] for row in rows) for i in range(len(BREAKDOWN))]
    parts, before = [], 0.0
    for name, at in zip(BREAKDOWN, medians):
        parts.append(f"{name} {at:.3f} (+{1000 * (at - before):.0f} ms)")
        before = at
    step = statistics.median(kill.per_step for kill in kills)
    aborts = [
        max(r["events"][0].get("abort_s", 0.0) for r in survivors_on(kill).values())
        for kill in kills
    ]
    return (
        "breakdown, medians: "
        + ", ".join(parts)
        + f"; a step before the kill {step:.3f} s; aborting the groups took "
        + f"{1000 * statistics.median(aborts):.0f} ms (max {1000 * max(aborts):.0f})"
        + f"; {full_collections(kills)}"
    )


def full_collections(kills: Sequence[Kill]) -> str:
    """How many of ``kills`` had a survivor run a full collection (``full_gc``) between the
    kill and the latest survivor's first step after it, and the longest such collection."""
    hit, longest = 0, 0.0
    for kill in kills:
        end = kill.killed_at + breakdown(kill)[-1]
        during = [
            seconds
            for report in survivors_on(kill).values()
            for start, seconds in report.get("full_gc", [])
            if kill.killed_at <= start <= end
        ]
        hit += bool(during)
        longest = max([longest, *during])
    return f"full collections (gc gen 2) in the heal: {hit} of {len(kills)} kills" + (
        f" (longest {longest:.3f} s)" if hit else ""
    )


def plan_for(
    shape: str, *, timeout: float, interval: float = 0.02, standby: bool = False
) -> dict[str, Any]:
    dims, names = SHAPES[shape]
    return {
        "standby": standby,
        "shape": list(dims),
        "names": list(names),
        "timeout": timeout,
        "agree_timeout": max(60.0, 2 * timeout),
        "interval": interval,
        "after": 3,
        "max_steps": 500,
    }


def survivor_errors(kill: Kill) -> list[str]:
    """Where the survivors were when they learned (the collective they were in)."""
    return sorted({report["events"][0]["in"] for report in survivors_on(kill).values()})


__all__: Sequence[str] = (
    "BREAKDOWN",
    "SHAPES",
    "Kill",
    "breakdown",
    "breakdown_line",
    "check",
    "full_collections",
    "launch",
    "phases",
    "plan_for",
)
