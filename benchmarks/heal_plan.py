"""The liveness watch's test world: 8 ranks train a 2 x 2 x 2 model and follow a plan.

What ``tests/world/test_watch.py`` runs (through :mod:`benchmarks.heal`, which
re-exports it): a plan has a rank SIGKILL itself at a chosen step, sleep, spin,
be SIGSTOPped, check in to the agreement and then die, or agree late
(:func:`rank_main`); :func:`launch` runs one world, :func:`check` holds its
survivors to plain data parallelism (:func:`benchmarks.heal_common.reference`)
and finds what the watches left behind, :func:`phases` times the heal.

>>> plan = {"steps": 9, "kill": {"5": 4}}
>>> sorted(plan)  # launch(plan) runs it: rank 5 SIGKILLs itself before step 4
['kill', 'steps']
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.heal_common import (
    BATCH,
    HID,
    LR,
    PHASES,
    Ranks,
    batch,
    child,
    initial_weights,
    rank_reports,
    reference,
)
from scopedmesh import LostRankError, ProcessGroupMesh
from scopedmesh.c10d.store import WATCH_ROOT as ROOT
from scopedmesh.c10d.store import read
from scopedmesh.fault.liveness.agreement import Driver
from scopedmesh.fault.liveness.deaths import parse_deaths
from scopedmesh.fault.liveness.watch import LivenessWatch, key_names
from scopedmesh.fault.protocol.agreement import Keys, agreement_name, check_in

SHAPE = (2, 2, 2)
NAMES = ("dp", "pp", "tp")


# ============================================================ the model, sharded


def my_shard(mesh: ProcessGroupMesh) -> torch.Tensor:
    """This rank's weights: stage 0 holds w1's tp columns, stage 1 w2's."""
    w = initial_weights()[mesh.coordinate("pp")]
    width = w.shape[1] // mesh.size("tp")
    lo = mesh.coordinate("tp") * width
    return w[:, lo : lo + width].clone()


def _tp_sum(part: torch.Tensor, tp: dist.ProcessGroup | None) -> torch.Tensor:
    full = part.detach().clone()
    dist.all_reduce(full, group=tp)
    return part + (full - part.detach())  # the tp sum, with the gradient of the local part


def train_step(mesh: ProcessGroupMesh, w: torch.Tensor, step: int) -> tuple[torch.Tensor, float]:
    """One step: stage 0 -> stage 1 over pp, tp sums within a stage, dp averages; the update
    to subtract from ``w`` (once the step has committed) and the loss."""
    dp, pp, tp = (mesh.get_group_along_axis(a) for a in NAMES)
    stage, replicas = mesh.coordinate("pp"), mesh.size("dp")
    x, y = batch(step, mesh.coordinate("dp"), replicas)
    width = w.shape[1]
    lo = mesh.coordinate("tp") * width
    shard = w.clone().requires_grad_(True)
    hidden = torch.zeros(BATCH, HID, dtype=torch.float64)
    if stage == 0:
        part = x[:, lo : lo + width] @ shard.T
        hidden = _tp_sum(part, tp)
    sent = hidden.detach().clone()
    dist.all_reduce(sent, group=pp)  # stage 0 sends h
    back = torch.zeros(BATCH * HID + 1, dtype=torch.float64)
    if stage == 1:
        h = sent.requires_grad_(True)
        out = _tp_sum(h[:, lo : lo + width] @ shard.T, tp)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        assert h.grad is not None
        dh = h.grad.clone()
        dist.all_reduce(dh, group=tp)  # the tp ranks' slices of dL/dh, disjoint
        back = torch.cat([dh.flatten(), loss.detach().reshape(1)])
    dist.all_reduce(back, group=pp)  # stage 1 sends dL/dh and the loss back
    if stage == 0:
        part.backward(back[:-1].reshape(BATCH, HID))
    assert shard.grad is not None
    packed = torch.cat([shard.grad.flatten(), back[-1:]])
    dist.all_reduce(packed, group=dp)
    packed /= replicas
    return LR * packed[:-1].reshape(w.shape), float(packed[-1])


# ============================================================ one rank


