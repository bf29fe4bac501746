"""What the heal benchmarks share: the model, the phases, the ranks' processes and reports, the load.

:mod:`benchmarks.heal_plan` (the watch's tests' world), :mod:`benchmarks.heal_random`
(a SIGKILL from outside) and :mod:`benchmarks.heal_torchft` (torchft side by side)
import from here; this module imports none of them.

The model (float64): two linear layers, ``w1`` (8 x 8) and ``w2`` (4 x 8); every
replica's batch at every step is the same in every run, so :func:`reference` (plain
data parallelism on one process) is the truth a healed run must match.

>>> losses = reference(2, lambda step: 2)
>>> len(losses), losses == reference(2, lambda step: 2)
(2, True)
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.testing.launcher import world_context

IN, HID, OUT, BATCH, LR = 8, 8, 4, 8, 0.05
# Seconds from the kill to each, for the latest survivor that trains on.
PHASES = ("detect", "abort", "agree", "re-form", "first step")


# ============================================================ the model


def batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica`` of ``replicas``' data at ``step``: the same in every run."""
    g = torch.Generator().manual_seed(1000003 * step + 1009 * replicas + replica)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    w_true = torch.arange(OUT * IN, dtype=torch.float64).reshape(OUT, IN) / (OUT * IN)
    return x, torch.tanh(x @ w_true.T)


def initial_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(HID, IN, generator=g, dtype=torch.float64) * 0.3
    w2 = torch.randn(OUT, HID, generator=g, dtype=torch.float64) * 0.3
    return w1, w2


def reference(steps: int, replicas_at: Callable[[int], int]) -> list[float]:
    """The loss curve of plain data parallelism on one process: the truth to match."""
    w1, w2 = initial_weights()
    losses = []
    for step in range(steps):
        n = replicas_at(step)
        g1, g2, total = torch.zeros_like(w1), torch.zeros_like(w2), 0.0
        for replica in range(n):
            x, y = batch(step, replica, n)
            a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
            loss = ((x @ a.T @ b.T - y) ** 2).mean()
            loss.backward()
            assert a.grad is not None and b.grad is not None
            g1 += a.grad
            g2 += b.grad
            total += float(loss.detach())
        w1 -= LR * g1 / n
        w2 -= LR * g2 / n
        losses.append(total / n)
    return losses


# ============================================================ a forked rank and its report


def report_and_exit(outdir: str, rank: int, run: Callable[[], dict[str, Any]]) -> None:
    """Write what ``run()`` returned (or its traceback) to ``rank<N>.json``, then exit at once.

    ``os._exit``: a world with a dead member cannot tear down together.
    """
    report: dict[str, Any]
    try:
        report = run()
    except BaseException:
        report = {"unexpected": traceback.format_exc()}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)


def child(
    fn: Callable[..., dict[str, Any]], rank: int, world: int, port: int, outdir: str, plan: Any
) -> None:
    """A forked rank: join the gloo world whose store the launcher hosts on ``port``, run
    ``fn(rank, world, outdir, plan)`` on one thread, report (:func:`report_and_exit`)."""

    def run() -> dict[str, Any]:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        torch.set_num_threads(1)
        return fn(rank, world, outdir, plan)

    report_and_exit(outdir, rank, run)


class Ranks:
    """A world's rank processes, started together under one deadline; on leaving the
    block whatever still runs is killed and reaped, so no run leaves a process behind.

    ``args[r]`` are rank ``r``'s arguments to ``target``; ``start_method`` as
    :func:`~scopedmesh.testing.launcher.world_context` takes it ("spawn" where a rank
    may touch CUDA).

    >>> with Ranks(time.sleep, [(0.0,), (0.0,)], timeout=30, start_method="spawn") as ranks:
    ...     ranks.join()
    >>> ranks.exitcodes
    {0: 0, 1: 0}
    """

    def __init__(
        self,
        target: Callable[..., object],
        args: Sequence[tuple[Any, ...]],
        timeout: float,
        start_method: str = "forkserver",
    ) -> None:
        ctx = world_context(start_method)
        self.procs: list[BaseProcess] = [ctx.Process(target=target, args=a) for a in args]
        self.timeout = timeout
        self.deadline = float("inf")

    def __enter__(self) -> Ranks:
        for p in self.procs:
            p.start()
        self.deadline = time.monotonic() + self.timeout
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    def left(self) -> float:
        """Seconds left before the deadline (0 once it passed)."""
        return max(0.0, self.deadline - time.monotonic())

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self, rank: int) -> None:
        """SIGKILL rank ``rank``, as a launcher does."""
        os.kill(self.procs[rank].pid or 0, signal.SIGKILL)

    def join(self) -> None:
        """Wait for every rank to end, until the deadline."""
        for p in self.procs:
            p.join(self.left())

    @property
    def exitcodes(self) -> dict[int, int | None]:
        return {r: p.exitcode for r, p in enumerate(self.procs)}


def rank_reports(outdir: str | Path) -> dict[int, Any]:
    """Each rank's report (``rank<N>.json`` in ``outdir``), by rank."""
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(outdir).glob("rank*.json")}


def _burn(stop: Any) -> None:
    """Spin until ``stop`` is set: one core's worth of load beside a run."""
    count = 0
    while not stop.is_set():
        for _ in range(100_000):
            count += 1


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """``count`` processes that keep a core busy each while the block runs (``--burn``:
    one per core, a run under load); all ended and reaped on leaving it.

    >>> with burners(0):
    ...     pass
    """
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    procs = [context.Process(target=_burn, args=(stop,), daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def load() -> str:
    """The machine's load average, 1 and 5 minutes (``load 3.2/2.9``): beside every figure."""
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}"


def summary(rows: list[list[float]]) -> str:
    """The heal line over ``rows`` (one list of :data:`PHASES` seconds per kill)."""
    totals = [row[-1] for row in rows]
    medians = [statistics.median(row[i] for row in rows) for i in range(len(PHASES))]
    return (
        f"median {statistics.median(totals):.2f} s, max {max(totals):.2f} s over "
        f"{len(rows)} kills (detect {medians[0]:.3f}, abort {medians[1]:.3f}, agree "
        f"{medians[2]:.3f}, re-form {medians[3]:.3f}, first step {medians[4]:.3f})"
    )
