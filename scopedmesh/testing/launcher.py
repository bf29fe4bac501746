"""Run a function on a small local ``torch.distributed`` world, one process per rank.

:func:`run_world` starts ``world_size`` processes over loopback, initialises a
process group in each, calls ``fn(rank, world_size, *args)`` and returns the
results indexed by rank. A rank that raises, dies or hangs becomes a
:class:`WorldError` in the parent; no child process outlives the call.

Ranks are forked from a warm server process (``start_method="forkserver"``, the
default): one clean interpreter, started on first use, that has imported torch,
``torch.distributed`` and scopedmesh and nothing else, and never starts a thread
or touches CUDA. Each rank is a fresh fork of it, so a world starts in a fraction
of a second instead of paying torch's import once per rank, and no rank sees
another world's process group, store or groups. ``start_method="spawn"`` starts
every rank as a new interpreter instead (slow, but nothing is shared at all).

>>> issubclass(WorldError, RuntimeError)
True
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar, cast

import torch.distributed as dist

from scopedmesh.c10d.checks import check_backend, check_timeout
from scopedmesh.errors import shown
from scopedmesh.launch.agents import free_port  # public here too: scopedmesh.testing.free_port
from scopedmesh.launch.store import host_job_store
from scopedmesh.layout.ints import is_int
from scopedmesh.testing.world import START_METHODS, WARM_MODULES

__all__ = ["START_METHODS", "WorldError", "free_port", "run_world", "world_context"]

T = TypeVar("T")

# How long to wait for a child to go after SIGTERM before SIGKILL, and after SIGKILL.
_TERM_WAIT = 2.0
_KILL_WAIT = 5.0
# A local world is one process per rank on this host: beyond this it is a mistake, not a test.
MAX_WORLD_SIZE = 1024


def world_context(start_method: str = "forkserver") -> ForkServerContext | SpawnContext:
    """The ``multiprocessing`` context that starts a world's ranks.

    ``"forkserver"``: ranks fork from one warm, single-threaded server that has
    imported :data:`WARM_MODULES` (started on first use, it lives as long as the
    calling process). ``"spawn"``: every rank is a new interpreter.

    >>> world_context("spawn").get_start_method()
    'spawn'
    >>> world_context("fork")
    Traceback (most recent call last):
    ...
    ValueError: start_method must be one of ('forkserver', 'spawn'), got 'fork'
    """
    if not isinstance(start_method, str):
        raise TypeError(f"start_method must be a str, got {type(start_method).__name__}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {shown(start_method)}")
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # Takes effect when the server starts; later calls leave a running server alone.
    ctx.set_forkserver_preload(list(WARM_MODULES))
    return ctx


class WorldError(RuntimeError):
    """One or more ranks of a :func:`run_world` world failed, died or timed out.

    ``failures`` maps each failing rank to its traceback text (or to a note of
    how its process ended); ``still_running`` lists the ranks that were still
    running when the world was torn down.

    >>> err = WorldError("rank 1 failed", {1: "ValueError: boom"})
    >>> err.failures
    {1: 'ValueError: boom'}
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[int, str] | None = None,
        still_running: Collection[int] = (),
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.still_running: list[int] = sorted(still_running)


def host_store(init_timeout: float) -> Any:
    """A world's store, hosted by the calling process on a free loopback port (``.port``).

    As torchrun's agent does: a rank that finishes first and exits must not take
    the store away from slower ranks, so no rank hosts it.
    """
    return host_job_store("127.0.0.1", 0, init_timeout)


def join_world(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    init_timeout: float,
    env: Mapping[str, str] | None = None,
) -> None:
    """In a rank's process: the launcher's environment, then the default group over ``port``.

    ``env`` is laid over the process's environment (a forked rank starts with
    the fork server's; :func:`adopt_environment` first gives it the caller's).
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.environ.update(env or {})
    limit = timedelta(seconds=init_timeout)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=limit)  # type: ignore[attr-defined]  # public; not in torch's stub exports
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit)


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    backend: str,
    init_timeout: float,
    caller_env: dict[str, str],
    env: dict[str, str],
    conn: Connection,
) -> None:
    """Body of one rank's process: init, run ``fn``, report, tear down."""
    try:
        try:
            adopt_environment(caller_env)
            join_world(rank, world_size, port, backend, init_timeout, env)
            result = fn(rank, world_size, *args)
        except Exception:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            return
        try:
            # Plain pickle, not multiprocessing's: torch would share a tensor's memory
            # with this process, which is gone by the time the parent reads it. It
            # pickles fully before writing, so a failure leaves the pipe clean.
            conn.send_bytes(pickle.dumps(("ok", result)))
        except Exception:
            report = "the result could not be sent:\n" + traceback.format_exc()
            conn.send_bytes(pickle.dumps(("error", report)))
    finally:
        conn.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def adopt_environment(env: Mapping[str, str]) -> None:
    """Make this process's environment ``env`` exactly, as a spawned child's would be."""
    os.environ.clear()
    os.environ.update(env)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "its process vanished"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"its process was killed by {name} (exit code {exitcode})"
    return f"its process exited with code {exitcode}"


