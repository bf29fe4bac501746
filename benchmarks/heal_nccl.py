"""Heal on NCCL: from a SIGKILL to the survivors' first step on the re-formed mesh (a GPU host).

    python -m benchmarks.heal_nccl                 # 10 kills, 2 ranks per GPU pair (or on 1 GPU)
    python -m benchmarks.heal_nccl --kills 20 --bound   # WORLD bound to the device (device_id)
    python -m benchmarks.heal_nccl --standby on    # every kill with standby groups (off: none)

Each kill is a fresh world of spawned ranks (the store hosted by the launcher,
as torchrun's agent hosts it), each on its GPU, or two on one GPU with a host id
each (:func:`place`). Every rank trains on a guarded NCCL mesh (``dp`` over all
ranks): every step all-reduces 4 MiB along ``dp`` and checks the sum. Once
every rank has done a few steps, the launcher waits a random fraction of a
few steps' time and SIGKILLs a random rank. The watch aborts the survivors'
NCCL communicators; they agree, re-form without the dead rank (by their own
init, never split from WORLD's communicator) and train on; every step's sum
must be that of its members. Per kill a row of seconds from the kill to the
latest survivor's detect, abort (its step raised), agree, re-form and first
step, as ``benchmarks.heal`` prints for gloo; last,
``heal: median X s, max Y s over N kills (...)``.

**Standby groups** (issue 45, :mod:`scopedmesh.mesh.standby`): with ``--standby
both`` (the default) the kills alternate between worlds whose ranks form, before
the kill and while they train, the groups the survivors will need
(``prepare_standby(mesh, "dp")``) and worlds that form them after the death, as
before; a summary line each, their ratio, and the standby groups' device memory
(bytes per communicator, from ``torch.cuda.mem_get_info`` around their formation).
Each standby survivor must have taken its healed group from the standby (a count,
checked per kill).

Needs ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` on the stock NCCL backend (the
launcher sets it for its ranks; see docs/GPU.md). Two ranks on one GPU is a test
rig for the library's logic, not an NCCL setup NVIDIA supports.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.heal_common import PHASES, Ranks, load, rank_reports, summary
from scopedmesh import ProcessGroupMesh
from scopedmesh.c10d.nccl import check_error_handling
from scopedmesh.fault.liveness import LivenessWatch
from scopedmesh.mesh.standby import prepare_standby

NUMEL = 1 << 20  # 4 MiB of float32 per step
# What every rank of a GPU world needs in its environment before torch makes an NCCL group.
RANK_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
ONE_GPU_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def place(rank: int) -> torch.device:
    """This rank's GPU, and the host NCCL should take it for: the one place both are chosen.

    With 2 or more GPUs, rank ``r`` uses GPU ``r % count`` and NCCL sees the real
    host. With one GPU (the test rig), every rank uses it and presents its own
    ``NCCL_HOSTID``, so NCCL takes the ranks for separate hosts and connects them
    over its socket transport (``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``);
    set before this process makes its first NCCL communicator.
    """
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("place: no CUDA device is visible to torch")
    if count == 1:
        os.environ["NCCL_HOSTID"] = f"scopedmesh-rank-{rank}"
        for name, value in ONE_GPU_ENV.items():
            os.environ.setdefault(name, value)
    index = rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def world_size() -> int:
    """Ranks per world: every GPU (an even number of them), or two on one GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(2, count - count % 2)


def bind_world(rank: int, world: int, device: torch.device, port: int) -> None:
    """Re-initialise WORLD as NCCL bound to ``device`` (``device_id``): torch then splits
    new NCCL groups from WORLD's communicator, except a healed mesh's."""
    dist.barrier()  # every rank through gloo WORLD's formation before any destroys it
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "nccl",
        store=dist.PrefixStore("bound/", store),
        rank=rank,
        world_size=world,
        device_id=device,
        timeout=timedelta(seconds=60),
    )


def _step(mesh: ProcessGroupMesh, step: int, device: torch.device) -> list[Any]:
    """One step: all_reduce 4 MiB along dp; the sum and the members that made it.

    On NCCL a collective an abort cut short looks done; the step runs inside
    ``watch.step``, whose verdict (the device synchronised, then the mesh's
    abort state, then a vote) decides whether the sum counts.
    """
    dp = mesh.get_group_along_axis("dp")
    if dp is None:  # every rank is in its dp group; a None would be the library's bug
        raise RuntimeError(f"rank {dist.get_rank()} got no dp group from {mesh!r}")
    t = torch.full((NUMEL,), float(step + 1) * (dist.get_rank() + 1), device=device)
    dist.all_reduce(t, group=dp)
    return [step, float(t[0].item()), mesh.get_ranks_in_group(dp)]