def _before_agreeing(
    plan: dict[str, Any],
    rank: int,
    watch: LivenessWatch,
    key: str,
    store: Any,
    report: dict[str, Any],
    outdir: str,
) -> None:
    """What the plan has a rank do between its step's failure and the step's agreement on
    the members ``key``: die once checked in to it (``die_checked_in``), or be slow to
    arrive (``slow_agree``)."""
    if plan.get("die_checked_in") == rank:  # a death in the middle of the agreement
        # Checked in by the agreement's own protocol (what the step's exit does first).
        attempt, committed = watch._ledger.attempt(key), watch._ledger.committed.get(key, 0)
        keys = _agreement_keys(watch, key, attempt)
        Driver(store, watch._record).run(check_in(keys, rank, committed))
        _die(report, outdir, rank)
    time.sleep(plan.get("slow_agree", {}).get(str(rank), 0))


def _fds() -> set[tuple[str, str]]:
    """This process's open descriptors and what each points at (a socket's inode)."""
    table = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            table.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the directory's own descriptor, closed by now
            pass
    return table


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _die(report: dict[str, Any], outdir: str, rank: int) -> None:
    report["died_at"] = time.time()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    os.kill(os.getpid(), signal.SIGKILL)


def rank_main(rank: int, world: int, outdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Train; die, stall or heal as ``plan`` says; report times, losses, residue.

    ``plan``: ``steps``; ``kill`` {rank: step} (SIGKILL itself before that step);
    ``sleep`` {rank: [step, s]} (sleep before the step's first collective);
    ``busy`` {rank: [step, s]} (a busy loop there); ``stop`` [rank, step, s] (rank 0
    SIGSTOPs that rank for s seconds, then SIGCONTs it); ``die_checked_in`` rank
    (on the first error, check in to the agreement, then SIGKILL itself);
    ``slow_agree`` {rank: s} (sleep before agreeing); ``interval``.
    """
    report: dict[str, Any] = {"rank": rank}
    store = dist.distributed_c10d._get_default_store()
    store.set(f"bench/pid/{rank}", str(os.getpid()))
    dist.barrier()
    fds0, threads0 = _fds(), _threads()
    watch = LivenessWatch(interval=plan.get("interval", 0.02), timeout=60)
    report["threads_running"] = _threads() - threads0
    mesh = watch.guard(ProcessGroupMesh(*SHAPE, names=NAMES, timeout=60))
    mesh.create_groups(*NAMES)
    dist.barrier()  # every watch is linked, every group formed
    w = my_shard(mesh)
    steps = plan["steps"]
    kill = {int(r): s for r, s in plan.get("kill", {}).items()}
    sleep = {int(r): v for r, v in plan.get("sleep", {}).items()}
    busy = {int(r): v for r, v in plan.get("busy", {}).items()}
    stop = plan.get("stop")
    losses: list[list[float]] = []
    events: list[dict[str, Any]] = []
    step = 0
    while step < steps:
        if kill.get(rank) == step:
            _die(report, outdir, rank)
        if rank in sleep and sleep[rank][0] == step:
            time.sleep(sleep[rank][1])
        if rank in busy and busy[rank][0] == step:
            end = time.monotonic() + busy[rank][1]
            while time.monotonic() < end:
                pass
        if stop is not None and rank == 0 and stop[1] == step:
            pid = int(store.get(f"bench/pid/{stop[0]}"))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop[2])
            os.kill(pid, signal.SIGCONT)
            stop = None  # once: a step redone after a heal does not stop it again
        failure: dict[str, Any] = {"step": step}
        key = watch._key_of(mesh, sorted(mesh.layout.ranks))  # its line's: read while guarded
        try:
            with watch.step(mesh, "dp") as verdict:
                try:
                    update, loss = train_step(mesh, w, step)
                except RuntimeError as error:  # a peer died, or the watch aborted the mesh
                    failure.update(error_at=time.time(), type=type(error).__name__)
                    failure["message"] = str(error)[:300]
                    _before_agreeing(plan, rank, watch, key, store, report, outdir)
                    raise
                failure["error_at"] = time.time()  # the vote (and any doubt) comes next
        except LostRankError as sat_out:
            events.append({**failure, "lost": sorted(verdict.lost), "sat_out": str(sat_out)[:200]})
            events[-1]["accounted"] = _accounted(store, watch, mesh, key)
            break
        if verdict.healed:
            event = {**failure, "agreed_at": time.time(), "lost": sorted(verdict.lost)}
            # How each member was accounted for, read before the last watch to close
            # deletes the agreement's keys.
            event["accounted"] = _accounted(store, watch, mesh, key)
            mesh = verdict.mesh
            mesh.create_groups(*NAMES)
            event["reformed_at"], event["shape"] = time.time(), list(mesh.shape)
            events.append(event)
        if verdict.committed:  # the step counts on every member: apply it
            w -= update
            losses.append([step, loss])
            step += 1
            if events and "first_step_at" not in events[-1] and not verdict.healed:
                events[-1]["first_step_at"] = time.time()
        if verdict.healed:
            events[-1]["resume"] = step
    mesh.close()
    report["losses"] = losses
    report["events"] = events
    report["lost"] = sorted(watch.lost())
    report["learned"] = {r: watch.learned_at(r) for r in watch.lost()}
    report["aborted"] = {r: watch.aborted_at(r) for r in watch.lost()}
    # How the store's list of deaths gave each one, and what the watch thread raised.
    report["declared_by"] = {r: watch.why_lost(r) for r in watch.lost()}
    report["watch_failure"] = repr(watch._failure) if watch._failure is not None else None
    closing = time.time()
    watch.close()
    watch.close()  # idempotent
    report["close_s"] = time.time() - closing
    # A joined thread leaves /proc/self/task a moment after join() returns, and a gloo group
    # an abort held busy is destroyed on a thread of its own once its collective has ended
    # (a rank that sat out closes its mesh within ms of the abort: 40 ms measured).
    settle = time.monotonic() + 2.0
    while (_threads() > threads0 or _fds() - fds0) and time.monotonic() < settle:
        time.sleep(0.01)
    # Descriptors opened since before the watch and still open: what it (or the mesh) leaked.
    report["fds_left"] = len(_fds() - fds0)
    report["threads_left"] = _threads() - threads0
    report["thread_names"] = sorted(
        Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")
    )
    return report


def _accounted(
    store: Any, watch: LivenessWatch, mesh: ProcessGroupMesh, key: str
) -> dict[int, str | None]:
    """How the step's agreement (the watch's latest on ``key``, ``mesh``'s members' key)
    accounted for each rank of ``mesh``: as :func:`accounted_as`, or ``"listed dead"`` for
    a rank with no entry that the store's list of deaths holds (an agreement writes no
    entry for it)."""
    keys = _agreement_keys(watch, key, watch._ledger.attempt(key) - 1)
    dead = parse_deaths(read(store, watch.keys.lost) or "")
    states = {r: accounted_as(store, keys, r) for r in mesh.layout.ranks}
    return {r: "listed dead" if s is None and r in dead else s for r, s in states.items()}


def _agreement_keys(watch: LivenessWatch, key: str, attempt: int) -> Keys:
    """The keys of the agreement ``attempt`` of the members ``key`` under ``watch``."""
    name = agreement_name(key, f"event{attempt}")
    return Keys(f"{watch.prefix}/agree/{name}")


def accounted_as(store: Any, keys: Any, rank: int) -> str | None:
    """How agreement ``keys`` accounted for ``rank``: ``"alive"`` (it checked in itself),
    ``"lost"`` (a survivor did), or None (not yet). Reads either protocol's keys: one
    list of ``rank:state,`` entries (``keys.entries``), or a slot per member."""
    entries = getattr(keys, "entries", None)
    if entries is not None:
        items = (read(store, entries) or "").split(",")
        states = {
            state.partition("/")[0]  # a step's check-in carries its count: "alive/3"
            for r, _, state in (i.partition(":") for i in items)
            if r == str(rank)
        }
        return "alive" if "alive" in states else ("lost" if states else None)
    value = read(store, keys.slot(rank))
    return None if value is None else value.partition(":")[0]


# ============================================================ a world whose store lives here


def launch(plan: dict[str, Any], world: int = 8, timeout: float = 300.0) -> dict[str, Any]:
    """Run :func:`rank_main` on ``world`` forked ranks; the reports, exit codes, store keys left."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with TemporaryDirectory() as outdir:
        args = [(rank_main, r, world, store.port, outdir, plan) for r in range(world)]
        with Ranks(child, args, timeout) as ranks:
            ranks.join()
        reports = rank_reports(outdir)
    return {
        "reports": reports,
        "exitcodes": ranks.exitcodes,
        "watch_keys": watch_keys(store, range(world)),
    }


