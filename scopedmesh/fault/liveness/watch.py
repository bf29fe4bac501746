"""The liveness watch: two threads, one reads the ring, one waits on the store; aborts, agrees.

A :class:`LivenessWatch` is opt-in and held by the caller; while it runs, each
process has two more threads (none before, none after). It composes the
member's :class:`~scopedmesh.fault.liveness.ring.Ring` (its sockets), its
:class:`~scopedmesh.fault.liveness.deaths.DeathRecord`, the
:class:`~scopedmesh.fault.liveness.guard.Guard` of the meshes it aborts, and
the :class:`~scopedmesh.fault.liveness.agreement.Agreement` that :meth:`agree`
runs. **An idle watch asks nothing of the store**: its second thread blocks in
a server-side ``wait`` on its own wake key, which whoever has news for it
sets (a death's first declarer, a stop, a decision: one ``multi_set`` for all
the members). So a job's idle store load does not grow with its size.

>>> LivenessWatch(interval=0)
Traceback (most recent call last):
    ...
ValueError: interval must be a positive number of seconds (at most 60), got 0
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from types import TracebackType
from typing import Any, ParamSpec

import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.checks import check_tag, check_timeout
from scopedmesh.c10d.nccl import check_error_handling
from scopedmesh.c10d.store import WATCH_ROOT, WatchKeys, wait_timed_out
from scopedmesh.errors import LostRankError, shown
from scopedmesh.fault.heal import reform
from scopedmesh.fault.liveness.agreement import Driver, StepDriver, ledger_requests
from scopedmesh.fault.liveness.arguments import (
    MAX_INTERVAL,
    check_interval,
    check_members,
    clean_up,
)
from scopedmesh.fault.liveness.deaths import (
    LEFT,
    UNREACHABLE,
    DeathRecord,
    departure,
)
from scopedmesh.fault.liveness.guard import Guard
from scopedmesh.fault.liveness.ring import UNREACHABLE_AFTER, Ring
from scopedmesh.fault.liveness.step import Step
from scopedmesh.fault.protocol import verdict as rules
from scopedmesh.fault.protocol.agreement import (
    agreement,
    agreement_name,
    free_line,
    holds,
    line_key,
    line_of,
    members_key,
)
from scopedmesh.layout import Axis
from scopedmesh.layout.ints import is_int
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["MAX_INTERVAL", "LivenessWatch", "check_interval", "key_names"]

_P = ParamSpec("_P")
WAKE_WAIT = timedelta(hours=1)  # how long one server-side wait for news lasts (then again)


def _time_left(deadline: float) -> timedelta:
    """What is left until ``deadline`` (``time.monotonic()``), at least a millisecond."""
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _weakly(method: Callable[_P, None]) -> Callable[_P, None]:
    """``method`` called through a weak reference: whoever holds the call keeps no watch alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: _P.args, **kwargs: _P.kwargs) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def key_names(prefix: str, ranks: Iterable[int], tags: Iterable[str]) -> list[str]:
    """Every key the watches under ``prefix`` over ``ranks`` can leave (:meth:`WatchKeys.all`)."""
    return WatchKeys(prefix).all(ranks, tags)


