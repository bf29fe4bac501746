"""A local replicated job: one small world per replica, restarted when one of its ranks dies.

:class:`ReplicaJob` hosts the job's store (the one :class:`~scopedmesh.fault.replicas.Replicas`
decides membership in, which outlives every replica) and, for each replica, a
world of ``local`` ranks with a store of its own, as one torchrun agent per
replica would (``--max-restarts``). When a rank of a replica ends without
reporting, its other ranks are killed and the replica starts again as a fresh
world; every rank calls ``fn(replica, coordinate, job_port, *args)`` and its
result is kept by (replica, coordinate). Each rank also gets the variables
``scopedmesh replicas`` gives its workers, so ``fn`` may call
:func:`~scopedmesh.launch.job_from_environment` instead of using ``job_port``. Ranks fork from the warm server of
:func:`~scopedmesh.testing.launcher.world_context`.

>>> ReplicaJob(print, replicas=0, local=2)
Traceback (most recent call last):
...
ValueError: replicas must be 1 to 64, got 0
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from scopedmesh.errors import JobMismatchError, NoLiveReplicaError, shown
from scopedmesh.launch.environment import worker_environment
from scopedmesh.layout.ints import is_int
from scopedmesh.testing.launcher import adopt_environment, host_store, join_world, world_context

__all__ = ["ReplicaJob"]

MAX_REPLICAS = 64


def _rank_main(
    fn: Callable[..., Any],
    replica: int,
    coordinate: int,
    local: int,
    world_port: int,
    job_port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    conn: Connection,
) -> None:
    """One rank of one incarnation of a replica: its world, ``fn``, its report."""
    try:
        adopt_environment(env)
        join_world(coordinate, local, world_port, "gloo", 60.0)
        result = fn(replica, coordinate, job_port, *args)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except (JobMismatchError, NoLiveReplicaError):  # a restart will not help: none
        conn.send_bytes(pickle.dumps(("final", traceback.format_exc())))
        os._exit(1)
    except Exception:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)  # a failed rank fails its replica, as under torchrun
    finally:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class ReplicaJob:
    """``replicas`` replicas of ``local`` ranks each, restarted up to ``max_restarts`` times
    in all, ``restart_delay`` seconds after a failure is seen. ``start()``, then ``poll()``
    often (it restarts dead replicas), ``kill()``
    a rank from outside, ``results`` once ``done``; ``stop()`` always (idempotent).

    A replica a rank of which raised an error a restart will not help
    (:class:`~scopedmesh.errors.JobMismatchError`: it does not match the job;
    :class:`~scopedmesh.errors.NoLiveReplicaError`: the job has nobody left to
    admit it) is not restarted: ``final`` holds its reports, by replica."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        replicas: int,
        local: int,
        args: tuple[Any, ...] = (),
        max_restarts: int = 10,
        restart_delay: float = 0.0,
    ) -> None:
        for name, value in (("replicas", replicas), ("local", local)):
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {shown(value)}")
            if not 1 <= value <= MAX_REPLICAS:
                raise ValueError(f"{name} must be 1 to {MAX_REPLICAS}, got {shown(value)}")
        self.fn, self.replicas, self.local, self.args = fn, replicas, local, args
        self.max_restarts, self.restart_delay = max_restarts, float(restart_delay)
        self._failed_at: dict[int, float] = {}  # replica -> when poll() saw it fail
        self.store: Any = None
        self.restarts: list[tuple[int, float]] = []  # (replica, time.time() it restarted)
        self.failures: list[str] = []  # what the ranks of a failed incarnation reported
        self.final: dict[int, list[str]] = {}  # replica -> its reports that stopped it for good
        self.results: dict[tuple[int, int], Any] = {}
        self._procs: dict[int, list[BaseProcess]] = {}
        self._pipes: dict[tuple[int, int], Connection] = {}
        self._worlds: dict[int, Any] = {}  # replica -> its world's store (kept alive)

    @property
    def port(self) -> int:
        """The job store's port."""
        port: int = self.store.port
        return port

    @property
    def done(self) -> bool:
        """Whether every rank of every replica reported a result."""
        return len(self.results) == self.replicas * self.local

    def start(self) -> None:
        """Host the job's store and start every replica."""
        self.store = host_store(60.0)
        for replica in range(self.replicas):
            self._start(replica)

    def pid(self, replica: int, coordinate: int) -> int | None:
        """The live process of a slot, or None."""
        procs = self._procs.get(replica, [])
        if coordinate < len(procs) and procs[coordinate].is_alive():
            return procs[coordinate].pid
        return None

    def kill(self, replica: int, coordinate: int) -> int | None:
        """SIGKILL a slot's process from outside; its pid, or None if it was not running."""
        pid = self.pid(replica, coordinate)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return pid

    def poll(self) -> None:
        """Collect reports; restart every replica one of whose ranks ended without one."""
        for replica, procs in list(self._procs.items()):
            failed = False
            for coordinate, proc in enumerate(procs):
                self._collect(replica, coordinate)
                if not proc.is_alive() and (replica, coordinate) not in self.results:
                    failed = True
            if failed and replica not in self.final:
                since = self._failed_at.setdefault(replica, time.monotonic())
                if time.monotonic() - since >= self.restart_delay:
                    del self._failed_at[replica]
                    self._restart(replica)

    def stop(self) -> None:
        """Kill every process still running and close the pipes."""
        for procs in self._procs.values():
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()

    def _start(self, replica: int) -> None:
        ctx = world_context("forkserver")
        world = host_store(60.0)
        self._worlds[replica] = world
        procs: list[BaseProcess] = []
        env = dict(os.environ)
        env.update(
            worker_environment(
                f"127.0.0.1:{self.port}", replica=replica, replicas=self.replicas, backend="gloo"
            )
        )
        for coordinate in range(self.local):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    self.fn, replica, coordinate, self.local, world.port, self.store.port,
                    self.args, env, writer,
                ),
                name=f"replica{replica}-rank{coordinate}",
                daemon=True,
            )  # fmt: skip
            proc.start()
            writer.close()
            self._pipes[(replica, coordinate)] = reader
            procs.append(proc)
        self._procs[replica] = procs

    def _collect(self, replica: int, coordinate: int) -> None:
        pipe = self._pipes.get((replica, coordinate))
        if pipe is None or pipe.closed:
            return
        try:
            if not pipe.poll():
                return
            kind, payload = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            pipe.close()
            return
        if kind == "ok":
            self.results[(replica, coordinate)] = payload
        elif kind == "final":
            report = f"replica {replica} coordinate {coordinate}:\n{payload}"
            self.final.setdefault(replica, []).append(report)
            self.failures.append(report)
        else:
            self.failures.append(f"replica {replica} coordinate {coordinate}:\n{payload}")

    def _restart(self, replica: int) -> None:
        if len(self.restarts) >= self.max_restarts:
            raise RuntimeError(
                f"replica {replica} failed after {self.max_restarts} restarts in all; "
                f"reports: {self.failures[-3:]}"
            )
        for coordinate, proc in enumerate(self._procs[replica]):
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            self.results.pop((replica, coordinate), None)
            pipe = self._pipes.pop((replica, coordinate), None)
            if pipe is not None:
                pipe.close()
        self.restarts.append((replica, time.time()))
        self._start(replica)