def _check_grace(grace: object) -> float:
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        raise TypeError(f"grace must be a number of seconds, got {type(grace).__name__}")
    if not math.isfinite(grace) or grace < 0:
        raise ValueError(f"grace must be finite and >= 0, got {shown(grace)}")
    return float(grace)


def _validate(
    fn: object,
    world_size: object,
    args: object,
    backend: object,
    env: object,
    allow_exit: object,
) -> tuple[dict[str, str], frozenset[int]]:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not is_int(world_size):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size must be 1 to {MAX_WORLD_SIZE} (one local process per rank), "
            f"got {shown(world_size)}"
        )
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if backend is None:
        raise TypeError("backend must be a backend name such as 'gloo', got None")
    check_backend(backend, "backend")  # before any rank starts, not as a WorldError from each
    env_dict: dict[str, str] = {}
    if env is not None:
        if not isinstance(env, Mapping):
            raise TypeError(f"env must be a mapping of str to str, got {type(env).__name__}")
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"env must map str to str, got {shown(key)}: {shown(value)}")
            env_dict[key] = value
    if isinstance(allow_exit, (str, bytes)) or not isinstance(allow_exit, Collection):
        raise TypeError(f"allow_exit must be a collection of ranks, got {shown(allow_exit)}")
    allowed: set[int] = set()
    for r in allow_exit:
        if not is_int(r):
            raise TypeError(f"allow_exit must hold int ranks, got {shown(r)}")
        if not 0 <= r < world_size:
            raise ValueError(f"allow_exit rank {r} is outside 0..{world_size - 1}")
        allowed.add(r)
    for name, value in (("fn", fn), ("args", args)):
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"{name} must be picklable (fn a top-level function, args plain data): {exc}"
            ) from exc
    return env_dict, frozenset(allowed)


def _stop(procs: list[BaseProcess]) -> None:
    """Terminate, then kill, then reap every process in ``procs``."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _TERM_WAIT
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(_KILL_WAIT)


# Over 60 lines by its docstring alone (the launcher's whole contract); the body is 35.
def run_world(
    fn: Callable[..., T],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    init_timeout: float = 60.0,
    grace: float = 5.0,
    allow_exit: Collection[int] = (),
    start_method: str = "forkserver",
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    Each rank is a fresh process (forked from the warm server, or spawned: see
    :func:`world_context`) with the caller's environment, then ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``env`` set, and
    a default process group of ``backend`` initialised over 127.0.0.1. The calling process
    hosts the world's store (as torchrun's agent does), so a rank that finishes
    early and exits leaves the store to the others. ``fn`` must be a
    top-level (picklable) function, and its result picklable.

    If a rank raises, or its process ends without reporting, :class:`WorldError`
    names it (with the traceback text). The other ranks get ``grace`` seconds to
    finish, then are terminated. Ranks in ``allow_exit`` may end without
    reporting: their entry is ``None`` and the others are awaited. If the whole
    world takes longer than ``timeout`` seconds (spawning included), every rank is
    killed and :class:`WorldError` says which were still running.

    >>> run_world(my_top_level_fn, 2)  # doctest: +SKIP
    [result_of_rank_0, result_of_rank_1]
    >>> run_world(print, 0)
    Traceback (most recent call last):
    ...
    ValueError: world_size must be 1 to 1024 (one local process per rank), got 0
    """
    env_dict, allowed = _validate(fn, world_size, args, backend, env, allow_exit)
    timeout = check_timeout(timeout, "timeout").total_seconds()
    init_timeout = check_timeout(init_timeout, "init_timeout").total_seconds()
    grace = _check_grace(grace)

    ctx = world_context(start_method)
    caller_env = dict(os.environ)
    store = host_store(init_timeout)
    procs: list[BaseProcess] = []
    readers: dict[int, Connection] = {}
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        deadline = time.monotonic() + timeout
        for rank in range(world_size):
            child_args = (fn, rank, world_size, args, store.port, backend, init_timeout)
            procs.append(_start_rank(ctx, child_args, caller_env, env_dict, readers))
        pending = set(range(world_size))  # ranks that have neither reported nor ended
        _collect(pending, deadline, grace, procs, readers, results, failures, allowed)

        _raise_unless_complete(world_size, timeout, failures, pending)
        # Everyone reported: let them tear down their process groups and exit.
        exit_by = min(deadline, time.monotonic() + grace)
        for p in procs:
            p.join(max(0.0, exit_by - time.monotonic()))
        return [cast(T, results.get(rank)) for rank in range(world_size)]
    finally:
        _stop(procs)
        for reader in readers.values():
            reader.close()
        for p in procs:
            if not p.is_alive():
                p.close()


