"""Workers for tests/world/test_heal.py: a world whose store lives outside every worker.

As torchrun's agent does, the test process hosts the ``TCPStore`` and each
worker joins with ``init_process_group(store=...)``, so a worker can die without
taking the store with it. Each worker writes its report as JSON to
``outdir/rank<r>.json`` (a dying worker writes before it dies).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _workers_common import rss_kib

from benchmarks.heal_common import Ranks
from scopedmesh.c10d import closable as _closable
from scopedmesh.c10d import groups as _c10d
from scopedmesh.fault.heal import LostRankError, agree_on_lost, reform
from scopedmesh.mesh import ProcessGroupMesh

NAMES = ("dp", "tp")
IN, OUT, BATCH, LR = 8, 4, 8, 0.1
# heal_world's collective timeout, and its agreement deadline, which the survivors always run
# into (the victim never checks in). The deadline must outlast the spread of the survivors'
# failure times: here every survivor's collective fails within 0.1 s of the death (a peer
# closes its groups), and even one that waited out the collective timeout would be in time.
COLLECTIVE_TIMEOUT, AGREE_TIMEOUT = 5.0, 6.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ============================================================ launcher


def _child(
    fn: Callable[..., dict[str, Any]],
    rank: int,
    world: int,
    port: int,
    args: tuple[Any, ...],
    outdir: str,
) -> None:
    report: dict[str, Any]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        report = fn(rank, world, outdir, *args)
    except BaseException:
        report = {"unexpected": traceback.format_exc()}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # skip teardown: a world with a dead member cannot tear down together


def launch(
    fn: Callable[..., dict[str, Any]],
    world: int,
    outdir: str,
    args: tuple[Any, ...] = (),
    timeout: float = 600,
) -> dict[str, Any]:
    """Host the store here, run ``fn(rank, world, outdir, *args)`` on ``world`` forked workers.

    Returns the reports by rank, the exit codes, and the store's key count and
    this (store-host) process's RSS before and after.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys_before, rss_before = store.num_keys(), rss_kib()
    rank_args = [(fn, r, world, store.port, args, outdir) for r in range(world)]
    with Ranks(_child, rank_args, timeout) as ranks:  # forked from the warm server, as run_world's
        ranks.join()
    reports = {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(outdir).glob("rank*.json")}
    return {
        "reports": reports,
        "exitcodes": ranks.exitcodes,
        "store_keys": (keys_before, store.num_keys()),
        "store_rss_kib": (rss_before, rss_kib()),
    }


# ============================================================ residue and kept handles


def residue(mesh_shape: tuple[int, ...], cycles: int) -> dict[str, Any]:
    """Open a dp x tp mesh, use every axis, a one-member group and a sub-mesh, close; count keys.

    The store's key count is read after every cycle.
    """
    store = _c10d.default_store()
    keys: list[int] = []
    bad = 0
    for _ in range(cycles):
        with ProcessGroupMesh(*mesh_shape, names=NAMES, timeout=60) as mesh:
            with mesh.submesh("tp") as sub:
                bad += _summed(sub.get_group_along_axis("tp")) != mesh_shape[1]
            for axis, size in zip(NAMES, mesh_shape):
                bad += _summed(mesh.get_group_along_axis(axis)) != size
            single = mesh.get_group_along_axis("tp", indices_at_axis=[0])  # 1 member, or None
            bad += single is not None and _summed(single) != 1
        dist.barrier()  # the test's own sync: every rank finished the cycle
        keys.append(store.num_keys())
        dist.barrier()
    listed = store.list_keys() if hasattr(store, "list_keys") else None  # older torch: no list
    # Kept by design: generation counters and process records (one per rank; diagnosis.py).
    leftovers = [
        k
        for k in listed or ()
        if "scopedmesh-" in k and "/generation/" not in k and "scopedmesh-process/" not in k
    ]
    return {
        "keys": keys,
        "bad_sums": bad,
        "leftover_keys": None if listed is None else leftovers[:10],
    }


def kept_handles(mesh_shape: tuple[int, ...], cycles: int, kept_cycles: int) -> dict[str, Any]:
    """fds and threads per rank across closed scopes, with every tp handle dropped, then kept."""
    kept: list[dist.ProcessGroup] = []
    out: dict[str, Any] = {"closable": _closable.supported()}
    for keep in (False, True):
        dist.barrier()
        before, threads_before = open_fds(), os_threads()
        for _ in range(kept_cycles if keep else cycles):
            with ProcessGroupMesh(*mesh_shape, names=NAMES, timeout=60) as mesh:
                tp = mesh.get_group_along_axis("tp")
                assert tp is not None
                _summed(tp)
                if keep:
                    kept.append(tp)
                del tp  # the loop variable would keep the last handle alive
        dist.barrier()
        out["kept" if keep else "dropped"] = open_fds() - before
        out["threads_kept" if keep else "threads_dropped"] = os_threads() - threads_before
    # A kept handle after close: torch's own collective, then the group's method.
    for name, call in (
        ("all_reduce_after_close", lambda: _summed(kept[-1])),
        ("allreduce_method_after_close", lambda: kept[-1].allreduce([torch.ones(1)]).wait()),
    ):
        start = time.monotonic()
        try:
            out[name] = {"sum": call()}
        except Exception as error:
            seconds = time.monotonic() - start
            out[name] = {"type": type(error).__name__, "message": str(error), "seconds": seconds}
    dist.barrier()
    return out


