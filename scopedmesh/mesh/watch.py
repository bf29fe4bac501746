"""Liveness from open sockets: every rank learns of a death in milliseconds, and the mesh stops.

The rule: **a rank is alive while its process holds its sockets open.** A
SIGKILLed process's sockets are closed by the kernel at once, so a peer holding
a TCP connection to it reads end-of-file within milliseconds. A rank that is
stopped (SIGSTOP), descheduled or in a long computation keeps its sockets open:
it is never declared lost, however long it takes. No heartbeat, no deadline.
A host that vanishes without closing anything (a partition) is found by the
kernel: the ring connections probe the peer's host (TCP keepalive), and a
host that answers none for :data:`UNREACHABLE_AFTER` seconds is declared lost
as unreachable (:meth:`LivenessWatch.why_lost` tells which).

A :class:`LivenessWatch` is opt-in and held by the caller; while it runs, each
process has one more thread (none before, none after). Each member listens on
a socket, publishes its address in torch's store, and connects to its
successor among the members still alive (a ring). End-of-file from a peer that
sent no goodbye declares it lost in the store (``<prefix>/lost/<rank>``, the
list ``<prefix>/lost`` and an ``add`` on the counter ``<prefix>/deaths``); the
watcher then links to the next alive member, so a second death is seen too.
Every watch polls the counter: **one store request per rank per** ``interval``
(50 a second per rank at the default 20 ms). On learning of a death it aborts
the guarded meshes that hold the dead rank: their gloo groups shut down, so a
rank blocked in a collective with healthy peers raises at once instead of
waiting for the collective's timeout (see :meth:`ClosableGroup.interrupt
<scopedmesh.c10d.closable.ClosableGroup.interrupt>`).

:meth:`LivenessWatch.agree` settles the lost set, bounded by liveness: it
completes once every member has checked in or been declared lost, and the
first decision written (``compare_set``) is the one every survivor reads.

>>> LivenessWatch(interval=0)
Traceback (most recent call last):
    ...
ValueError: interval must be a positive number of seconds (at most 60), got 0
"""

from __future__ import annotations

import contextlib
import errno
import math
import selectors
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.checks import check_timeout
from scopedmesh.errors import LostRankError, shown
from scopedmesh.layout import Axis
from scopedmesh.layout.ints import is_int
from scopedmesh.mesh.heal import _check_tag, _sorted_ranks, reform
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["LivenessWatch"]

MAX_INTERVAL = 60.0  # seconds: an interval longer than this is a mistake, not a choice
ROOT = "scopedmesh-watch"  # every key a watch writes starts with this


def _check_interval(interval: object) -> float:
    """``interval`` as positive finite seconds (at most :data:`MAX_INTERVAL`), or an error."""
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise TypeError(f"interval must be a number of seconds, got {shown(interval)}")
    seconds = float(interval) if abs(interval) < 1e300 else math.inf
    if not (0 < seconds <= MAX_INTERVAL):  # NaN fails this too
        raise ValueError(
            f"interval must be a positive number of seconds (at most {MAX_INTERVAL:g}), "
            f"got {shown(interval)}"
        )
    return seconds


def _route_address() -> str:
    """This host's address on the route to ``MASTER_ADDR`` (127.0.0.1 without one); no traffic."""
    import os

    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # UDP connect picks a route, sends nothing
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return "127.0.0.1"


def _time_left(deadline: float) -> timedelta:
    """What is left until ``deadline`` (``time.monotonic()``), at least a millisecond."""
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


_ABSENT = "\x00absent"  # no key holds this value: compare_set answers it for a missing key


def _peek(store: Any, key: str) -> str | None:
    """``key``'s value, or None if it is missing; never waits (``get`` waits for the key)."""
    value: str = store.compare_set(key, _ABSENT, _ABSENT).decode()
    return None if value == _ABSENT else value


KEEPALIVE_IDLE = 1  # seconds a ring connection is quiet before the kernel probes the peer's host
KEEPALIVE_PROBES = 2  # unanswered probes, one a second, before the connection fails
UNREACHABLE_AFTER = KEEPALIVE_IDLE + KEEPALIVE_PROBES  # seconds: a host silent this long is lost


