"""Replicas that grow back: a lost replica restarts, is admitted at a step boundary, and
catches up from a live one; the job returns to its full shape.

A replicated job is ``replicas`` copies of one replica (its own WORLD: tp, pp, FSDP2
and scoped meshes inside it are as before), each with ``local`` ranks. A member
is a **slot**, ``(replica, coordinate)``, and an **epoch** names one membership,
decided once in a store that outlives every replica (the job's store, hosted by
the launcher). Each epoch's cross-replica (dp) groups are formed outside WORLD,
one per coordinate, under the epoch's prefix in that store.

What a training loop writes (``examples/grow_replicas.py`` runs it)::

    with Replicas(store, replica=r, replicas=3, state={"model": model, "optim": opt,
                                                       "progress": progress}) as grow:
        while True:
            grow.boundary()                         # join, admit joiners, drop the dead
            if progress.step >= steps:              # agreed state: alike on every member
                if grow.finish(): break             # every replica ends on this step
                continue                            # False: a member redid the last step
            loss = compute_grads(model, progress.step)
            if grow.all_reduce_([p.grad for p in model.parameters()]):
                opt.step(); progress.step += 1      # False: a replica died mid-step; redo it

``boundary()`` costs nothing unless the last step saw a change. ``all_reduce_``
averages along the epoch's dp group, then agrees on the step's outcome (one
store request per replica, a MAX along dp and one along the replica's own
group): commit, commit and admit at the next boundary, or redo the step in a
new epoch. An exception inside the step fails it everywhere: the replica that
raised gets :class:`~scopedmesh.errors.StepError`, the others False.

An admitted joiner catches up inside its first step: the source sends it the
state it holds at that step's ``all_reduce_`` (RNG and counters the loop moved
included), tensor by tensor into the joiner's own tensors, and the joiner's
tensors count for nothing in that step (``contributors``), so it applies the
same update from the same state. A loop may skip its compute while
``catching_up`` (the tensors must still have their shapes).

docs/replicas.md gives the protocol, its store traffic and its limits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from scopedmesh.c10d.checks import check_timeout
from scopedmesh.c10d.nccl import join_within
from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.errors import (
    JobFinishedError,
    JobMismatchError,
    LostRankError,
    NoLiveReplicaError,
    shown,
)
from scopedmesh.fault.dp_groups import Drops, check_backend, form_group
from scopedmesh.fault.probes import SlotProbes
from scopedmesh.fault.protocol.membership import (
    Decision,
    JobShape,
    Joining,
    no_state_left,
    propose,
)
from scopedmesh.fault.records import Records, check_shape, with_step
from scopedmesh.fault.state_transfer import (
    CollectiveFailed,
    Stateful,
    Transfer,
    UnmovableState,
    broadcast_state,
    receive_state,
    run,
    send_state,
    timed,
)
from scopedmesh.fault.verdict import (
    Flags,
    average,
    check_args,
    check_tensors,
    group_device,
    max_options,
    verdict_error,
)

__all__ = ["LIVE_EVERY", "Replicas", "Stateful", "Transfer", "group_device"]

LIVE_EVERY = 1.0  # seconds: how often a joiner probes the newest epoch's members

T = TypeVar("T")


class Replicas:
    """This rank's slot in a replicated job whose replicas die and grow back.

    ``store`` is the job's store (a ``TCPStore`` client of the launcher's
    server; never a replica's own). ``replica`` is this replica's number in
    ``0..replicas-1``; its ranks are ``group`` (default WORLD), and this rank's
    coordinate is its rank there. ``state`` maps names to objects with
    ``state_dict``/``load_state_dict`` (model, optimizer, progress: step, RNG,
    data position): a joiner receives them from the epoch's source replica.
    ``timeout`` bounds every wait; each says what it waited for.
    ``form_timeout`` bounds the connection of an epoch's group (a member
    that dies after every member was ready costs its peers that long).
    ``backend`` is the dp groups' (``"gloo"``, or ``"nccl"``: CUDA tensors, each
    epoch's communicators formed afresh; see :mod:`~scopedmesh.fault.dp_groups`).

    After each agreed step, ``contributors`` holds the replicas whose tensors
    it averaged (all members, but for an admission's joiners in its first
    step), ``transfers`` every state transfer this rank took part in, and
    ``entered`` each epoch it entered.
    """

    def __init__(
        self,
        store: Any,
        *,
        replica: int,
        replicas: int,
        state: Mapping[str, Stateful],
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | float = 60.0,
        host: str | None = None,
        poll: float = 0.01,
        form_timeout: timedelta | float = 10.0,
        backend: str = "gloo",
    ) -> None:
        self._state, self._count = with_step(check_args(store, replica, replicas, state, poll))
        self._timeout = check_timeout(timeout).total_seconds()
        self._form_timeout = check_timeout(form_timeout, "form_timeout").total_seconds()
        self.backend = check_backend(backend)
        if host is not None and not isinstance(host, str):
            raise TypeError(f"host must be a str or None, got {shown(host)}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup or None (WORLD), got {shown(group)}")
        self._store, self._group, self._poll = store, group, float(poll)
        self.replica, self.replicas = int(replica), int(replicas)
        self.coordinate = dist.get_rank(group)
        self.local = dist.get_world_size(group)
        self.keys = ReplicaKeys()
        # Before any other side effect (no listener, no collective): the job's shape.
        check_shape(store, self.keys, JobShape(self.replicas, self.local, self.replica))
        self.decision: Decision | None = None
        self.transfers: list[Transfer] = []
        self.failure: str | None = None  # the last dp collective that failed here, and why
        self.entered: list[tuple[int, float, tuple[int, ...]]] = []  # epoch, time, replicas
        self.contributors: tuple[int, ...] = ()  # whose tensors the last agreed step averaged
        self._steps = 0  # agreed steps in this epoch
        self._behind: frozenset[int] = frozenset()  # joiners without the source's state yet
        self._outgoing: list[int] | None = None  # the source's catch-up: the joiners' dp ranks
        self._incoming: int | None = None  # this joiner's catch-up: the source's dp rank
        self._error: BaseException | None = None  # what this rank raised in this step
        self._unmovable: UnmovableState | None = None  # the source could not pack its state
        self._finished = False
        # The replica's own group takes the verdict's tensors here (CUDA if NCCL-only).
        self._device = group_device(str(dist.get_backend(group)))
        self._pg: Any = None  # this epoch's dp group along this rank's coordinate
        self._drops = Drops(f"replica {replica} coordinate {self.coordinate}", self._timeout)
        self._aborts: list[threading.Thread] = []  # NCCL dp groups' aborts (DeviceGroup.abort)
        self._admission: tuple[threading.Thread, list[Any]] | None = None  # see boundary()
        self._pending: str | None = "join"
        self._cleaned = -1  # the epoch whose older keys this rank last had deleted
        self._closed = False
        target = host or getattr(store, "host", None) or "127.0.0.1"
        self._probes = SlotProbes(store, self.keys, target)
        self._records = Records(store, self.keys, self.replicas, self.local, self._probes)
        self.token = self._agree_token()
        address = self._probes.address
        store.set(self.keys.address(self.replica, self.coordinate, self.token), address)

    # ------------------------------------------------------------------ the loop's calls

    @property
    def size(self) -> int:
        """How many replicas the current epoch holds (0 before the first boundary)."""
        return 0 if self.decision is None else self.decision.size

    @property
    def step(self) -> int:
        """The job's agreed steps (each ``all_reduce_`` that returned True; a joiner takes
        the source's count with its state). :func:`~scopedmesh.job_view` shows it."""
        return self._count.value

    @property
    def dp_group(self) -> Any:
        """This epoch's dp group along this rank's coordinate (one member per replica of
        the epoch), or None: before the first boundary, with one replica, or once a
        collective on it failed. For work started before :meth:`all_reduce_` (gradient sums
        overlapped with the backward pass); ``all_reduce_`` still decides the step.

        It is the group object this class's own collectives use: a ``ProcessGroup``'s
        collectives (``allreduce``, ``broadcast``, ...) behind a wrapper whose waits watch
        the peers (gloo: their links; NCCL: their liveness), so a wait on its work ends
        when a peer is lost instead of at gloo's or NCCL's timeout."""
        return self._pg

    @property
    def catching_up(self) -> bool:
        """Whether this rank's next ``all_reduce_`` is its catch-up step: its tensors count
        for nothing, and it loads the source's state before the call returns."""
        return self._incoming is not None

    def boundary(self) -> Decision:
        """Join, admit joiners or re-form without the dead, as the last step decided.

        Free when nothing changed (no request, no collective). After a change,
        every member holds the source replica's state, bit for bit.
        """
        self._check_open()
        if self._pending == "join":
            self._enter(self._join())
        elif self._pending == "heal":
            self._enter(self._heal(self._current()))
        elif self._pending == "admit":
            self._enter(*self._admitted())
        return self._current()

    def all_reduce_(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Average ``tensors`` in place along the dp group; True if every replica's step
        succeeded (apply it), False if it counts nowhere: a replica failed (the state is
        re-synced at the next :meth:`boundary`: redo the step), or, in an admission's
        first step, the others called :meth:`finish` (the joiner now holds their final
        state). The average is over :attr:`contributors` (in an admission's first step,
        the joiners contribute nothing).

        An exception inside the step (the state transfer's included) fails the step on
        every member: the replica where it was raised gets :class:`StepError` on each
        of its ranks (and is closed: restart it), the others False.
        """
        self._check_open()
        tensors = check_tensors(tensors)
        if self._pending is not None:
            raise RuntimeError(
                f"replica {self.replica}: call boundary() before all_reduce_ ({self._pending} due)"
            )
        return self._step(tensors)

    def finish(self) -> bool:
        """End the job here, on every replica at once: True once every member agreed that
        this is the last step (every replica then holds the same state; a replica that
        starts later gets :class:`JobFinishedError` at once). False: a member failed, or
        redid the last step while this one committed it: call :meth:`boundary` and let
        the loop's condition decide again (the state may be one step back). The
        module's docstring shows the loop.
        """
        self._check_open()
        if self._pending is not None:
            raise RuntimeError(
                f"replica {self.replica}: call boundary() before finish() ({self._pending} due)"
            )
        return self._finished or self._step(None)

    def _step(self, tensors: list[torch.Tensor] | None) -> bool:
        """One step (``tensors``) or the end of the job (None), with its verdict."""
        decision = self._current()
        self._probes.drain()
        self._error = self._unmovable = None
        catch_up = self._steps == 0 and bool(decision.fresh)
        fresh = decision.fresh if catch_up else ()
        contributors = tuple(r for r in decision.replicas if r not in fresh)
        ok, mixed = True, False
        if catch_up:  # the one step where a joiner's stale loop may step while others finish
            votes = torch.tensor([int(tensors is None), int(tensors is not None)])
            ok = self._dp(lambda pg: run(lambda: pg.allreduce([votes], max_options())))
            mixed = bool(int(votes[0]) and int(votes[1]))
        if tensors is not None and self._incoming is not None:
            for tensor in tensors:
                tensor.zero_()  # this step's compute ran on the joiner's own state
        ok = ok and self._dp(lambda pg: self._catch_up(pg, decision))
        if tensors is not None and not mixed:
            n = len(contributors)
            ok = ok and self._dp(lambda pg: average(pg, tensors, decision.size, n))
        ok = self._guard(self._drops.finish) and ok  # the last epoch's group, let go of meanwhile
        joins = 0
        if tensors is not None and self.coordinate == 0 and ok:
            joins, ok = self._read_joins()
        flags = self._flags(ok, joins)
        if not self._agree(flags.values, ok):
            self._outgoing = self._incoming = None
            self._pending = "heal"
            self._raise_if_error(flags, "a step")
            return False
        self._raise_if_error(flags, "a step")
        self._steps += 1
        self._behind = frozenset()
        self._outgoing = self._incoming = None
        if mixed:
            return False
        if tensors is None:
            self._finished = True
            if decision.source == self.replica and self.coordinate == 0:
                end = functools.partial(self._records.finished, decision, self._count.value)
                self._ask(end, "the job's end")
            return True
        self.contributors = contributors
        reports = decision.source == self.replica and self.coordinate == 0
        due = self._records.count(self._count, reports)
        if due is not None:
            self._ask(due, "the step count")
        if flags.joins > decision.joins:
            self._pending = "admit"
        if self._cleaned < decision.epoch and decision.source == self.replica:
            self._cleaned = decision.epoch
            if self.coordinate == 0:
                self._ask(lambda: self._records.clean(decision), "the old epochs' clean-up")
        if self._pending == "admit":
            self._start_admission(decision)
        return True

    def _agree(self, flags: torch.Tensor, ok: bool) -> bool:
        """The verdict: ``flags`` MAXed along dp (if this rank's part went well) and then
        along the replica's own group (on its device); True if no member failed."""
        if ok:
            ok = self._dp(lambda pg: run(lambda: pg.allreduce([flags], max_options())))
            if not ok:
                flags[0] = 1
        world = flags.to(self._device)
        dist.all_reduce(world, op=dist.ReduceOp.MAX, group=self._group)
        flags.copy_(world.cpu())
        return not int(flags[0])

    def _flags(self, ok: bool, joins: int) -> Flags:
        mine = self.coordinate
        return Flags.of(
            ok,
            joins,
            None if self._error is None else mine,
            None if self._unmovable is None else mine,
            mine if isinstance(self._error, JobMismatchError) else None,
        )

    def _raise_if_error(self, flags: Flags, where: str) -> None:
        """After a verdict: if this replica's rank raised, close and raise on every rank of
        it; if a source could not pack its state, on every member."""
        unmovable = flags.unmovable_at
        origin: BaseException | None = self._unmovable if unmovable is not None else self._error
        error = verdict_error(flags, origin, self.replica, self._current().source, where)
        if error is None:
            return
        self._error = self._unmovable = None
        self.close()  # this slot's listener closes: the other replicas' heal sees it gone
        raise error from origin

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Drop the dp group and the listener; remove this slot's address. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pg = None
        self._outgoing = self._incoming = None
        self._admission = None  # its thread sees the close at its next wait, and drops its group
        self._drops.finish()
        self._aborts[:] = join_within(self._aborts, self._timeout)  # the DeviceGroups' list
        if self._aborts:  # not raised: a close may run on its way to raising the step's error
            names = [t.name for t in self._aborts]
            self.failure = f"waited {self._timeout:g} s for NCCL's abort of a dp group {names}"
        self._probes.close()
        with contextlib.suppress(Exception):
            if not self._probes.cut_off:  # a request to a store cut off would wait for the cut
                self._store.delete_key(self.keys.address(self.replica, self.coordinate, self.token))

    def __enter__(self) -> Replicas:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Replicas(replica={self.replica}, coordinate={self.coordinate}, "
            f"epoch={None if self.decision is None else self.decision.epoch}, size={self.size})"
        )

    # ------------------------------------------------------------------ transitions

    def _join(self) -> Decision:
        """Announce this incarnation, then wait for an epoch that admits it."""
        store, keys = self._store, self.keys
        self._check_finished()
        before = read(store, keys.join(self.replica, self.coordinate))
        if before is not None and before != self.token:  # a dead predecessor's listener
            store.delete_key(keys.address(self.replica, self.coordinate, before))
        store.set(keys.join(self.replica, self.coordinate), self.token)
        # Every slot of this replica announced (a barrier, on the group's own device).
        dist.all_reduce(torch.zeros(1, device=self._device), group=self._group)
        if self.coordinate == 0:
            store.add(keys.joins, 1)
        join = Joining(self.replica, self.token, replicas=self.replicas, local=self.local)
        epoch, marked, probed = int(read(store, keys.latest) or 0), -1, -LIVE_EVERY
        deadline = time.monotonic() + self._timeout
        while True:
            self._probes.drain()
            self._check_finished()
            text = read(store, keys.decision(epoch))
            if text is None and epoch == 0 and read(store, keys.latest) is None:
                text = self._bootstrap()
            if text is not None:
                join.decided(Decision.parse(epoch, text))
                admitted = join.admitted
                if admitted is not None:
                    return admitted
                epoch += 1
                continue
            if marked != epoch:  # ready ahead: the members that admit it form at once
                store.set(keys.ready(epoch, self.replica, self.coordinate), "1")
                marked = epoch
            epoch = max(epoch, int(read(store, keys.latest) or 0))
            if join.newest is not None and time.monotonic() - probed >= LIVE_EVERY:
                probed = time.monotonic()
                self._check_live(join, epoch)
            if time.monotonic() >= deadline and join.newest is None:
                for r, c in self._records.slots():  # once, for the message: who is missing
                    token = read(store, keys.join(r, c))
                    join.announced(r, c, token)
                    if token is not None and self._probes.gone(r, c, token):
                        join.died(r, token)
            self._wait_or_fail(deadline, join.waiting_for(epoch))

    def _check_live(self, join: Joining, epoch: int) -> None:
        """Probe the newest epoch's members (a slot each, until one is found dead); a
        :class:`NoLiveReplicaError` if every one is dead and no newer epoch was decided."""
        newest = join.newest
        if newest is None or newest.epoch != epoch - 1:  # a newer one is yet to be read
            return
        for replica, token in newest.members:
            if any(self._probes.gone(replica, c, token) for c in range(self.local)):
                join.died(replica, token)
        if join.no_live_replica and read(self._store, self.keys.decision(epoch)) is None:
            self._check_finished()  # members that finished the job closed: not a death
            raise NoLiveReplicaError(f"replica {self.replica}: {join.no_live_message()}")

    def _bootstrap(self) -> str | None:
        """The first epoch, once every replica announced; None until then."""
        if self._store.add(self.keys.joins, 0) < self.replicas:
            return None
        joiners = self._records.joiners(Decision(-1, (), 0, 0))
        if len(joiners) < self.replicas:
            return None
        joins = self._store.add(self.keys.joins, 0)
        first = propose(0, {}, joiners, joins)
        return self._records.decide(first)

    def _start_admission(self, current: Decision) -> None:
        """Decide and form the next epoch on a helper thread while the loop finishes its
        step (its optimizer step, logging, next batch); :meth:`boundary` takes it over.

        Only this slot's store requests, probes and the new dp group's formation run
        there: the replica's own collectives and the state transfer stay on the
        loop's thread, at the boundary.
        """
        self._drop_in_background()
        outcome: list[Any] = []

        def admit() -> None:
            try:
                decision = self._admit(current)
                outcome.append((decision, self._form(decision)))
                if self._closed:
                    self._pg = None
            except BaseException as error:  # re-raised on the loop's thread by boundary()
                outcome.append(error)

        thread = threading.Thread(target=admit, name="scopedmesh-replicas-admit", daemon=True)
        thread.start()
        self._admission = (thread, outcome)

    def _admitted(self) -> tuple[Decision, bool]:
        """The helper's admission: the next epoch, and whether its dp group formed."""
        if self._admission is None:  # all_reduce_ starts one whenever it sets "admit"
            raise RuntimeError(f"replica {self.replica}: an admission is due but none started")
        thread, outcome = self._admission
        self._admission = None
        thread.join(self._timeout + self._form_timeout)
        if thread.is_alive() or not outcome:
            raise TimeoutError(
                f"replica {self.replica} coordinate {self.coordinate}: waited "
                f"{self._timeout + self._form_timeout:g} s for the admission's epoch to form"
            )
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        decision, formed = outcome[0]
        return decision, formed

    def _admit(self, current: Decision) -> Decision:
        """The next epoch: every member and every complete joiner (no waiting)."""
        joins = self._store.add(self.keys.joins, 0)
        joiners = self._records.joiners(current)
        nxt = propose(current.epoch + 1, dict(current.members), joiners, joins, catch_up=True)
        return Decision.parse(current.epoch + 1, self._records.decide(nxt))

    def _heal(self, current: Decision) -> Decision:
        """After a failed step: check in, wait until every slot of ``current`` checked in
        or one of its replica's slots is dead, then decide (or read) the next epoch."""
        self._pg = None
        self._probes.check_reach(self.replica, self.token, current)  # cut off: LostRankError
        store, keys, nxt = self._store, self.keys, current.epoch + 1
        store.set(keys.checked_in(current.epoch, self.replica, self.coordinate), "1")
        waiting = [(r, c) for r in current.replicas for c in range(self.local)]
        deadline = time.monotonic() + self._timeout
        while True:
            self._probes.drain()
            text = read(store, keys.decision(nxt))
            if text is not None:
                return Decision.parse(nxt, text)
            waiting = [
                s for s in waiting if read(store, keys.checked_in(current.epoch, *s)) is None
            ]
            dead = {r for r, c in waiting if self._probes.dead(r, c, current.token(r))}
            undecided = sorted({r for r, _ in waiting} - dead)
            if not undecided:
                joins = store.add(keys.joins, 0)
                alive = {r: t for r, t in current.members if r not in dead}
                lost = no_state_left(alive, self._behind, current.epoch)
                if lost is not None:
                    raise NoLiveReplicaError(f"replica {self.replica}: {lost}")
                joiners = self._records.joiners(current)
                proposal = propose(nxt, alive, joiners, joins, behind=self._behind)
                return Decision.parse(nxt, self._records.decide(proposal))
            self._wait_or_fail(
                deadline,
                f"replicas {undecided} of epoch {current.epoch} to check in after a failed "
                f"step or to die (slots waited for: {[s for s in waiting if s[0] not in dead]})",
            )

    def _enter(self, decision: Decision, formed: bool | None = None) -> None:
        """Form ``decision``'s groups (unless ``formed`` says how that went) and take its
        source's state; on a failure, heal."""
        while True:
            if decision.token(self.replica) != self.token:
                self._pg = None
                raise LostRankError(
                    f"replica {self.replica} (incarnation {self.token}) is not in epoch "
                    f"{decision.epoch} ({decision.text()}): its slot was taken or it was "
                    f"found dead; restart the replica to rejoin"
                )
            self.decision, self._steps = decision, 0
            self._error = self._unmovable = None
            self._behind |= set(decision.fresh)
            if formed is None:
                formed = self._guarded(functools.partial(self._formed, decision), 0) == 1
            ok = formed and self._dp(functools.partial(self._sync, decision=decision))
            formed = None
            flags = self._flags(ok, 0)
            world = flags.values.to(self._device)
            dist.all_reduce(world, op=dist.ReduceOp.MAX, group=self._group)
            flags.values.copy_(world.cpu())
            self._raise_if_error(flags, f"entering epoch {decision.epoch}")
            if not flags.failed:
                self._pending = None
                self.entered.append((decision.epoch, time.time(), decision.replicas))
                if decision.source == self.replica and self.coordinate == 0:
                    entered = functools.partial(
                        self._records.entered, decision.epoch, self._count.value
                    )
                    self._ask(entered, "the new epoch")
                return
            self._outgoing = self._incoming = None
            decision = self._heal(decision)

    def _formed(self, decision: Decision) -> int:
        return int(self._form(decision))

    def _form(self, decision: Decision) -> bool:
        """Wait until this coordinate's slots of ``decision`` are ready (False if one is
        dead), then form the epoch's dp group outside WORLD."""
        store, keys, epoch = self._store, self.keys, decision.epoch
        store.set(keys.ready(epoch, self.replica, self.coordinate), "1")
        deadline = time.monotonic() + self._timeout
        waiting = [r for r in decision.replicas if r != self.replica]
        while waiting:
            self._probes.drain()
            waiting = [
                r for r in waiting if read(store, keys.ready(epoch, r, self.coordinate)) is None
            ]
            if any(self._probes.dead(r, self.coordinate, decision.token(r)) for r in waiting):
                return False
            if waiting:
                self._wait_or_fail(
                    deadline,
                    f"replicas {waiting} to form epoch {epoch} along coordinate {self.coordinate}",
                )
        pg = form_group(
            self.backend, store, keys, self._probes, decision, self.replica, self.coordinate,
            form_timeout=self._form_timeout, timeout=self._timeout, aborts=self._aborts,
        )  # fmt: skip
        if pg is None:
            return False
        # On gloo, the group's waits check the links to its peers (a cut-off host); an NCCL
        # group's waits watch their peers themselves (dp_groups.DeviceGroup).
        watched = self.backend == "gloo"
        self._pg = (
            self._probes.watch(pg, decision, self.replica, self.coordinate) if watched else pg
        )
        return True

    def _sync(self, pg: Any, decision: Decision) -> None:
        """The source replica's state along this coordinate: a broadcast to every member,
        or, at an admission, a catch-up of the fresh joiners alone in the epoch's first
        step (:meth:`_catch_up`)."""
        if decision.size == 1:
            return
        source = decision.index(decision.source)
        if not decision.fresh:
            start = time.perf_counter()
            role, nbytes = broadcast_state(pg, self._state, source, decision.index(self.replica))
            seconds = time.perf_counter() - start
            self.transfers.append(Transfer(decision.epoch, role, nbytes, seconds))
        elif decision.source == self.replica:
            self._outgoing = [decision.index(r) for r in decision.fresh]
        elif self.replica in decision.fresh:
            self._incoming = source

    def _catch_up(self, pg: Any, decision: Decision) -> None:
        """The catch-up, in the epoch's first step, before its all-reduce: the source
        sends the state it holds now (what the loop changed since the boundary, RNG
        and counters, included), the joiners take it into their own tensors."""
        if self._outgoing is not None:
            joiners, self._outgoing = self._outgoing, None
            nbytes, seconds = timed(lambda: send_state(pg, self._state, joiners))
            self.transfers.append(Transfer(decision.epoch, "sent", nbytes, seconds))
        if self._incoming is not None:
            source, self._incoming = self._incoming, None
            nbytes, seconds = timed(lambda: receive_state(pg, self._state, source))
            self.transfers.append(Transfer(decision.epoch, "received", nbytes, seconds))

    # ------------------------------------------------------------------ helpers

    def _drop_in_background(self) -> None:
        """Let go of the last epoch's healthy, idle dp group on a helper thread (:class:`Drops`)."""
        held, self._pg = [self._pg], None
        self._drops.start(held)  # the thread's list holds the last reference

    def _dp(self, work: Callable[[Any], object]) -> bool:
        """Run ``work`` on the dp group; False (and the group dropped: peers blocked on
        this rank fail at once) if a collective failed or anything else was raised (kept
        in ``_error``: the verdict turns it into this replica's :class:`StepError`)."""
        if self._pg is None:
            return self.decision is not None and self.decision.size == 1
        try:
            work(self._pg)
        except UnmovableState as error:  # nothing else was sent: the group stays intact
            self._unmovable = self._unmovable or error
            return True
        except CollectiveFailed as error:
            self.failure = f"epoch {self._current().epoch}: {error}"
            self._pg = None
            return False
        except Exception as error:
            self._fail_with(error)
            return False
        return True

    def _guard(self, work: Callable[[], object]) -> bool:
        """Run ``work`` (no collective); False, as :meth:`_dp`'s errors, if it raised."""
        try:
            work()
        except Exception as error:
            self._fail_with(error)
            return False
        return True

    def _guarded(self, work: Callable[[], int], default: int) -> int:
        result = [default]
        self._guard(lambda: result.__setitem__(0, work()))
        return result[0]

    def _read_joins(self) -> tuple[int, bool]:
        """The job's count of joins, read by the first slot after a step's collectives;
        ``(0, False)`` if the step fails here: this slot is cut off (:meth:`_ask`) or the
        request raised (this replica's error)."""
        try:
            joins = self._ask(lambda: int(self._store.add(self.keys.joins, 0)), "the joins")
        except Exception as error:
            self._fail_with(error)
            return 0, False
        return (0, False) if joins is None else (joins, True)

    def _ask(self, request: Callable[[], T], what: str) -> T | None:
        """A request to the job's store on the step's path, which never waits for a cut
        to heal (:meth:`SlotProbes.ask <scopedmesh.fault.probes.SlotProbes.ask>`). None
        once this slot found itself cut off: its dp group is let go of, so its replica's
        verdict fails (this step's, or the next), and the heal raises
        :class:`LostRankError` on every rank of the replica."""
        try:
            return self._probes.ask(
                request, what, timeout=self._timeout, replica=self.replica, token=self.token,
                current=self._current(),
            )  # fmt: skip
        except LostRankError as error:
            self.failure = f"epoch {self._current().epoch}: {error}"[:400]
            self._pg = None
            return None

    def _fail_with(self, error: Exception) -> None:
        self.failure = f"epoch {self._current().epoch}: {type(error).__name__}: {error}"[:400]
        self._error = self._error or error
        self._pg = None

    def _agree_token(self) -> str:
        """One random token for this incarnation of the replica, the same on its ranks."""
        value = torch.tensor(
            [int.from_bytes(os.urandom(7), "big")], dtype=torch.int64, device=self._device
        )
        src = 0 if self._group is None else dist.get_global_rank(self._group, 0)
        dist.broadcast(value, src=src, group=self._group)
        return f"{int(value[0]):x}"

    def _wait_or_fail(self, deadline: float, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"replica {self.replica}'s Replicas closed while waiting for {what}")
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"replica {self.replica} coordinate {self.coordinate}: waited {self._timeout:g} s "
                f"for {what}"
            )
        time.sleep(self._poll)

    def _check_finished(self) -> None:
        """A :class:`JobFinishedError` if the job ended (:meth:`finish`) before this
        incarnation was admitted."""
        text = read(self._store, self.keys.finished)
        if text is not None:
            raise JobFinishedError(
                f"replica {self.replica}: the job finished (its last epoch: {text}) before "
                f"this incarnation (token {self.token}) was admitted; nothing to rejoin: exit"
            )

    def _current(self) -> Decision:
        if self.decision is None:
            raise RuntimeError(f"replica {self.replica} has not joined yet: call boundary() first")
        return self.decision

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"replica {self.replica}'s Replicas is closed")
