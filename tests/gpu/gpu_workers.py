"""The GPU suite's rank code, written once for NCCL on CUDA and dry-run on gloo on the CPU.

Each ``*_world`` function runs on every rank of one world and returns plain facts;
the tests (tests/gpu/test_nccl.py) assert them. Only public torch API is used here.
Every check mirrors a gloo test, named in its docstring.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # benchmarks.heal_nccl: the rank placement the suite shares

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.heal_nccl import NUMEL, RANK_ENV, place  # noqa: E402
from scopedmesh import (  # noqa: E402
    LivenessWatch,
    MeshClosedError,
    ProcessGroupMesh,
    agree_on_lost,
    node_aware_mesh,
    reform,
)
from scopedmesh.c10d import groups as _c10d  # noqa: E402

TIMEOUT = 60.0


def gpus() -> int:
    """The CUDA devices torch sees (0 on a CPU-only host or build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_for(backend: str, rank: int) -> torch.device:
    """This rank's device: under NCCL its GPU and host id (``heal_nccl.place``, the one place
    they are chosen: two ranks on one GPU present two hosts), the CPU under gloo."""
    if backend == "nccl":
        return place(rank)
    return torch.device("cpu")


def rebind_world(rank: int, world_size: int, device: torch.device) -> None:
    """Re-initialise WORLD bound to ``device`` (``device_id``), over the launcher's store."""
    # Every rank must be through WORLD's formation before any destroys it (DESIGN.md,
    # hazard 8: a peer still connecting fails with "Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False
    )
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        dist.get_backend()
        if dist.is_initialized()
        else ("nccl" if device.type == "cuda" else "gloo"),
        store=dist.PrefixStore("bound/", store),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )


def total(group: dist.ProcessGroup, device: torch.device) -> int:
    """The sum of the members' global ranks, by a real all_reduce on ``device``."""
    t = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())


def mesh_world(rank: int, world_size: int, backend: str, bound: bool) -> dict[str, Any]:
    """Membership, close, kept handles and re-creation (mirrors tests/world/test_mesh.py)."""
    device = device_for(backend, rank)
    if bound:
        rebind_world(rank, world_size, device)
    out: dict[str, Any] = {"bound": bound}
    rows = world_size // 2
    # Mirrors test_membership / test_custom_ranks: groups by their members only, sums by hand.
    with ProcessGroupMesh(rows, 2, names=("dp", "tp"), backend=backend, timeout=TIMEOUT) as mesh:
        tp, dp = mesh.get_group_along_axis("tp"), mesh.get_group_along_axis("dp")
        assert tp is not None and dp is not None
        out["tp_sum"], out["dp_sum"] = total(tp, device), total(dp, device)
        out["tp_ranks"] = mesh.get_ranks_in_group(tp)
        kept = tp
    # Mirrors test_close_*: close destroyed the mesh's groups, locally and within a bound.
    start = time.monotonic()
    mesh.close()  # a second close: a no-op
    out["close_seconds"] = time.monotonic() - start
    # Mirrors test_closable / test_kept_handle: a kept handle fails loudly, never hangs.
    try:
        total(kept, device)
        out["kept_handle"] = "worked"
    except (RuntimeError, ValueError, MeshClosedError) as error:
        out["kept_handle"] = type(error).__name__
    # WORLD is untouched (mirrors test_world_untouched).
    out["world_sum"] = total(dist.group.WORLD, device)  # type: ignore[arg-type]
    # Mirrors the re-creation hazard pins (tests/world/test_c10d.py): open/close cycles, one rank late.
    sums = []
    for cycle in range(5):
        with ProcessGroupMesh(
            rows, 2, names=("dp", "tp"), backend=backend, timeout=TIMEOUT
        ) as again:
            sums.append(total(again.get_group_along_axis("tp"), device))  # type: ignore[arg-type]
            if rank == 0 and cycle % 2:
                time.sleep(0.5)  # skew: rank 0 destroys late
    out["cycle_sums"] = sums
    return out


