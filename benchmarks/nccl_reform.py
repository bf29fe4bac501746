"""The survivors' NCCL communicator: each way torch offers to get it, timed (a GPU host).

    python -m benchmarks.nccl_reform                  # every path, 5 worlds each
    python -m benchmarks.nccl_reform --paths fresh,standby --worlds 10
    python -m benchmarks.nccl_reform --cpu-dry-run    # the same code on gloo, on the CPU

A heal on NCCL spends almost all its time getting the survivors a working
communicator (0.53 s of 0.55 s on an H100, docs/GPU.md). This measures that step
alone, for each way torch offers, in worlds of :func:`benchmarks.heal_nccl.world_size`
spawned ranks (two on one GPU, the test rig of docs/GPU.md); the last rank is the one
"lost" (it stays alive and idle, so nothing waits for a death's detection):

* ``fresh``: today's heal. A guarded-style mesh along ``dp`` (WORLD gloo) has used its
  NCCL group; the survivors abort the mesh, ``reform`` it without the last rank and
  ask for its dp group, which forms by its own ``ncclCommInitRank`` over the store.
* ``standby``: the same, after ``prepare_standby(mesh, "dp")`` formed the survivors'
  groups before (untimed): the healed mesh takes its group from them.
* ``reconfigure``: WORLD made with ``init_process_group(..., enable_reconfigure=True)``
  (torch 2.14+), configured over every rank, used; the survivors call
  ``dist._reconfigure`` over their own handles. torch 2.15's ``nccl2`` bootstraps a
  fresh communicator there (pytorch/pytorch#189359).
* ``shrink``: WORLD NCCL bound to the device, used; the survivors call
  ``dist.shrink_group([last])`` (``ncclCommShrink``; docs/GPU.md saw it fail once).

Each time runs from the first survivor's call to its first one-element all_reduce on
the new communicator, synchronised; a world's figure is its slowest survivor's. Per
path: median and max over the worlds, or what stopped it (a torch without the API, an
error, a timeout). Before any ``standby`` world, each rank's device memory is read
around ``prepare_standby`` (MiB per communicator, printed).
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.heal_common import Ranks, load
from benchmarks.heal_nccl import RANK_ENV, place, world_size

PATHS = ("fresh", "standby", "reconfigure", "shrink")
TIMEOUT = 120.0  # seconds a world may take, its formations included


def _first_step(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """One one-element all_reduce on ``group``, synchronised: the communicator works."""
    dist.all_reduce(torch.ones(1, device=device), group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mesh_path(rank: int, world: int, device: torch.device, backend: str, standby: bool) -> Any:
    """``fresh`` / ``standby``: abort the used mesh, reform it without the last rank, and
    take the first step on its dp group; seconds on a survivor, None on the last rank."""
    from scopedmesh import ProcessGroupMesh, reform
    from scopedmesh.mesh.standby import prepare_standby

    mesh = ProcessGroupMesh(world, names=("dp",), backend=backend, timeout=60)
    _first_step(mesh.get_group_along_axis("dp"), device)
    out: dict[str, Any] = {}
    if standby:
        ready = prepare_standby(mesh, "dp")
        out["standby_bytes_per_group"] = ready.bytes_per_group
    dist.barrier()  # gloo WORLD: every rank ready, the last one idle from here
    if rank == world - 1:
        mesh.close()
        return out
    start = time.perf_counter()
    mesh.abort("by the benchmark: the last rank is lost")
    healed = reform(mesh, [world - 1], "dp")
    _first_step(healed.get_group_along_axis("dp"), device)
    out["seconds"] = time.perf_counter() - start
    out["taken"] = healed._table.standby.taken if standby and healed._table.standby else 0
    healed.close()
    return out


def _handles(store: dist.Store, rank: int, ranks: list[int], round_: int) -> list[str]:
    store.set(f"handle/{round_}/{rank}", dist._get_reconfigure_handle())  # type: ignore[attr-defined]
    return [store.get(f"handle/{round_}/{r}").decode() for r in ranks]


def _reconfigure_path(rank: int, world: int, device: torch.device, store: dist.Store) -> Any:
    """``reconfigure``: WORLD in the reconfigure regime, configured over all, then over the
    survivors; seconds on a survivor."""
    if not hasattr(dist, "_reconfigure"):
        return {"unsupported": f"torch {torch.__version__} has no dist._reconfigure (2.14+)"}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(  # type: ignore[call-arg]
        backend,
        store=dist.PrefixStore("reconfigure/", store),
        rank=rank,
        world_size=world,
        enable_reconfigure=True,
        timeout=timedelta(seconds=60),
    )
    if not dist._supports_reconfigure():  # type: ignore[attr-defined]
        return {"unsupported": f"{backend} on torch {torch.__version__} cannot reconfigure"}
    everyone = _handles(store, rank, list(range(world)), 0)
    dist._reconfigure(uuid=1, handles=everyone).wait()  # type: ignore[attr-defined]
    _first_step(None, device)
    survivors = list(range(world - 1))
    handles = _handles(store, rank, list(range(world)), 1)  # after the first configuration
    store.add("reconfigure/ready", 1)
    while int(store.add("reconfigure/ready", 0)) < world:
        time.sleep(0.01)
    if rank == world - 1:
        return {}
    start = time.perf_counter()
    mine = [handles[r] for r in survivors]
    dist._reconfigure(uuid=2, handles=mine).wait()  # type: ignore[attr-defined]
    _first_step(None, device)
    return {"seconds": time.perf_counter() - start}


def _shrink_path(rank: int, world: int, device: torch.device, store: dist.Store) -> Any:
    """``shrink``: WORLD NCCL bound to the device, used, then shrunk by the survivors."""
    if device.type != "cuda":
        return {"unsupported": "shrink_group needs NCCL"}
    if not hasattr(dist, "shrink_group"):
        return {"unsupported": f"torch {torch.__version__} has no dist.shrink_group"}
    dist.init_process_group(
        "nccl",
        store=dist.PrefixStore("shrink/", store),
        rank=rank,
        world_size=world,
        device_id=device,
        timeout=timedelta(seconds=60),
    )
    _first_step(None, device)
    store.add("shrink/ready", 1)
    while int(store.add("shrink/ready", 0)) < world:
        time.sleep(0.01)
    if rank == world - 1:
        time.sleep(10.0)  # alive and idle: not a participant
        return {}
    start = time.perf_counter()
    shrunk = dist.shrink_group([world - 1])
    _first_step(shrunk, device)
    return {"seconds": time.perf_counter() - start}


def _child(rank: int, world: int, port: int, outdir: str, plan: dict[str, Any]) -> None:
    os.environ.update(RANK_ENV)
    path = plan["path"]
    try:
        device = place(rank) if plan["backend"] == "nccl" else torch.device("cpu")
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        if path in ("fresh", "standby"):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            out = _mesh_path(rank, world, device, plan["backend"], path == "standby")
        elif path == "reconfigure":
            out = _reconfigure_path(rank, world, device, store)
        else:
            out = _shrink_path(rank, world, device, store)
    except BaseException as error:  # reported as this world's outcome
        out = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # a reconfigured or shrunk world does not tear down together


def one_world(path: str, world: int, backend: str) -> dict[str, Any]:
    """One world of ``path``: its slowest survivor's seconds, or why there are none."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    plan = {"path": path, "backend": backend}
    with TemporaryDirectory() as outdir:
        args = [(r, world, store.port, outdir, plan) for r in range(world)]
        with Ranks(_child, args, TIMEOUT, start_method="spawn") as ranks:
            ranks.join()
        reports = {}
        for r in range(world):
            file = Path(outdir, f"rank{r}.json")
            reports[r] = json.loads(file.read_text()) if file.exists() else {"error": "no report"}
    problems = [
        f"rank {r}: {o.get('error') or o['unsupported']}"
        for r, o in reports.items()
        if "error" in o or "unsupported" in o
    ]
    if problems:
        return {
            "problem": problems[0],
            "trace": next((o.get("trace", "") for o in reports.values() if "trace" in o), ""),
        }
    seconds = [o["seconds"] for o in reports.values() if "seconds" in o]
    memory = [
        o["standby_bytes_per_group"]
        for o in reports.values()
        if o.get("standby_bytes_per_group") is not None
    ]
    return {
        "seconds": max(seconds),
        "memory": memory,
        "taken": [o.get("taken", 0) for o in reports.values() if "seconds" in o],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nccl_reform")
    parser.add_argument("--paths", default=",".join(PATHS), help="of " + ",".join(PATHS))
    parser.add_argument("--worlds", type=int, default=5, help="worlds per path")
    parser.add_argument("--cpu-dry-run", action="store_true", help="gloo on the CPU, 2 ranks")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"--paths takes {', '.join(PATHS)}; got {', '.join(unknown)}")
    if args.cpu_dry_run:
        backend, world, where = "gloo", 2, "CPU dry run (gloo)"
    elif not torch.cuda.is_available():
        print(
            "nccl_reform: no CUDA device is visible to torch; run it on a GPU host", file=sys.stderr
        )
        return 1
    else:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        backend, world = "nccl", world_size()
        where = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, NCCL {nccl}"
    print(
        f"{world} ranks, {where}, torch {torch.__version__}, {args.worlds} worlds a path, {load()}",
        flush=True,
    )
    medians: dict[str, float] = {}
    for path in paths:
        figures, problem, memory = [], "", []
        for _ in range(args.worlds):
            result = one_world(path, world, backend)
            if "problem" in result:
                problem = result["problem"]
                break
            figures.append(result["seconds"])
            memory += result["memory"]
        if figures:
            medians[path] = statistics.median(figures)
            line = (
                f"{path:>11}: median {medians[path]:.3f} s, max {max(figures):.3f} s "
                f"over {len(figures)} worlds"
            )
        else:
            line = f"{path:>11}: not measured: {problem}"
        if memory:
            line += f"; standby {max(memory) / 2**20:.1f} MiB per communicator"
        print(line, flush=True)
    if "fresh" in medians:
        for path, median in medians.items():
            if path != "fresh":
                print(f"{path} vs fresh: {medians['fresh'] / max(median, 1e-9):.1f}x faster")
    print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