def rank_main(rank: int, world: int, outdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Train until ``plan["steps"]`` (and ``plan["seconds"]`` after a heal) on a guarded mesh,
    each step under ``watch.step``: a step's sum counts only where the step committed."""
    backend = plan.get("backend", "nccl")  # "gloo": the same run on the CPU (a dry run)
    device = place(rank) if backend == "nccl" else torch.device("cpu")
    if plan.get("bound"):
        bind_world(rank, world, device, plan["port"])
    check_error_handling(backend, os.environ)  # what LivenessWatch.guard will check
    out: dict[str, Any] = {"steps": [], "events": []}
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(world, names=("dp",), backend=backend, timeout=60))
    standby = None
    if plan.get("standby"):  # the survivors' groups, formed now: before any death
        mesh.get_group_along_axis("dp")
        standby = prepare_standby(mesh, "dp")
        out["standby"] = {"formed": standby.formed, "bytes_per_group": standby.bytes_per_group}
    Path(outdir, f"pid{rank}").write_text(str(os.getpid()))
    step, healed_at = 0, None
    while step < plan["steps"] or (
        healed_at is not None and time.time() - healed_at < plan.get("seconds", 0.0)
    ):
        raised: dict[str, Any] = {}
        with watch.step(mesh, "dp") as verdict:
            try:
                result = _step(mesh, step, device)
            except RuntimeError as error:  # an abort, or a peer that died
                raised.update(raised=time.time(), error=type(error).__name__)
                raise
        if verdict.healed:
            now = time.time()
            event: dict[str, Any] = {"raised": now, **raised, "agreed": now}
            event["lost"] = sorted(verdict.lost)
            event["learned"] = min((watch.learned_at(r) or now for r in verdict.lost), default=now)
            mesh = verdict.mesh
            mesh.get_group_along_axis("dp")
            event["reformed"] = time.time()
            event["standby_taken"] = standby.taken if standby is not None else 0
            out["events"].append(event)
            healed_at = healed_at or event["raised"]
        if not verdict.committed:
            continue  # redo the step on the re-formed mesh
        out["steps"].append(result)
        if out["events"]:
            out["events"][-1].setdefault("first_step", time.time())
        step += 1
        Path(outdir, f"step{rank}").write_text(str(step))
    out["healed_for"] = time.time() - healed_at if healed_at else 0.0
    mesh.close()
    watch.close()
    return out


def _child(rank: int, world: int, port: int, outdir: str, plan: dict[str, Any]) -> None:
    os.environ.update(RANK_ENV)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        report = rank_main(rank, world, outdir, plan)
    except BaseException:
        report = {"unexpected": traceback.format_exc()}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # a world with a dead member cannot tear down together


def _steps_done(outdir: str, ranks: range) -> int:
    done = []
    for r in ranks:
        path = Path(outdir, f"step{r}")
        done.append(int(path.read_text() or 0) if path.exists() else 0)
    return min(done)


def launch(plan: dict[str, Any], rng: random.Random, timeout: float = 300.0) -> dict[str, Any]:
    """One world: train, SIGKILL a random rank at a random moment from here, let the rest heal."""
    world = plan["world"]
    victim = rng.randrange(world)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    plan = {**plan, "port": store.port}
    with TemporaryDirectory() as outdir:
        args = [(r, world, store.port, outdir, plan) for r in range(world)]
        # CUDA: never fork a process that may have touched it.
        with Ranks(_child, args, timeout, start_method="spawn") as ranks:
            while _steps_done(outdir, range(world)) < plan["warm"]:
                if not ranks.left() or not ranks.all_alive():
                    raise RuntimeError(f"the world did not warm up ({plan['warm']} steps)")
                time.sleep(0.01)
            delay = rng.uniform(0.0, plan["window"])
            time.sleep(delay)
            killed_at = time.time()
            ranks.kill(victim)
            ranks.join()
        reports = rank_reports(outdir)
    return {
        "victim": victim,
        "killed_at": killed_at,
        "delay": delay,
        "reports": reports,
        "standby": bool(plan.get("standby")),
    }


def check(kill: dict[str, Any]) -> None:
    """Every survivor healed once, lost only the victim, and every step summed its members."""
    victim, reports = kill["victim"], kill["reports"]
    for rank, report in reports.items():
        if "unexpected" in report:
            raise AssertionError(f"rank {rank}:\n{report['unexpected']}")
        if rank == victim:
            continue
        if [e["lost"] for e in report["events"]] != [[victim]]:
            raise AssertionError(f"rank {rank} healed {report['events']}")
        taken = report["events"][0].get("standby_taken", 0)
        if taken != (1 if kill.get("standby") else 0):  # the healed dp group, formed ahead
            raise AssertionError(f"rank {rank} took {taken} standby group(s): {report}")
        for step, value, members in report["steps"]:
            if value != (step + 1) * sum(m + 1 for m in members):
                raise AssertionError(f"rank {rank} step {step}: {value} over {members}")