def os_threads() -> int:
    """This process's threads, gloo's included (Python knows only its own)."""
    return len(os.listdir("/proc/self/task"))


def _summed(group: dist.ProcessGroup | None) -> int:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())


# ============================================================ training with a death


def batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica`` of ``replicas``' data at ``step``: the same in every run."""
    g = torch.Generator().manual_seed(1000003 * step + 1009 * replicas + replica)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    w_true = torch.arange(OUT * IN, dtype=torch.float64).reshape(OUT, IN) / (OUT * IN)
    return x, x @ w_true.T


def initial_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(OUT, IN, generator=g, dtype=torch.float64) * 0.1


def reference(steps: int, replicas_at: Callable[[int], int]) -> list[float]:
    """The loss curve of plain data parallelism on one process: the truth to match."""
    w = initial_weight()
    losses = []
    for step in range(steps):
        n = replicas_at(step)
        grad = torch.zeros_like(w)
        total = 0.0
        for replica in range(n):
            x, y = batch(step, replica, n)
            wr = w.clone().requires_grad_(True)
            loss = ((x @ wr.T - y) ** 2).mean()
            loss.backward()
            assert wr.grad is not None
            grad += wr.grad
            total += float(loss.detach())
        w -= LR * grad / n
        losses.append(total / n)
    return losses


def _train_step(mesh: ProcessGroupMesh, w_shard: torch.Tensor, step: int) -> float:
    """One dp x tp step: tp shards the input features, dp averages gradients and the loss."""
    tp, dp = mesh.get_group_along_axis("tp"), mesh.get_group_along_axis("dp")
    replicas, replica = mesh.size("dp"), mesh.coordinate("dp")
    width = IN // mesh.size("tp")
    lo = mesh.coordinate("tp") * width
    x, y = batch(step, replica, replicas)
    shard = w_shard.clone().requires_grad_(True)
    partial = x[:, lo : lo + width] @ shard.T
    full = partial.detach().clone()
    dist.all_reduce(full, group=tp)
    out = partial + (full - partial.detach())  # the tp sum, with the gradient of the partial
    loss = ((out - y) ** 2).mean()
    loss.backward()
    assert shard.grad is not None
    packed = torch.cat([shard.grad.flatten(), loss.detach().reshape(1)])
    dist.all_reduce(packed, group=dp)
    packed /= replicas
    w_shard -= LR * packed[:-1].reshape(w_shard.shape)
    return float(packed[-1])


def heal_world(
    rank: int,
    world: int,
    outdir: str,
    shape: tuple[int, int],
    victim: int,
    death_step: int,
    steps: int,
    residue_cycles: int,
    fd_cycles: int,
    kept_cycles: int = 10,
) -> dict[str, Any]:
    """Residue and kept-handle checks, then a dp x tp training loop in which ``victim`` dies."""
    report: dict[str, Any] = {"rank": rank}
    if residue_cycles:
        report["residue"] = residue(shape, residue_cycles)
    if fd_cycles:
        report["fds"] = kept_handles(shape, fd_cycles, kept_cycles)
    dist.barrier()
    mesh = ProcessGroupMesh(*shape, names=NAMES, timeout=COLLECTIVE_TIMEOUT)
    w_full = initial_weight()
    width = IN // shape[1]
    w_shard = w_full[:, mesh.coordinate("tp") * width : (mesh.coordinate("tp") + 1) * width].clone()
    losses: list[tuple[int, float]] = []
    step = 0
    with mesh:
        try:
            while step < steps:
                if rank == victim and step == death_step:
                    report["died_at"] = time.time()
                    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
                    os._exit(17)
                losses.append((step, _train_step(mesh, w_shard, step)))
                step += 1
        except RuntimeError as error:
            report["error"] = {
                "type": type(error).__name__,
                "message": str(error)[:300],
                "step": step,
            }
            report["error_at"] = time.time()
    report["old_mesh_closed"] = mesh.closed
    # Agree on the lost ranks in the store (the victim never checks in), then re-form.
    try:
        lost = agree_on_lost(range(world), rank, tag=f"step{step}", timeout=AGREE_TIMEOUT)
        report["lost"] = sorted(lost)
        healed = reform(mesh, lost, "dp")
    except LostRankError as error:
        report["sat_out"] = str(error)
        return report
    report["healed_shape"] = list(healed.shape)
    # Only whole rows of the tp axis drop out, so a survivor keeps its own shard.
    with healed:
        while step < steps:
            losses.append((step, _train_step(healed, w_shard, step)))
            if "first_healed_step_at" not in report:
                report["first_healed_step_at"] = time.time()
            step += 1
        report["healed_live"] = _c10d.live_group_count()
    report["live_after"] = _c10d.live_group_count()
    report["losses"] = losses
    return report