def interop_world(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """DTensor, TP and FSDP2 over the mesh's groups (mirrors tests/world/test_interop.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    device = device_for(backend, rank)
    out: dict[str, Any] = {}
    shape = (world_size // 2, 2)
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double().to(device)
    x = torch.randn(3, 4, dtype=torch.float64, device=device)

    def train(dm: Any) -> list[float]:
        model = parallelize_module(
            copy.deepcopy(dense), dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
        )
        fully_shard(model, mesh=dm["dp"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(x).square().sum()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.item()))
        return losses

    with ProcessGroupMesh(*shape, names=("dp", "tp"), backend=backend, timeout=TIMEOUT) as mesh:
        dm = mesh.to_device_mesh(device.type)
        full = torch.arange(24, dtype=torch.float64, device=device).reshape(4, 6)
        out["full_ok"] = bool(
            (distribute_tensor(full, dm, [Shard(0), Shard(1)]).full_tensor() == full).all()
        )
        out["ours"] = train(dm)
    out["torchs"] = train(init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp")))
    return out


def heal_world(rank: int, world_size: int, backend: str) -> dict[str, Any] | None:
    """One rank exits cleanly; the survivors agree and train on (mirrors tests/world/test_heal.py)."""
    device = device_for(backend, rank)
    gone = world_size - 1
    mesh = ProcessGroupMesh(
        world_size // 2, 2, names=("dp", "tp"), backend=backend, timeout=TIMEOUT
    )
    with mesh:
        total(mesh.get_group_along_axis("dp"), device)  # type: ignore[arg-type]
    if rank == gone:
        return None  # leaves cleanly; allow_exit lets the launcher expect it
    lost = agree_on_lost(range(world_size), rank, tag="gpu-heal", timeout=TIMEOUT / 2)
    out: dict[str, Any] = {"lost": sorted(lost)}
    if rank // 2 == gone // 2:  # shared the lost rank's dp row: sits out
        out["sat_out"] = True
        return out
    with reform(mesh, lost, "dp") as survivors:
        out["shape"] = survivors.shape
        out["dp_sum"] = total(survivors.get_group_along_axis("dp"), device)  # type: ignore[arg-type]
    return out


def nodes_world(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """node_aware_mesh on NCCL: tp inside a node (mirrors tests/world/test_nodes.py)."""
    device = device_for(backend, rank)
    with node_aware_mesh(
        world_size // 2, 2, names=("dp", "tp"), intra_node="tp", backend=backend, timeout=TIMEOUT
    ) as mesh:
        tp = mesh.get_group_along_axis("tp")
        assert tp is not None
        return {"tp_ranks": mesh.get_ranks_in_group(tp), "tp_sum": total(tp, device)}


def _used_bytes(device: torch.device) -> int:
    """GPU memory in use on ``device``, every process's (what nvidia-smi shows)."""
    torch.cuda.synchronize(device)
    free, total_bytes = torch.cuda.mem_get_info(device)
    return int(total_bytes - free)


def memory_world(rank: int, world_size: int, blocks: int) -> dict[str, Any]:
    """``blocks`` scoped blocks, each a group over every rank and a 4 MiB all_reduce, then
    as many groups made with ``new_group`` and kept: groups and GPU bytes after each.

    The baseline is taken after one scoped block: a process's first NCCL communicator
    loads NCCL's device code and buffers once. Measured from a baseline before any
    communicator (H100, torch 2.11, NCCL 2.28.9, two ranks): 801 MB after 12 scoped
    blocks that left no group, where 12 kept groups then added 426 MB.
    """
    device = device_for("nccl", rank)
    torch.ones(1, device=device)  # the CUDA context, before the baseline

    def scoped_block() -> None:
        with ProcessGroupMesh(world_size, names=("dp",), backend="nccl", timeout=TIMEOUT) as m:
            g = m.get_group_along_axis("dp")
            dist.all_reduce(torch.ones(NUMEL, device=device), group=g)
            torch.cuda.synchronize(device)

    scoped_block()  # NCCL's one-time cost, outside the baseline
    dist.barrier()
    groups, base = _c10d.live_group_count(), _used_bytes(device)
    after_each = []
    for _ in range(blocks):
        scoped_block()
        after_each.append(_used_bytes(device) - base)
    dist.barrier()
    out: dict[str, Any] = {
        "scoped_groups": _c10d.live_group_count() - groups,
        "scoped_bytes": _used_bytes(device) - base,
        "scoped_after_each": after_each,
    }
    kept = []
    for _ in range(blocks):
        g = dist.new_group(list(range(world_size)), backend="nccl")
        dist.all_reduce(torch.ones(NUMEL, device=device), group=g)
        torch.cuda.synchronize(device)
        kept.append(g)
    dist.barrier()
    out["kept_groups"] = _c10d.live_group_count() - groups
    out["kept_bytes"] = _used_bytes(device) - base
    for g in kept:
        dist.destroy_process_group(g)
    return out


def kept_handle_world(rank: int, world_size: int) -> dict[str, Any]:
    """Both ranks step on a guarded NCCL mesh (``watch.step``). Rank 0 starts an all_reduce
    that rank 1 never joins and keeps its handle; rank 1's step raises instead, which
    posts a stop: rank 0's watch aborts its communicator, and the kernel exits early. However
    the handle answers (on NCCL a cut-short collective looks done), the step fails on both
    ranks, the mesh re-forms with nobody lost, and rank 1 gets its exception back."""
    device = device_for("nccl", rank)
    out: dict[str, Any] = {}
    with LivenessWatch(interval=0.02, timeout=TIMEOUT) as watch:
        mesh = ProcessGroupMesh(world_size, names=("dp",), backend="nccl", timeout=TIMEOUT)
        watch.guard(mesh)
        dp = mesh.get_group_along_axis("dp")
        assert dp is not None
        out["first_sum"] = total(dp, device)
        verdict = watch.step(mesh, "dp")
        start = time.monotonic()
        try:
            with verdict:
                if rank == 1:
                    time.sleep(1.0)  # rank 0's collective is in flight by now
                    raise ValueError("rank 1's step failed before its all_reduce")
                work = dist.all_reduce(torch.ones(NUMEL, device=device), group=dp, async_op=True)
                assert work is not None
                try:
                    work.wait()
                    torch.cuda.synchronize(device)
                    out["waited"] = "returned"  # the cut kernel looks done
                except RuntimeError as error:
                    out["waited"] = type(error).__name__
                try:
                    out["success"] = work.is_success()
                except RuntimeError as error:
                    out["success"] = f"raised {type(error).__name__}"
        except ValueError as error:
            out["raised"] = str(error)
        out["seconds"] = time.monotonic() - start
        out["committed"], out["healed"] = verdict.committed, verdict.healed
        out["lost"], out["shape"] = sorted(verdict.lost), list(verdict.mesh.shape)
        out["refused"] = "aborted" in repr(mesh)  # the old mesh: closed after its abort
        verdict.mesh.close()
    return out


def replicas_rank(
    replica: int, coordinate: int, job_port: int, replicas: int, steps: int, pace: float
) -> dict[str, Any]:
    """One rank of a replicated job on NCCL (tests/world/_workers_grow.py's ``train``, its
    model and gradients on this replica's GPU, ``Replicas(backend="nccl")``): on one GPU
    each replica presents its own NCCL host id (``place``). Mirrors
    tests/world/test_grow_nccl.py, where a CPU stand-in plays ProcessGroupNCCL."""
    for name, value in RANK_ENV.items():
        os.environ.setdefault(name, value)
    device = place(replica)
    world = str(Path(__file__).resolve().parents[1] / "world")
    if world not in sys.path:
        sys.path.insert(0, world)
    import _workers_grow

    return _workers_grow.train(
        replica, coordinate, job_port, replicas, steps, pace, "nccl", True, str(device)
    )
