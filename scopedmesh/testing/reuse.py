"""A local world that stays up between tests: :class:`ReusedWorld`.

The pytest plugin keeps one per test module when a test asks for
``@pytest.mark.world(N, reuse=True)``, so the ranks start and meet (the
rendezvous) once. Each rank serves tests one at a time. A test that fails on any
rank, hangs past its timeout, or destroys the default group ends the world (all
its processes are stopped); the next test starts a new one. ``close()`` sends
every rank a stop message, then terminates whatever is still alive.

>>> world = ReusedWorld(2)
>>> world.alive, world.pids
(False, [])
>>> world.close()  # idempotent; nothing was started
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["ReusedWorld"]

GRACE = 5.0  # seconds the other ranks get to report once one rank has failed
STOP_WAIT = 5.0  # seconds ranks get to leave after the stop message


def _serve(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    init_timeout: float,
    caller_env: dict[str, str],
    conn: Connection,
) -> None:
    """Body of one rank: init once, then run each task the parent sends until ``None``."""
    import torch.distributed as dist

    from scopedmesh.testing.launcher import adopt_environment, join_world

    try:
        try:
            adopt_environment(caller_env)
            join_world(rank, world_size, port, backend, init_timeout)
        except Exception:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            return
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the parent has gone
                return
            if message is None:
                return
            fn, args = message
            try:
                fn(rank, world_size, *args)
            except Exception:
                conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
                return  # a failed test may leave peers mid-collective: this world ends
            conn.send_bytes(pickle.dumps(("ok", dist.is_initialized())))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _joined(rank: int, world_size: int) -> None:
    """A task that does nothing: every rank answering it has joined the world."""


class ReusedWorld:
    """``size`` local ranks over loopback that run one test after another.

    :meth:`run` starts the ranks if needed, runs ``fn(rank, world_size, *args)``
    on each and raises :class:`~scopedmesh.testing.WorldError` as ``run_world``
    does; after any failure the world is closed.
    """

    def __init__(self, size: int, backend: str = "gloo", start_method: str = "forkserver") -> None:
        self.size = size
        self.backend = backend
        self.start_method = start_method
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: Any = None

    @property
    def alive(self) -> bool:
        """True while the ranks are up and have not failed."""
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (empty when not started)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self, init_timeout: float) -> None:
        """Start the ranks now, if they are not up, and wait until each has joined."""
        if not self.alive:
            self._start(init_timeout)
            self.run(_joined, (), init_timeout)

    def _start(self, init_timeout: float) -> None:
        from scopedmesh.testing.launcher import host_store, world_context

        ctx = world_context(self.start_method)
        caller_env = dict(os.environ)
        self._store = host_store(init_timeout)  # outlives every rank, as in run_world
        port = self._store.port
        for rank in range(self.size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_serve,
                args=(rank, self.size, port, self.backend, init_timeout, caller_env, child),
                name=f"reused_world-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float,
        grace: float = GRACE,
    ) -> None:
        """Run ``fn(rank, world_size, *args)`` on every rank within ``timeout`` seconds.

        Once a rank has failed, the others get ``grace`` seconds to report.
        """
        from scopedmesh.testing.launcher import WorldError, _collect, _failure_message

        deadline = time.monotonic() + timeout
        if not self.alive:
            self._start(timeout)
        message = pickle.dumps((fn, args))
        failures: dict[int, str] = {}
        pending = set(range(self.size))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass  # the rank is gone; its end of the pipe tells why below
        results: dict[int, Any] = {}  # rank -> whether it ended its test cleanly
        readers = dict(enumerate(self._conns))
        _collect(pending, deadline, grace, self._procs, readers, results, failures, frozenset())
        broken = not all(results.values())
        if failures or pending or broken:
            self.close()
        if failures:
            raise WorldError(_failure_message(self.size, failures, pending), failures, pending)
        if pending:
            raise WorldError(
                f"world of {self.size} ranks timed out after {timeout:g} s; "
                f"ranks still running: {sorted(pending)}",
                failures,
                pending,
            )

    def close(self) -> None:
        """Stop every rank: a stop message, then terminate and kill. Idempotent."""
        from scopedmesh.testing.launcher import _stop

        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + STOP_WAIT
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        _stop(self._procs)
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            if not proc.is_alive():
                proc.close()
        self._procs, self._conns, self._store = [], [], None