def phases(kill: dict[str, Any]) -> list[float]:
    """Seconds from the kill to the latest survivor's detect, abort, agree, re-form, first step."""
    events = [r["events"][0] for rank, r in kill["reports"].items() if rank != kill["victim"]]
    keys = ("learned", "raised", "agreed", "reformed", "first_step")
    return [max(e[k] for e in events) - kill["killed_at"] for k in keys]


def parser() -> argparse.ArgumentParser:
    """This module's own arguments (``python -m benchmarks.heal_nccl``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--bound", action="store_true", help="WORLD bound to the device")
    parser.add_argument("--out", type=Path, help="write every kill's figures here (JSON)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="gloo on the CPU, 2 ranks")
    parser.add_argument(
        "--standby",
        choices=["on", "off", "both"],
        default="both",
        help="standby groups formed before the kill (both: kills alternate, off first)",
    )
    return parser


def main(args: argparse.Namespace | None = None) -> int:
    """Run the benchmark: ``args`` as :func:`parser` or ``python -m benchmarks.heal
    --backend nccl`` gives them (``kills`` None: 10)."""
    args = parser().parse_args() if args is None else args
    args.kills = 10 if args.kills is None else args.kills
    if args.cpu_dry_run:
        return _report(args, {"world": 2, "backend": "gloo"}, "CPU dry run (gloo), 2 ranks")
    if not torch.cuda.is_available():
        print(
            "heal_nccl: no CUDA device is visible to torch; run it on a GPU host", file=sys.stderr
        )
        return 1
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    where = (
        f"{world_size()} ranks on {torch.cuda.device_count()} GPU(s) "
        f"({torch.cuda.get_device_name(0)}), NCCL {nccl}, WORLD {'bound' if args.bound else 'gloo'}"
    )
    return _report(args, {"world": world_size(), "bound": args.bound}, where)


def _report(args: argparse.Namespace, plan: dict[str, Any], where: str) -> int:
    """Run ``args.kills`` kills of ``plan`` and print the rows and the summary lines."""
    world = plan["world"]
    plan = {"steps": 40, "warm": 5, "window": 0.05, **plan}
    chosen = getattr(args, "standby", None) or "both"  # benchmarks.heal's flag: None unless given
    modes = {"on": [True], "off": [False], "both": [False, True]}[chosen]
    rng = random.Random(args.seed)
    print(
        f"{world}x1 (dp), {where}, {args.kills} kills, standby {chosen}, mesh timeout 60 s, "
        f"torch {torch.__version__}, {load()}",
        flush=True,
    )
    print(f"{'kill':>4} {'rank':>4} {'standby':>7} " + " ".join(f"{p:>10}" for p in PHASES))
    rows: dict[bool, list[list[float]]] = {mode: [] for mode in modes}
    per_group: list[int] = []
    record = []
    for number in range(args.kills):
        standby = modes[number % len(modes)]
        kill = launch({**plan, "standby": standby}, rng)
        check(kill)
        row = phases(kill)
        rows[standby].append(row)
        per_group += [
            r["standby"]["bytes_per_group"]
            for r in kill["reports"].values()
            if r.get("standby", {}).get("bytes_per_group") is not None
        ]
        record.append(
            {"victim": kill["victim"], "delay": kill["delay"], "standby": standby, "phases": row}
        )
        print(
            f"{number + 1:>4} {kill['victim']:>4} {'on' if standby else 'off':>7} "
            + " ".join(f"{t:>10.3f}" for t in row),
            flush=True,
        )
    for mode in modes:
        if rows[mode]:
            label = "standby" if mode else "fresh"
            print(f"{world}x1, {label}: {summary(rows[mode])}; {load()}", flush=True)
    if len(modes) == 2 and rows[False] and rows[True]:
        fresh = statistics.median(row[-1] for row in rows[False])
        ready = statistics.median(row[-1] for row in rows[True])
        print(f"standby vs fresh, median death to first step: {fresh / max(ready, 1e-9):.1f}x")
    if per_group:
        print(
            f"standby memory: {max(per_group) / 2**20:.1f} MiB per communicator (max over "
            f"ranks and kills; {len(per_group)} measured)"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"torch": torch.__version__, "where": where, "kills": record})
        )
    print(f"heal: {summary(rows[modes[-1]])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