def _keep_alive(sock: socket.socket) -> socket.socket:
    """Have the kernel probe ``sock``'s peer host: a silent host fails it in about 3 s.

    The peer's kernel answers the probes, so a stopped or busy process stays
    alive; only a host that vanished from the network (a partition, a power
    cut) stops answering.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock


CONNECT_SLICE = 0.5  # seconds a ring connection attempt waits before the store is read again
CLOSED = "closed"  # why a rank is lost: its connection closed without a goodbye
UNREACHABLE = "unreachable"  # why a rank is lost: its host stopped answering


def _reason(error: OSError) -> str:
    """Why a connection failed: UNREACHABLE for silence (keepalive, connect), else CLOSED."""
    silent = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)
    return UNREACHABLE if isinstance(error, TimeoutError) or error.errno in silent else CLOSED


def _deaths(text: str) -> dict[int, str]:
    """The store's list of deaths (``"3:closed,5:unreachable,"``) as rank -> reason."""
    entries = (item.partition(":") for item in text.split(",") if item)
    return {int(rank): reason for rank, _, reason in entries}


def _check_members(ranks: Iterable[int] | None, host: object, store: object) -> list[int]:
    """The watch's members (sorted global ranks, this one among them), or an error naming
    the bad argument (``host`` and ``store`` are checked here too)."""
    if host is not None and (not isinstance(host, str) or not host):
        raise TypeError(f"host must be a non-empty str or None, got {shown(host)}")
    if store is not None and not isinstance(store, dist.Store):  # type: ignore[attr-defined]
        raise TypeError(f"store must be a torch.distributed Store or None, got {shown(store)}")
    world = dist.get_world_size()
    members = list(range(world)) if ranks is None else _sorted_ranks(ranks)
    if not members:
        raise ValueError("ranks must hold at least one rank")
    if members[-1] >= world:
        raise ValueError(f"ranks must be ranks of WORLD (0..{world - 1}), got {members[-1]}")
    rank = dist.get_rank()
    if rank not in members:
        raise ValueError(f"this rank ({rank}) must be one of ranks {shown(members)}")
    return members


def key_names(prefix: str, ranks: Iterable[int], tags: Iterable[str]) -> list[str]:
    """Every key the watches under ``prefix`` over ``ranks`` can leave, given their agreement
    ``tags`` (empty ones are skipped); the per-rank counters of watches are not among them.

    >>> key_names("scopedmesh-watch/1", [0], ["t"])  # doctest: +NORMALIZE_WHITESPACE
    ['scopedmesh-watch/1/closed', 'scopedmesh-watch/1/deaths', 'scopedmesh-watch/1/lost',
     'scopedmesh-watch/1/tags', 'scopedmesh-watch/1/agree/t/decision',
     'scopedmesh-watch/1/agree/t/accounted', 'scopedmesh-watch/1/addr/0',
     'scopedmesh-watch/1/lost/0', 'scopedmesh-watch/1/agree/t/alive/0',
     'scopedmesh-watch/1/agree/t/in/0']
    """
    tags = [tag for tag in tags if tag]
    keys = [f"{prefix}/{name}" for name in ("closed", "deaths", "lost", "tags")]
    for tag in tags:
        keys += [f"{prefix}/agree/{tag}/{name}" for name in ("decision", "accounted")]
    for rank in ranks:
        keys += [f"{prefix}/addr/{rank}", f"{prefix}/lost/{rank}"]
        keys += [f"{prefix}/agree/{tag}/{kind}/{rank}" for tag in tags for kind in ("alive", "in")]
    return keys