def _raise_unless_complete(
    world_size: int, timeout: float, failures: dict[int, str], pending: set[int]
) -> None:
    """:class:`WorldError` if a rank failed or, after ``timeout`` seconds, is still running."""
    if failures:
        raise WorldError(_failure_message(world_size, failures, pending), failures, pending)
    if pending:
        raise WorldError(
            f"world of {world_size} ranks timed out after {timeout:g} s; "
            f"ranks still running: {sorted(pending)}",
            failures,
            pending,
        )


def _start_rank(
    ctx: Any,
    child_args: tuple[Any, ...],
    caller_env: dict[str, str],
    env: dict[str, str],
    readers: dict[int, Connection],
) -> BaseProcess:
    """Start one rank's process; its pipe's read end goes into ``readers`` under its rank."""
    rank = child_args[1]
    reader, writer = ctx.Pipe(duplex=False)
    proc: BaseProcess = ctx.Process(
        target=_child_main,
        args=(*child_args, caller_env, env, writer),
        name=f"run_world-rank{rank}",
        daemon=True,
    )
    proc.start()
    writer.close()  # the parent keeps only the read end, so a dead child reads as EOF
    readers[rank] = reader
    return proc


def _collect(
    pending: set[int],
    deadline: float,
    grace: float,
    procs: Sequence[BaseProcess],
    readers: dict[int, Connection],
    results: dict[int, Any],
    failures: dict[int, str],
    allowed: frozenset[int],
) -> None:
    """Wait for the ``pending`` ranks to report or end, until ``deadline``, or ``grace``
    seconds after the first failure; those still running are left in ``pending``."""
    grace_end: float | None = None
    while pending:
        now = time.monotonic()
        stop_at = deadline if grace_end is None else min(deadline, grace_end)
        if now >= stop_at:
            break
        watched: list[Any] = [readers[r] for r in pending if not readers[r].closed]
        watched += [procs[r].sentinel for r in pending]
        wait(watched, timeout=stop_at - now)
        for rank in sorted(pending):
            ended = _poll_rank(rank, procs[rank], readers, results, failures, allowed)
            if ended:
                pending.discard(rank)
                if rank in failures and grace_end is None:
                    grace_end = time.monotonic() + grace


def _poll_rank(
    rank: int,
    proc: BaseProcess,
    readers: dict[int, Connection],
    results: dict[int, Any],
    failures: dict[int, str],
    allowed: frozenset[int],
) -> bool:
    """Collect what ``rank`` has to say; return True once it has reported or ended."""
    reader = readers.get(rank)
    if reader is not None and not reader.closed:
        try:
            if reader.poll():
                kind, payload = pickle.loads(reader.recv_bytes())
                if kind == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = str(payload)
                return True
        except (EOFError, OSError):
            reader.close()  # the child closed the pipe without reporting; its exit tells why
    if proc.is_alive():
        return False
    proc.join(_KILL_WAIT)
    if rank in allowed:
        results[rank] = None
    else:
        failures[rank] = (
            f"rank {rank} ended without reporting a result: {_describe_exit(proc.exitcode)}"
        )
    return True


def _failure_message(world_size: int, failures: Mapping[int, str], running: Collection[int]) -> str:
    ranks = sorted(failures)
    head = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    lines = [f"{head} of a world of {world_size} failed"]
    if running:
        lines[0] += f"; ranks {sorted(running)} were still running and were terminated"
    for rank in ranks:
        lines.append(f"--- rank {rank} ---")
        lines.append(failures[rank].rstrip())
    return "\n".join(lines)