def watch_keys(store: Any, ranks: Iterable[int]) -> list[str]:
    """The liveness watches' keys left in ``store``, but the per-rank counters kept by design.

    torch 2.10+ lists a store's keys; before that, every key a watch of ``ranks``
    can write is asked for by name.
    """
    if hasattr(store, "list_keys"):
        keys = store.list_keys()
        return sorted(k for k in keys if k.startswith(f"{ROOT}/") and "/count/" not in k)
    ranks = list(ranks)
    counts = [read(store, f"{ROOT}/count/{rank}") for rank in ranks]
    names: list[str] = []
    for number in range(1, max(int(count or 0) for count in counts) + 1):
        prefix = f"{ROOT}/{number}"
        tags = (read(store, f"{prefix}/tags") or "").split("\n")
        names += key_names(prefix, ranks, tags)
    return sorted(name for name in names if store.check([name]))


def phases(result: dict[str, Any], victim: int) -> list[float]:
    """Seconds from the kill to each phase, for the latest survivor that trains on."""
    reports = result["reports"]
    died = reports[victim]["died_at"]
    rows = []
    for report in reports.values():
        events = report.get("events") or []
        if not events or "first_step_at" not in events[-1]:
            continue
        event = events[0]
        learned = report["learned"][str(victim)]
        rows.append(
            [
                learned,
                event["error_at"],
                event["agreed_at"],
                event["reformed_at"],
                event["first_step_at"],
            ]
        )
    return [max(row[i] for row in rows) - died for i in range(len(PHASES))]