class LivenessWatch:
    """Which members are alive, learned from their open sockets; aborts the meshes it guards.

    ``ranks`` are the members (global ranks; all of WORLD by default); every
    member makes its watches in the same order. ``interval`` is how often an
    aborted mesh is settled and a failed ring link or store request retried
    (nothing is polled). ``timeout`` bounds every wait (the
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
        self._interval = check_interval(interval)
        self._timeout = check_timeout(timeout)
        members = check_members(
            ranks, host, store, world=dist.get_world_size(), rank=dist.get_rank()
        )
        self.rank = dist.get_rank()
        self.ranks: tuple[int, ...] = tuple(members)
        base: Any = store if store is not None else _c10d.default_store()
        self._store: Any = base.clone()  # the caller's thread
        self._store.set_timeout(self._timeout)
        self.prefix = f"{WATCH_ROOT}/{self._store.add(WatchKeys.counter(self.rank), 1)}"
        self.keys = WatchKeys(self.prefix)
        self._guard = Guard()
        self._record = DeathRecord(  # the record must not keep the watch alive
            self.keys,
            self.rank,
            _weakly(self._on_deaths),
            _weakly(self._on_stops),
            self.ranks,
            on_ask=_weakly(self._on_asks),
        )
        self._tags: set[str] = set()  # the agreements this watch took part in (their names)
        # Per mesh's members (line_key): agreements held, steps committed, answers given;
        # the store thread answers while the caller's thread steps, so: a lock.
        self._ledger = rules.Ledger()
        self._ledger_lock = threading.Lock()
        self._members: dict[str, rules.Lineup] = {}  # line_key -> the members stepped on
        # A mesh whose step this rank committed in doubt -> the ranks that step lost: its
        # next step fails and re-forms it (Step), as on the members whose vote completed.
        self._deferred: weakref.WeakKeyDictionary[ProcessGroupMesh, frozenset[int]]
        self._deferred = weakref.WeakKeyDictionary()
        self._failure: tuple[str, BaseException] | None = None  # (what happened, the error)
        self._stopped = False  # whether the thread ended other than by close()
        self._failure_lock = threading.Lock()  # the thread reports, a caller takes
        self._ring = Ring(
            self.rank,
            self.ranks,
            self.keys,
            host=host,
            timeout=self._timeout,
            record=self._record,
            report=_weakly(self._report),  # the ring must not keep the watch alive
        )
        self._ring.store = base.clone()  # the watch thread's: never behind a caller's wait
        self._ring.store.set_timeout(self._timeout)
        self._waiting_store: Any = base.clone()  # the store thread's, blocked in its wait
        self._waiting_store.set_timeout(self._timeout)
        self._closing = False  # set before the store thread is woken to stop
        try:
            for listed in (self.keys.lost, self.keys.stops, self.keys.asks):  # read at once
                self._store.append(listed, "")
            self._ring.join(self._store)
        except BaseException:
            self._ring.shut(goodbye=False)
            with contextlib.suppress(Exception):
                self._store.delete_key(self.keys.addr(self.rank))
            raise
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"scopedmesh-liveness-{self.rank}", daemon=True
        )
        self._waiter = threading.Thread(
            target=self._wait_for_news, name=f"scopedmesh-liveness-store-{self.rank}", daemon=True
        )
        self._thread.start()
        self._waiter.start()

    # ------------------------------------------------------------------ queries

    @property
    def committed(self) -> int:
        """The steps (:meth:`step`) committed through this watch, on every mesh."""
        with self._ledger_lock:
            return self._ledger.total()

    def lost(self) -> frozenset[int]:
        """The members this process has learned are dead or gone (never shrinks).

        Raises ``RuntimeError`` naming what happened if the watch's thread failed.
        """
        self._check_thread()
        return self._record.lost

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
        return rank not in self._record.lost

    def why_lost(self, rank: int) -> str | None:
        """How ``rank`` was lost, as a predicate (``"has died (...)"``); None while it is alive.

        The diagnosis of a group that cannot form says ``rank 3 <this>``.
        """
        reason = self._record.why.get(rank) if rank in self._record.lost else None
        if reason is None:
            return None
        if reason.startswith(LEFT):
            return f"left the job after {reason.removeprefix(LEFT)} (its watch closed)"
        if reason == UNREACHABLE:
            return (
                f"is unreachable (its host answered no keepalive probe of the liveness watch "
                f"for {UNREACHABLE_AFTER} s: a network partition, or the host is down)"
            )
        return "has died (its liveness watch connection closed without a goodbye)"

    def learned_at(self, rank: int) -> float | None:
        """``time.time()`` when this process learned that ``rank`` died, or None."""
        return self._record.learned.get(rank)

    def aborted_at(self, rank: int) -> float | None:
        """``time.time()`` when the guarded meshes holding ``rank`` were aborted here, or None."""
        return self._guard.aborted_at(rank)

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
        raises ``GroupFormationError`` saying so, on any host. On NCCL, the
        mesh's communicators are aborted, and a torch whose watchdog would end
        the healed process is refused here with a ``RuntimeError`` naming the
        variable to set before the first NCCL group is made
        (:func:`~scopedmesh.c10d.nccl.check_error_handling`).

        Each mesh guarded here goes on a line no open mesh is on (the meshes a
        heal re-forms from it, :meth:`step`, :meth:`heal`, continue it): its
        steps, agreements and stops are its own, so several meshes over the same
        ranks can be guarded at once, and meshes guarded one after another (a
        scoped block each) continue one line. Guard and close meshes in the same
        order on every rank, as their groups are requested.
        """
        return self._guard_line(mesh, None)

    def _guard_line(self, mesh: ProcessGroupMesh, heir_of: str | None) -> ProcessGroupMesh:
        """:meth:`guard`; ``heir_of``: the key of the mesh ``mesh`` was re-formed from
        (None: ``mesh`` begins a line, unless guarded already)."""
        if not isinstance(mesh, ProcessGroupMesh):
            raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
        check_error_handling(mesh.backend or dist.get_backend(), os.environ)  # None: WORLD's
        self._check_open()
        self._check_thread()
        key = self._guard.key_of(mesh)
        if key is None and heir_of is not None:
            key = line_key(mesh.layout.ranks, line_of(heir_of))
        if key is None:  # a line of its own among those open now (one that is free again)
            busy = {line_of(k) for k in self._guard.open_keys()}
            key = line_key(mesh.layout.ranks, free_line(members_key(mesh.layout.ranks), busy))
        with self._ledger_lock:
            since = (key, self._ledger.attempt(key))
            settled = since in self._ledger.answered  # its members went on without this rank
        self._guard.add(mesh, self, (self._thread, self._waiter), lambda: self._record.lost, since)
        if settled:
            mesh.abort(
                "when its step was settled without this rank (it answered a member in doubt)"
            )
        return mesh

    def _key_of(self, mesh: ProcessGroupMesh | None, members: list[int]) -> str:
        """The key of ``members``, the ranks of ``mesh`` (None: the watch's): the guarded
        mesh's line's (:func:`~scopedmesh.fault.protocol.agreement.line_key`), else theirs."""
        key = None if mesh is None else self._guard.key_of(mesh)
        return members_key(members) if key is None else key

    def step(self, mesh: ProcessGroupMesh, axis: Axis) -> Step:
        """One training step on guarded ``mesh``, counted on every member or on none.

        ``with watch.step(mesh, "dp") as step:`` runs the step's collectives;
        after the block, ``step.committed`` is the verdict, the same on every
        surviving member, and ``step.mesh`` the mesh to go on with (``mesh``,
        or the survivors' mesh re-formed along ``axis``). Apply the step's
        update only if it committed; otherwise redo the step on ``step.mesh``.
        See :class:`~scopedmesh.fault.liveness.step.Step`.
        """
        if not isinstance(mesh, ProcessGroupMesh):
            raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
        index = mesh.layout.axis_index(axis)  # an unknown axis is named before the step runs
        self._check_open()
        if mesh in self._deferred:  # fails at once: counted on its re-formed mesh's key
            return Step(self, mesh, axis)
        key = self._key_of(mesh, self._members_of(mesh))
        with self._ledger_lock:  # the store thread answers for the members stepped on
            noted = self._members.get(key)  # kept from step to step: its ranks sorted once
            if noted is None or noted.layout is not mesh.layout or noted.axis != index:
                self._members[key] = rules.Lineup(mesh.layout, index)  # whom a heal keeps
            self._ledger.committed.setdefault(key, 0)
        return Step(self, mesh, axis)

    def _verdict(
        self,
        mesh: ProcessGroupMesh,
        raised: str,
        can_vote: bool,
        vote: Callable[[int], int | None],
    ) -> rules.Verdict:
        """Run the verdict of a step on ``mesh`` (:func:`~scopedmesh.fault.protocol.verdict.
        verdict`), carrying out its requests; ``vote`` takes part in the step's vote."""
        self._check_open()
        self._check_thread()
        key = self._key_of(mesh, self._members_of(mesh))
        with self._ledger_lock:  # the lineup step() noted for this key
            attempt, mine = self._ledger.attempt(key), self._ledger.committed.get(key, 0)
            lineup = self._members[key]
        members = lineup.ranks
        name = agreement_name(key, f"event{attempt}")
        do = StepDriver(
            self._store,
            self._record,
            self._ledger,
            self._ledger_lock,
            mesh,
            lineup,
            key=key,
            vote=vote,
            note=lambda: self._note_agreement(name),
            stepped=self._members,
        )
        steps = rules.verdict(
            rank=self.rank,
            members=members,
            keys=self.keys.agreement(name),
            attempt=attempt,
            mine=mine,
            raised=raised,
            can_vote=can_vote,
            limit=self._timeout.total_seconds(),
            tag=name,
        )
        outcome = Driver(self._store, self._record, do).run(steps)
        if outcome.error is None and self.rank in outcome.lost:
            raise LostRankError(
                f"rank {self.rank} was declared lost (lost ranks {sorted(outcome.lost)}): its "
                "connections closed; it must not join the re-formed mesh"
            )
        return outcome

    def _note_agreement(self, name: str) -> None:
        """Refuse a name used before; note it for the clean-up (one append)."""
        if name in self._tags:
            raise ValueError(
                f"tag {name.partition('/')[2]!r} was used by an earlier agreement of this "
                "watch, whose decision stands; give each agreement a new tag (or none: the "
                "watch counts them)"
            )
        self._tags.add(name)
        self._store.append(self.keys.tags, name + "\n")

    # ------------------------------------------------------------------ agreement

    def agree(
        self,
        mesh: ProcessGroupMesh | None = None,
        *,
        tag: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> frozenset[int]:
        """The lost ranks among ``mesh``'s ranks (default: the watch's), the same on every survivor.

        Each survivor checks in; once every rank is accounted for, checked in
        or declared lost by its watcher, a survivor writes the lost set with
        ``compare_set`` and every survivor returns the first one written. A
        slow rank is waited for, never declared lost; a rank that dies
        meanwhile is declared and counted. If a rank that checked in dies after
        the decision, its death aborts the re-formed mesh and the survivors
        agree again (a new ``tag``), never on two answers. ``tag`` defaults to
        this watch's count of agreements (the same on every survivor that took
        part in all of them). A rank the decision counts as lost gets
        :class:`LostRankError`. Waits at most ``timeout`` (default: the
        watch's), then raises ``TimeoutError`` naming the ranks still
        unaccounted for. On a mesh whose last step this rank committed in doubt
        (:meth:`step`), the agreement was held then: its lost set is returned,
        as the members whose vote completed read it.
        """
        deferred = self._deferred.get(mesh) if isinstance(mesh, ProcessGroupMesh) else None
        if deferred is not None:
            return deferred
        return self._agree(mesh, tag, timeout, None)[0]

    def _agree(
        self,
        mesh: ProcessGroupMesh | None,
        tag: str | None,
        timeout: timedelta | float | None,
        committed: int | None,
    ) -> tuple[frozenset[int], int | None]:
        """:meth:`agree`, carrying this rank's count of ``committed`` steps (None: none);
        the lost set and the members' highest count."""
        self._check_open()
        self._check_thread()
        if mesh is not None and not isinstance(mesh, ProcessGroupMesh):
            raise TypeError(f"mesh must be a ProcessGroupMesh or None, got {shown(mesh)}")
        limit = self._timeout if timeout is None else check_timeout(timeout)
        members = self._members_of(mesh)
        key = self._key_of(mesh, members)
        if tag is None:
            with self._ledger_lock:
                tag = f"event{self._ledger.attempt(key)}"
        check_tag(tag)
        name = agreement_name(key, tag)
        self._note_agreement(name)
        with self._ledger_lock:
            self._ledger.attempts[key] = self._ledger.attempt(key) + 1
        steps = agreement(
            self.keys.agreement(name),
            members,
            self.rank,
            committed=committed,
            limit=limit.total_seconds(),
            tag=tag,
        )
        # Deaths as known here, never raising: a failure of the thread that it survives is
        # raised by the next query, not in the middle of an agreement this rank checked in to.
        outcome = Driver(self._store, self._record).run(steps)
        if self.rank in outcome.lost:
            raise LostRankError(
                f"rank {self.rank} was declared lost (lost ranks {sorted(outcome.lost)}): its "
                "connections closed; it must not join the re-formed mesh"
            )
        return outcome.lost, outcome.committed

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

    def heal(
        self, mesh: ProcessGroupMesh, axis: Axis, *, tag: str | None = None
    ) -> ProcessGroupMesh:
        """Agree on the lost ranks of ``mesh``, re-form it along ``axis`` and guard the result.

        ``reform(mesh, self.agree(mesh, tag=tag), axis)``, guarded in ``mesh``'s line.
        A rank that loses its place gets :class:`LostRankError` (``mesh`` is closed).
        """
        deferred = self._deferred_reform(mesh) if isinstance(mesh, ProcessGroupMesh) else None
        lost = self.agree(mesh, tag=tag) if deferred is None else deferred
        return self._reformed(mesh, lost, axis)

    def _reformed(
        self, mesh: ProcessGroupMesh, lost: frozenset[int], axis: Axis
    ) -> ProcessGroupMesh:
        """``reform(mesh, lost, axis)``, guarded in ``mesh``'s line. A failure of the watch's
        thread is raised first, while ``mesh`` is still open."""
        self._check_open()
        self._check_thread()
        key = self._key_of(mesh, self._members_of(mesh))
        return self._guard_line(reform(mesh, lost, axis), key)

    def _defer_reform(self, mesh: ProcessGroupMesh, lost: frozenset[int]) -> None:
        """This rank committed ``mesh``'s step in doubt (``lost``: the ranks it lost): abort
        ``mesh`` if the death has not yet, and re-form it after its next step, which fails
        (:class:`~scopedmesh.fault.liveness.step.Step`)."""
        if not mesh.aborted:
            mesh.abort(f"when rank {self.rank} committed a step its vote left in doubt")
        self._deferred[mesh] = lost

    def _deferred_reform(self, mesh: ProcessGroupMesh) -> frozenset[int] | None:
        """The lost ranks of ``mesh`` where its re-forming was deferred (once), else None."""
        return self._deferred.pop(mesh, None)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        """The thread: read the ring's sockets, poll the store; any failure is recorded
        for the next query (:meth:`_check_thread`), never dropped.

        Only a clean stop (:meth:`close` woke it) says goodbye to the peers. A thread
        that crashed leaves the sockets open: to its peers the rank is alive while
        its process runs, and its death is declared like any other.
        """
        try:
            with selectors.DefaultSelector() as selector:  # epoll: any number of fds
                self._loop(selector)
        except BaseException as error:  # the thread ends: say so in the next query
            with self._failure_lock:
                self._failure, self._stopped = ("stopped", error), True
            return
        self._ring.shut(goodbye=True)

    def _loop(self, selector: selectors.BaseSelector) -> None:
        """Read the ring's sockets; every ``interval`` while there is work (an aborted mesh
        to settle, a link to retry), else on a socket or a nudge alone."""
        ring = self._ring
        while True:
            busy = ring.relink_due is not None or self._guard.unsettled()
            readable = ring.select(selector, self._interval if busy else None)
            if ring.wake_r in readable and ring.woken_to_stop():
                return
            try:
                for sock in readable:
                    if sock is not ring.wake_r:
                        ring.on_readable(sock)
                self._guard.settle()
                if ring.relink_due is not None:
                    ring.relink()
                if ring.succ is not None and ring.succ[0] in self._record.lost:
                    ring.relink()
            except Exception as error:  # keep watching (the store may come back); say so
                self._report("failed while watching (it goes on)", error)
                time.sleep(self._interval)

    def _wait_for_news(self) -> None:
        """The store thread: block on this rank's wake key (a server-side wait, no polling);
        once woken, delete it and read the lists of deaths and stops in one request."""
        try:
            self._wait_on(self.keys.wake(self.rank))
        except BaseException as error:  # the thread ends: say so in the next query
            with self._failure_lock:
                self._failure, self._stopped = ("stopped waiting for news", error), True

    def _wait_on(self, key: str) -> None:
        lists = [self.keys.lost, self.keys.stops, self.keys.asks]
        limit = WAKE_WAIT.total_seconds()
        while not self._closing:
            try:
                began = time.monotonic()
                try:
                    self._waiting_store.wait([key], WAKE_WAIT)
                except Exception as error:
                    if wait_timed_out(error, time.monotonic() - began, limit):
                        continue  # nothing happened for WAKE_WAIT: wait again
                    raise
                if self._closing:
                    return
                store = self._waiting_store  # read anew: a test may swap it while we wait
                store.delete_key(key)  # before the read: news set after it wakes us again
                deaths, stops, asks = store.multi_get(lists)
                self._record.take(deaths.decode(), stops.decode(), asks.decode())
            except Exception as error:  # keep waiting (the store may come back); say so
                self._report("failed while waiting for news (it goes on)", error)
                time.sleep(self._interval)

    def _on_deaths(self, new: set[int]) -> None:
        """Abort the guarded meshes the ``new`` deaths hit; the ring's thread settles them."""
        self._guard.hit(new)
        if self._guard.unsettled():
            self._ring.nudge()

    def _on_stops(self, stops: set[tuple[int, str, int]]) -> None:
        """Abort the guarded meshes that hold a rank whose step raised (``(rank, members,
        attempt)``)."""
        self._guard.stop(stops)
        if self._guard.unsettled():
            self._ring.nudge()

    def _on_asks(self, asks: list[tuple[str, int]]) -> None:
        """Answer each ask of a member in doubt (store thread): check in for this rank with
        its count of committed steps, fencing the attempt (:func:`~scopedmesh.fault.
        protocol.verdict.answer_ask`), so that nobody waits on this rank's compute."""
        for key, attempt in asks:
            if holds(key, self.rank) is not False:  # an ask of other members costs nothing
                self._answer(self._waiting_store, key, attempt)

    def _answer(self, store: Any, key: str, attempt: int, *, closing: bool = False) -> None:
        """Check in for this rank to ``attempt`` of the members ``key`` it steps on, with
        the count it has or will have there (:func:`~scopedmesh.fault.protocol.verdict.
        answer_ask`); nothing where it cannot tell. Its meshes of those members are then
        aborted, unless it is ``closing`` (the meshes are the caller's to use still)."""
        with self._ledger_lock:
            members = self._members.get(key)
        if members is not None:  # the clean-up finds the agreement's keys
            name = agreement_name(key, f"event{attempt}")
            if name not in self._tags:
                store.append(self.keys.tags, name + "\n")
        steps = rules.answer_ask(rank=self.rank, prefix=self.prefix, key=key, attempt=attempt)
        on_fence = (lambda chain: None) if closing else self._on_fence
        other = ledger_requests(self._ledger, self._ledger_lock, self._members, on_fence)
        Driver(store, self._record, other).run(steps)

    def _on_fence(self, chain: tuple[tuple[str, int], ...]) -> None:
        """This rank answered for ``chain``: its meshes of those members are settled without
        it (a member in doubt means they are aborted everywhere): abort them here now."""
        self._guard.abort_members({key for key, _ in chain}, "a member in doubt settled it")
        if self._guard.unsettled():
            self._ring.nudge()

    def _report(self, what: str, error: BaseException) -> None:
        """Record a failure the thread survives, for the next query."""
        with self._failure_lock:
            if not self._stopped:  # a stopped thread's failure stays the one reported
                self._failure = (what, error)

    def _check_thread(self) -> None:
        """Raise what broke the watch's thread, naming it: always once it has stopped,
        once per failure while it goes on (taken and cleared in one step, so a failure
        reported meanwhile is raised next time, never dropped)."""
        with self._failure_lock:
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

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> LivenessWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close; after an exception, as a departure (:meth:`close`); a failure to close
        after an exception is a warning, never a replacement."""
        if exc is None:
            self.close()
            return
        try:
            self.close(error=exc)
        except Exception as error:
            warnings.warn(
                f"closing {self!r} after {type(exc).__name__} also failed: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self, *, error: BaseException | None = None) -> None:
        """Stop: say goodbye to the peers, join the thread, close the sockets; idempotent.

        With ``error`` (what ended this rank's work; ``with`` passes it), this rank
        **leaves**: every member learns at once that it is gone and why, so no
        agreement or formation waits for it, and their step raises
        :class:`~scopedmesh.errors.StepError` naming ``error``'s type and message.

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
            self._leave_counts()
            if error is not None:
                self._record.depart(store, departure(error))
            store.delete_key(self.keys.addr(self.rank))  # a late connector sees "left"
        self._closing = True
        with contextlib.suppress(Exception):
            store.set(self.keys.wake(self.rank), "closing")  # the store thread stops
        self._ring.wake()
        self._thread.join(_time_left(deadline).total_seconds())
        self._waiter.join(_time_left(deadline).total_seconds())
        with contextlib.suppress(Exception):
            store.delete_key(self.keys.wake(self.rank))
        if self._stopped:  # the thread crashed and left the sockets open: leave cleanly
            self._ring.shut(goodbye=True)
        self._guard.release(self)
        try:
            store.set_timeout(_time_left(deadline))
            self._clean_up()
        finally:
            self._store = self._ring.store = self._waiting_store = None  # closes the connections

    def _leave_counts(self) -> None:
        """Answer the agreement this rank would take part in next on each set of members it
        stepped on, with its count of committed steps: a peer left in doubt about the last
        step (its vote was cut short) learns from it whether that step committed."""
        with self._ledger_lock:
            next_attempts = [(key, at) for key, _, at, _ in self._ledger.steps(self._members)]
        for key, attempt in next_attempts:
            self._answer(self._store, key, attempt, closing=True)

    def _clean_up(self) -> None:
        """The last member to close deletes the watch's keys (:func:`~scopedmesh.fault.
        liveness.arguments.clean_up`)."""
        clean_up(self._store, self.keys, self.rank, self.ranks)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        lost = sorted(self._record.lost)
        return f"<LivenessWatch rank {self.rank} of {list(self.ranks)}, {state}, lost {lost}>"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; make a new LivenessWatch")