class LivenessWatch:
    """Which members are alive, learned from their open sockets; aborts the meshes it guards.

    ``ranks`` are the members (global ranks; all of WORLD by default); every
    member makes its watches in the same order. ``interval`` is how often the
    store's death counter is read (one request per rank per interval), and how
    often :meth:`agree` looks at the store. ``timeout`` bounds every wait (the
    successor's address at start, an agreement): a long safety net, not a
    liveness rule. ``host`` is the address this rank listens on (default: the
    one on the route to ``MASTER_ADDR``). ``store`` defaults to torch's default
    store; the watch talks to it over connections of its own (``clone``).

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> with LivenessWatch(interval=0.05) as watch:
    ...     watch.lost(), watch.is_alive(0)
    (frozenset(), True)
    >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        ranks: Iterable[int] | None = None,
        *,
        interval: float = 0.02,
        timeout: timedelta | float = 60.0,
        host: str | None = None,
        store: Any = None,
    ) -> None:
        self._closed = True  # until the thread runs: close() has nothing to stop
        self._interval = _check_interval(interval)
        self._timeout = check_timeout(timeout)
        members = _check_members(ranks, host, store)
        self.rank = dist.get_rank()
        self.ranks: tuple[int, ...] = tuple(members)
        base: Any = store if store is not None else _c10d.default_store()
        self._store: Any = base.clone()  # the caller's thread
        self._thread_store: Any = base.clone()  # the watch thread's: never behind a caller's wait
        self._store.set_timeout(self._timeout)
        self._thread_store.set_timeout(self._timeout)
        self.prefix = f"{ROOT}/{self._store.add(f'{ROOT}/count/{self.rank}', 1)}"
        self._lost: frozenset[int] = frozenset()
        self._why: dict[int, str] = {}  # rank -> CLOSED or UNREACHABLE, as its watcher saw it
        self._learned: dict[int, float] = {}  # rank -> time.time() this process learned it died
        self._aborted: dict[int, float] = {}  # rank -> time.time() guarded meshes were aborted
        self._meshes: tuple[ProcessGroupMesh, ...] = ()
        self._events = 0
        self._failure: tuple[str, BaseException] | None = None  # (what happened, the error)
        self._warned = False  # whether guard() has checked that groups are closable
        self._stopped = False  # whether the thread ended other than by close()
        self._relink_due: float | None = None  # since when a relink waits for the store
        self._listener = socket.create_server((host or _route_address(), 0), backlog=len(members))
        self._wake_r, self._wake_w = socket.socketpair()
        self._peers: dict[socket.socket, list[Any]] = {}  # socket -> [rank or None, buffer]
        self._succ: tuple[int, socket.socket] | None = None
        self._left: set[int] = set()
        try:
            self._join_ring()
        except BaseException:
            self._shut_sockets(goodbye=False)
            with contextlib.suppress(Exception):
                self._store.delete_key(self._key("addr", self.rank))
            raise
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"scopedmesh-liveness-{self.rank}", daemon=True
        )
        self._thread.start()

    def _join_ring(self) -> None:
        """Publish this rank's address, then link to its successor once it has published."""
        address = "{}:{}".format(*self._listener.getsockname()[:2])
        self._store.set(self._key("addr", self.rank), address)
        successor = self._next_after(self.rank)
        if successor is None:
            return
        try:
            self._store.wait([self._key("addr", successor)], self._timeout)
        except Exception as error:
            raise TimeoutError(
                f"liveness watch: rank {successor} (this rank's successor) published no "
                f"address within {self._timeout.total_seconds():g} s; start a LivenessWatch "
                f"on every rank of {list(self.ranks)}, in the same order"
            ) from error
        self._link(successor)

    # ------------------------------------------------------------------ queries

    def lost(self) -> frozenset[int]:
        """The members this process has learned are dead (never shrinks).

        Raises ``RuntimeError`` naming what happened if the watch's thread failed.
        """
        self._check_thread()
        return self._lost

    def is_alive(self, rank: int) -> bool:
        """Whether ``rank`` (a member) is alive: its sockets are open, as far as known.

        A slow, stopped or busy rank is alive. This is the one notion of alive
        the library has; code that must tell a dead peer from a slow one asks here.
        """
        if not is_int(rank):
            raise TypeError(f"rank must be an int rank, got {shown(rank)}")
        if rank not in self.ranks:
            raise ValueError(
                f"rank must be one of this watch's ranks {list(self.ranks)}, got {rank}"
            )
        self._check_thread()
        return rank not in self._lost

    def why_lost(self, rank: int) -> str | None:
        """How ``rank`` was lost, as a predicate (``"has died (...)"``); None while it is alive.

        The diagnosis of a group that cannot form says ``rank 3 <this>``.
        """
        reason = self._why.get(rank) if rank in self._lost else None
        if reason is None:
            return None
        if reason == UNREACHABLE:
            return (
                f"is unreachable (its host answered no keepalive probe of the liveness watch "
                f"for {UNREACHABLE_AFTER} s: a network partition, or the host is down)"
            )
        return "has died (its liveness watch connection closed without a goodbye)"

    def learned_at(self, rank: int) -> float | None:
        """``time.time()`` when this process learned that ``rank`` died, or None."""
        return self._learned.get(rank)

    def aborted_at(self, rank: int) -> float | None:
        """``time.time()`` when the guarded meshes holding ``rank`` were aborted here, or None."""
        return self._aborted.get(rank)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the thread is gone, the sockets are closed)."""
        return self._closed

    # ------------------------------------------------------------------ guarding

    def guard(self, mesh: ProcessGroupMesh) -> ProcessGroupMesh:
        """Abort ``mesh`` (its gloo groups, its sub-meshes' too) when one of its ranks dies.

        Returns ``mesh``. Collectives in flight on it then raise (their peers'
        connections close); later ones raise ``MeshClosedError``; close the
        mesh as usual (``reform`` does). A mesh that holds a rank already
        known lost is aborted at once. While the watch runs, the mesh's group
        formations ask it which peers are lost: one waiting for a lost rank
        raises ``GroupFormationError`` saying so, on any host.
        """
        if not isinstance(mesh, ProcessGroupMesh):
            raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
        self._check_open()
        self._check_thread()
        self._warn_if_not_closable()
        self._meshes = (*[m for m in self._meshes if not m.closed], mesh)
        mesh._table.liveness = self
        self._track()
        dead = self._lost.intersection(mesh.layout.ranks)
        if dead:
            self._abort(mesh, dead)
        return mesh

    # ------------------------------------------------------------------ agreement

    def agree(
        self,
        mesh: ProcessGroupMesh | None = None,
        *,
        tag: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> frozenset[int]:
        """The lost ranks among ``mesh``'s ranks (default: the watch's), the same on every survivor.

        Each survivor checks in (``<prefix>/agree/<tag>/alive/<rank>``); once every
        rank is accounted for, checked in or declared lost by its watcher, a
        survivor writes the lost set with ``compare_set`` and every survivor
        returns the first one written. A slow rank is waited for, never
        declared lost; a rank that dies meanwhile is declared and counted. If a
        rank that checked in dies after the decision, its death aborts the
        re-formed mesh and the survivors agree again (a new ``tag``), never on
        two answers. ``tag`` defaults to this watch's count of agreements (the
        same on every survivor that took part in all of them). A rank the
        decision counts as lost gets :class:`LostRankError`. Waits at most
        ``timeout`` (default: the watch's), then raises ``TimeoutError`` naming
        the ranks still unaccounted for.
        """
        self._check_open()
        self._check_thread()
        if mesh is not None and not isinstance(mesh, ProcessGroupMesh):
            raise TypeError(f"mesh must be a ProcessGroupMesh or None, got {shown(mesh)}")
        limit = self._timeout if timeout is None else check_timeout(timeout)
        if tag is None:
            tag = f"event{self._events}"
        _check_tag(tag)
        members = self._members_of(mesh)
        self._events += 1
        self._store.append(f"{self.prefix}/tags", tag + "\n")
        agreement = Agreement(self._store, f"{self.prefix}/agree/{tag}", members, self.rank)
        agreement.check_in()
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            self._check_thread()
            decision = agreement.poll(self._lost, self._read_deaths)
            if decision is not None:
                break
            if time.monotonic() >= deadline:
                missing = agreement.missing(self._lost)
                raise TimeoutError(
                    f"agreement {tag!r}: ranks {missing} neither checked in nor were declared "
                    f"lost within {limit.total_seconds():g} s; they are alive (their sockets "
                    "are open): every survivor must call agree with the same tag"
                )
            time.sleep(self._interval)
        if self.rank in decision:
            raise LostRankError(
                f"rank {self.rank} was declared lost (lost ranks {sorted(decision)}): its "
                "connections closed; it must not join the re-formed mesh"
            )
        return decision

    def _members_of(self, mesh: ProcessGroupMesh | None) -> list[int]:
        """The ranks an agreement over ``mesh`` (None: the watch's) settles, or an error."""
        members = sorted(mesh.layout.ranks) if mesh is not None else list(self.ranks)
        if self.rank not in members:
            raise ValueError(f"this rank ({self.rank}) is not one of the mesh's ranks {members}")
        unwatched = sorted(set(members).difference(self.ranks))
        if unwatched:
            raise ValueError(
                f"mesh holds ranks {unwatched} that this watch does not watch {list(self.ranks)}"
            )
        return members

    def _read_deaths(self) -> frozenset[int]:
        """Every death the store lists, learned here (one ``get``); the lost set after."""
        text = _peek(self._store, f"{self.prefix}/lost") or ""
        self._learn(_deaths(text))
        return self._lost

    def heal(
        self, mesh: ProcessGroupMesh, axis: Axis, *, tag: str | None = None
    ) -> ProcessGroupMesh:
        """Agree on the lost ranks of ``mesh``, re-form it along ``axis`` and guard the result.

        ``reform(mesh, self.agree(mesh, tag=tag), axis)``, then :meth:`guard`.
        A rank that loses its place gets :class:`LostRankError` (``mesh`` is closed).
        """
        lost = self.agree(mesh, tag=tag)
        return self.guard(reform(mesh, lost, axis))

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> LivenessWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close; a failure to close after an exception is a warning, never a replacement."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:
            warnings.warn(
                f"closing {self!r} after {type(exc).__name__} also failed: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        """Stop: say goodbye to the peers, join the thread, close the sockets; idempotent.

        The last member to close deletes the watch's keys (a per-rank counter
        of watches, ``<root>/count/<rank>``, stays, as group generations do).
        Takes at most the watch's ``timeout`` in all, even when the store's host
        is gone: each store request is given what is left of it, and the
        clean-up is skipped (with its error raised) once it has run out.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._timeout.total_seconds()
        store = self._store
        with contextlib.suppress(Exception):
            store.set_timeout(_time_left(deadline))
            store.delete_key(self._key("addr", self.rank))  # a late connector sees "left"
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(_time_left(deadline).total_seconds())
        for mesh in self._meshes:
            if mesh._table.liveness is self:
                mesh._table.liveness = None
        self._meshes = ()
        try:
            store.set_timeout(_time_left(deadline))
            self._clean_up()
        finally:
            self._store = self._thread_store = None  # closes both connections

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<LivenessWatch rank {self.rank} of {list(self.ranks)}, {state}, lost {sorted(self._lost)}>"

    # ------------------------------------------------------------------ internals

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; make a new LivenessWatch")

    def _next_after(self, rank: int) -> int | None:
        """The member after ``rank`` in ring order that is not known dead or gone, or None."""
        order = self.ranks
        start = order.index(rank)
        for step in range(1, len(order)):
            candidate = order[(start + step) % len(order)]
            if candidate == self.rank:
                return None
            if candidate not in self._lost and candidate not in self._left:
                return candidate
        return None

    def _link(self, rank: int) -> None:
        """Connect to ``rank``'s listener and say who we are (raises OSError if refused)."""
        host, port = self._store.get(self._key("addr", rank)).decode().rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=self._timeout.total_seconds())
        _keep_alive(conn).sendall(f"H{self.rank}\n".encode())
        self._succ = (rank, conn)

    def _relink(self) -> None:
        """Watch the next alive member after this one (thread only).

        A store error on the way is survived: the link is tried again every
        interval, and reported (:meth:`_check_thread`) once it has failed for
        the watch's ``timeout``.
        """
        if self._succ is not None:
            self._succ[1].close()
        self._succ = None
        first = self._relink_due if self._relink_due is not None else time.monotonic()
        try:
            self._link_next()
            self._relink_due = None
        except OSError:
            raise
        except Exception as error:  # the store: try again next interval
            self._relink_due = first
            if time.monotonic() - first >= self._timeout.total_seconds():
                self._failure = ("could not relink the ring, the store failing", error)

    def _link_next(self) -> None:
        candidate = self._next_after(self.rank)
        while candidate is not None:
            address = _peek(self._thread_store, self._key("addr", candidate))
            if address is None:
                self._left.add(candidate)  # closed its watch cleanly
            else:
                conn = None
                try:
                    conn = self._connect(candidate, address)
                    if conn is not None:
                        conn.sendall(f"H{self.rank}\n".encode())
                        self._succ, conn = (candidate, conn), None
                        return
                except OSError as error:  # refused (nobody listens there), or no answer
                    if self._thread_store.check([self._key("addr", candidate)]):
                        self._declare(candidate, _reason(error))
                    else:
                        self._left.add(candidate)
                finally:
                    if conn is not None:
                        conn.close()
            candidate = self._next_after(self.rank)

    def _connect(self, rank: int, address: str) -> socket.socket | None:
        """A ring connection to ``rank`` at ``address`` (``host:port``); None once it is lost.

        A silent host is retried in slices of :data:`CONNECT_SLICE` seconds,
        learning the store's deaths in between, so that the thread is never
        blind to them for long; the last error is raised after
        :data:`UNREACHABLE_AFTER` seconds of silence.
        """
        host, port = address.rsplit(":", 1)
        give_up = time.monotonic() + UNREACHABLE_AFTER
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=CONNECT_SLICE)
                return _keep_alive(conn)
            except TimeoutError:
                if time.monotonic() >= give_up:
                    raise
            self._learn(_deaths(_peek(self._thread_store, f"{self.prefix}/lost") or ""))
            if rank in self._lost:
                return None

    def _declare(self, rank: int, reason: str) -> None:
        """Write ``rank``'s death and ``reason`` to the store (once, whoever sees it first),
        so that the others learn it first; then learn it here, even if the store failed."""
        store, me = self._thread_store, f"{self.rank}:{reason}"
        try:
            if store.compare_set(self._key("lost", rank), "", me).decode() == me:
                store.append(f"{self.prefix}/lost", f"{rank}:{reason},")
                store.add(f"{self.prefix}/deaths", 1)
        finally:
            self._learn({rank: reason})

    def _learn(self, dead: dict[int, str]) -> None:
        """Learn the deaths in ``dead`` (rank -> reason); abort the guarded meshes they hit."""
        new = set(dead).difference(self._lost)
        if not new:
            return
        now = time.time()
        for rank in new:
            self._learned[rank] = now
            self._why[rank] = dead[rank]
        self._lost = self._lost | new
        for mesh in self._meshes:
            hit = new.intersection(mesh.layout.ranks)
            if hit and not mesh.closed:
                self._abort(mesh, hit)

    def _abort(self, mesh: ProcessGroupMesh, dead: Iterable[int]) -> None:
        dead = sorted(dead)
        mesh._table.abort(f"when the liveness watch learned that rank(s) {dead} died")
        now = time.time()
        for rank in dead:
            self._aborted.setdefault(rank, now)

    def _track(self) -> None:
        """Track the guarded groups' work; close the aborted ones whose collective has ended."""
        closable = sys.modules.get("scopedmesh.c10d.closable")
        if closable is None:
            return
        for mesh in self._meshes:
            if not mesh.closed:
                for group in mesh._table.groups():
                    if isinstance(group, closable.ClosableGroup):
                        group.settle()  # a held group left open would stall its peers

    def _run(self) -> None:
        """The thread: read the ring's sockets, poll the store; any failure is recorded
        for the next query (:meth:`_check_thread`), never dropped."""
        try:
            with selectors.DefaultSelector() as selector:  # epoll: any number of fds
                self._loop(selector)
        except BaseException as error:  # the thread ends: say so in the next query
            self._failure = ("stopped", error)
            self._stopped = True
        finally:
            self._shut_sockets(goodbye=True)

    def _loop(self, selector: selectors.BaseSelector) -> None:
        seen = 0
        next_poll = time.monotonic()
        while True:
            wait = max(0.0, next_poll - time.monotonic())
            readable = self._select(selector, wait)
            if self._wake_r in readable:
                return
            try:
                for sock in readable:
                    self._on_readable(sock)
                if time.monotonic() < next_poll:
                    continue
                next_poll = time.monotonic() + self._interval
                self._track()
                if self._relink_due is not None:
                    self._relink()
                count = self._thread_store.add(f"{self.prefix}/deaths", 0)
                if count != seen:
                    seen = count
                    text = self._thread_store.get(f"{self.prefix}/lost").decode()
                    self._learn(_deaths(text))
                    if self._succ is not None and self._succ[0] in self._lost:
                        self._relink()
            except Exception as error:  # keep watching (the store may come back); say so
                self._failure = ("failed while watching (it goes on)", error)
                time.sleep(self._interval)

    def _select(self, selector: selectors.BaseSelector, wait: float) -> list[Any]:
        """The sockets readable within ``wait`` seconds, the selector kept to the live set."""
        watched: set[Any] = {self._listener, self._wake_r, *self._peers}
        if self._succ is not None:
            watched.add(self._succ[1])
        for key in list(selector.get_map().values()):
            if key.fileobj not in watched:
                selector.unregister(key.fileobj)  # closed ones too: found by object
        registered = {key.fileobj for key in selector.get_map().values()}
        for sock in watched.difference(registered):
            selector.register(sock, selectors.EVENT_READ)
        return [key.fileobj for key, _ in selector.select(wait)]

    def _warn_if_not_closable(self) -> None:
        """Once per watch, on a torch that cannot make closable gloo groups: say what is lost."""
        if self._warned:
            return
        self._warned = True
        from scopedmesh.c10d import closable  # registers the backend, as a gloo group would

        if not closable.supported():
            warnings.warn(
                f"LivenessWatch.guard: torch {torch.__version__} cannot make closable gloo "
                "groups, so the watch cannot abort a collective in flight: when a rank dies, "
                "a rank blocked in a collective with healthy peers waits for that "
                "collective's timeout before it raises (deaths are still learned, agreed on "
                "and healed; give guarded meshes a short timeout)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _check_thread(self) -> None:
        """Raise what broke the watch's thread, naming it: always once it has stopped,
        once per failure while it goes on."""
        failure = self._failure
        if failure is None or self._closed:
            return
        if not self._stopped:
            self._failure = None
        what, error = failure
        raise RuntimeError(
            f"the liveness watch of rank {self.rank}: its thread {what}: "
            f"{type(error).__name__}: {error}; deaths may have gone unseen"
        ) from error

    def _on_readable(self, sock: socket.socket) -> None:
        if sock is self._listener:
            conn, _ = sock.accept()
            self._peers[_keep_alive(conn)] = [None, b""]
            return
        reason = CLOSED
        try:
            data = sock.recv(256)
        except OSError as error:
            data, reason = b"", _reason(error)
        link = self._succ
        succ = link is not None and sock is link[1]
        if link is not None and succ:
            rank: int | None = link[0]
            said_bye = b"B" in data
        else:
            entry = self._peers[sock]
            entry[1] += data
            *lines, entry[1] = entry[1].split(b"\n")
            for line in lines:
                if line.startswith(b"H"):
                    entry[0] = int(line[1:])
            rank, said_bye = entry[0], b"B" in entry[1] or any(line == b"B" for line in lines)
        if data and not said_bye:
            return
        sock.close()
        if succ:  # relinked below, or (the store failing) at the next interval
            self._succ = None
            self._relink_due = self._relink_due or time.monotonic()
        else:
            del self._peers[sock]
        if rank is not None:
            if said_bye or not self._thread_store.check([self._key("addr", rank)]):
                self._left.add(rank)
            else:
                self._declare(rank, reason)
        if succ:
            self._relink()

    def _shut_sockets(self, *, goodbye: bool) -> None:
        socks = [*self._peers, *([self._succ[1]] if self._succ is not None else [])]
        for sock in socks:
            with contextlib.suppress(OSError):
                if goodbye:
                    sock.sendall(b"B\n")
                sock.close()
        self._peers.clear()
        self._succ = None
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _clean_up(self) -> None:
        """The last member to close (the lost ones never will) deletes the watch's keys."""
        store, prefix = self._store, self.prefix
        closed = store.add(f"{prefix}/closed", 1)
        dead = store.add(f"{prefix}/deaths", 0)
        if closed + dead < len(self.ranks):
            return
        tags: list[str] = []
        if store.check([f"{prefix}/tags"]):
            tags = store.get(f"{prefix}/tags").decode().split("\n")
        for key in key_names(prefix, self.ranks, tags):
            store.delete_key(key)


class Agreement:
    """One agreement's store protocol: **two store requests per member per poll**.

    Every member is accounted for once, in the slot ``<base>/in/<rank>``
    (``compare_set``): by itself when it checks in, or, once it is known lost,
    by the first survivor to say so; whoever fills a slot adds 1 to the counter
    ``<base>/accounted``. A poll asks whether the decision is written (one
    ``check``) and reads the counter (one ``add`` of 0): 2 requests per member
    per interval, 16 for 8 members and 2,048 for 1,024, where checking each
    missing member cost up to N per member (8 x 8, 1,024 x 1,024). A lost
    member adds one ``compare_set`` per survivor that learns of it (and one
    ``add`` for the first), once; the decision costs the member that writes it
    a ``get`` of the deaths and a ``compare_set``, the others one ``get``.

    >>> store = dist.HashStore()
    >>> one = Agreement(store, "t", [0], 0)
    >>> one.check_in(); one.poll(frozenset(), frozenset)
    frozenset()
    """

    def __init__(self, store: Any, base: str, members: list[int], rank: int) -> None:
        self.store, self.base, self.members, self.rank = store, base, members, rank
        self._accounted: set[int] = set()  # members whose slot this rank tried to fill
        self._decision = f"{base}/decision"

    def _account(self, rank: int, value: str) -> str:
        """Fill ``rank``'s slot with ``value`` unless it is filled; the value it holds."""
        self._accounted.add(rank)
        held: str = self.store.compare_set(f"{self.base}/in/{rank}", "", value).decode()
        if held == value:
            self.store.add(f"{self.base}/accounted", 1)
        return held

    def check_in(self) -> None:
        """Account for this rank as alive (a survivor that saw it lost may have been first)."""
        self._account(self.rank, "alive")

    def poll(
        self, lost: frozenset[int], read_deaths: Callable[[], frozenset[int]]
    ) -> frozenset[int] | None:
        """The decision, once every member is accounted for; None until then."""
        store = self.store
        if store.check([self._decision]):
            return _decision(store.get(self._decision).decode())
        for rank in sorted(lost.intersection(self.members).difference(self._accounted)):
            self._account(rank, f"lost:{self.rank}")
        if int(store.add(f"{self.base}/accounted", 0)) < len(self.members):
            return None
        # Every member is accounted for; a member another survivor accounted as lost is
        # in the store's deaths: read them, so that the proposal holds every one.
        known = read_deaths().intersection(self.members)
        proposal = "lost:" + ",".join(str(r) for r in sorted(known))
        return _decision(store.compare_set(self._decision, "", proposal).decode())

    def missing(self, lost: frozenset[int]) -> list[int]:
        """The members neither checked in nor known lost (one ``check`` each: for errors)."""
        return [
            r
            for r in self.members
            if r not in lost and not self.store.check([f"{self.base}/in/{r}"])
        ]


def _decision(text: str) -> frozenset[int]:
    """The lost set a decision holds (``"lost:3,5"``)."""
    return frozenset(int(r) for r in text.removeprefix("lost:").split(",") if r)