def resume_step(result: dict[str, Any]) -> int:
    """The step the survivors resumed from (one for all of them, or an error)."""
    resumed = {
        report["events"][0]["resume"]
        for report in result["reports"].values()
        if report.get("events") and "resume" in report["events"][0]
    }
    if len(resumed) != 1:
        raise RuntimeError(f"survivors resumed from steps {sorted(resumed)}")
    return resumed.pop()


def check(result: dict[str, Any], victim: int, kill_step: int, steps: int) -> None:
    """Every survivor that trains on matches the reference; nothing left behind."""
    reports = result["reports"]
    # First a rank that failed: its watch never closed, so its peers rightly counted it lost.
    for rank, report in sorted(reports.items()):
        if "unexpected" in report:
            raise RuntimeError(f"rank {rank} failed:\n{report['unexpected']}")
    missing = sorted(set(range(len(result["exitcodes"]))) - set(reports))
    if missing:
        raise RuntimeError(f"ranks {missing} wrote no report (exit codes {result['exitcodes']})")
    resume = resume_step(result)
    if resume not in (kill_step - 1, kill_step):
        raise RuntimeError(f"resumed from step {resume} after a kill at step {kill_step}")
    expected = reference(steps, lambda s: 2 if s < resume else 1)
    for rank, report in sorted(reports.items()):
        if rank == victim:
            continue
        if report["lost"] != [victim] or report["events"][0]["lost"] != [victim]:
            extra = {
                r: {
                    k: reports.get(int(r), {}).get(k)
                    for k in ("close_s", "events", "watch_failure")
                }
                for r in report["lost"]
                if r != victim
            }
            raise RuntimeError(
                f"rank {rank}: lost {report['lost']}, expected [{victim}]; declared by "
                f"{report.get('declared_by')}; watch failure {report.get('watch_failure')}; "
                f"the extra ranks: {extra}"
            )
        if report["fds_left"] or report["threads_left"]:
            raise RuntimeError(f"rank {rank} left fds/threads behind: {report}")
        if "sat_out" in report["events"][0]:
            continue
        for step, loss in report["losses"]:
            if abs(loss - expected[step]) > 1e-9 * max(1.0, abs(expected[step])):
                raise RuntimeError(f"rank {rank} step {step}: loss {loss} != {expected[step]}")
        if [s for s, _ in report["losses"]] != list(range(steps)):
            raise RuntimeError(f"rank {rank} trained steps {report['losses']}")
    if result["watch_keys"]:
        raise RuntimeError(f"the watches left store keys: {result['watch_keys'][:10]}")
