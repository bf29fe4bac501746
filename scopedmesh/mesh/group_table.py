"""The group table a mesh and its sub-meshes share: one group per (ranks, backend).

A :class:`GroupTable` is what a tree of scopes shares (as trio's scopes share
a ``CancelStatus``), and what the views of a mesh share with it: the registry
``(ranks, backend) -> Entry``, the one lock its scopes take, torch's liveness
map, and formation, which calls :mod:`scopedmesh.c10d.groups` and words the
error when members do not meet. It knows no axis, no coordinate and no
lifetime: a scope (:mod:`scopedmesh.mesh.scope`) holds the entries it uses and
hands an entry back to :meth:`GroupTable.release` once no scope holds it.

>>> table = GroupTable()
>>> len(table), table.get((range(0, 2), "gloo")) is None
(0, True)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d import nccl as _nccl
from scopedmesh.c10d.diagnosis import Liveness
from scopedmesh.c10d.store import StoreUse
from scopedmesh.errors import GroupFormationError, MeshClosedError

__all__ = ["Entry", "GroupKey", "GroupTable", "formation_error"]

GroupKey = tuple[range | tuple[int, ...], str]  # (global ranks in group order, backend name)
FINISH_TIMEOUT = 60.0  # seconds to wait for a replaced mesh's NCCL work and gloo destructors


class Entry:
    """One group of a table; ``alive`` turns False when its last holder releases it, or
    when the table is aborted (a cached lookup then goes the slow way, which refuses).

    ``holds`` counts the open scopes that hold it (see :class:`~scopedmesh.mesh.scope.Scope`).
    A non-member's answer is an ``Entry`` too (``group`` None), never registered.
    """

    __slots__ = ("alive", "group", "holds", "key", "options")

    def __init__(self, key: GroupKey, group: dist.ProcessGroup | None, options: object) -> None:
        self.key = key
        self.group = group
        self.options = options
        self.alive = True
        self.holds = 0


class StandbyPool(Protocol):
    """Groups formed ahead of a death (:class:`scopedmesh.mesh.standby.Standby`)."""

    def take(self, key: GroupKey) -> dist.ProcessGroup | None:
        """The group for ``key``, now the caller's, or None."""
        ...

    def close(self) -> None:
        """Release every group held."""
        ...


class GroupTable:
    """The registry, lock and formation shared by a mesh and all its sub-meshes.

    ``lock`` is re-entrant: group formation, closing and sub-mesh bookkeeping of
    every scope over this table run one thread at a time. ``live`` is torch's
    map of live groups (read-only), kept here so that a cached lookup tests
    liveness with one ``in``. ``ordered`` says whether groups form with their
    members in mesh order (group rank ``k`` at position ``k``) or ascending.
    ``grace`` (None: 0.5 s) is how long a member waits for its peers before it
    announces what it waits for and looks for a deadlock or a dead peer.
    ``liveness`` is the liveness watch guarding the mesh, if any: the one that
    says which peers are lost (:meth:`LivenessWatch.guard
    <scopedmesh.fault.liveness.LivenessWatch.guard>` sets it). ``aborted`` says why
    the table was aborted (:meth:`abort`), ``""`` while it is not.
    ``fresh_communicators`` says that the table's groups must not derive from
    WORLD's communicator (a healed mesh's: WORLD holds the lost ranks), so
    they form by their own init over the store (:func:`scopedmesh.c10d.nccl.unsplit`).
    ``standby`` holds groups formed ahead of a death (:mod:`scopedmesh.mesh.standby`):
    a request whose group is there takes it instead of forming one.

    An abort's NCCL work runs off the caller's thread (:meth:`abort`), and so does the
    destroying of the aborted NCCL groups when :attr:`hand_over` is set (a heal's
    re-form: :func:`~scopedmesh.fault.heal.reform`), and the end of its gloo groups'
    destructors (each waits for its event loop's 10 ms tick); :attr:`inherited` is that
    work of the table this one replaced, which :meth:`finish` waits for when this
    table's mesh closes.
    """

    __slots__ = (
        "_adopted",
        "_dropping",
        "_entries",
        "_finishing",
        "_recorded",
        "_wakers",
        "abort_failures",
        "aborted",
        "fresh_communicators",
        "grace",
        "hand_over",
        "inherited",
        "live",
        "liveness",
        "lock",
        "ordered",
        "standby",
        "store_use",
    )

    def __init__(self, grace: timedelta | None = None) -> None:
        self._entries: dict[GroupKey, Entry] = {}
        self._adopted: list[dist.ProcessGroup] = []  # groups torch made for the table's scopes
        self._wakers: list[Callable[[], None]] = []  # formations' waits that an abort ends
        self._recorded = False  # whether this rank's process record is in the store
        self.grace = grace  # how long a member waits before it tells its peers what it waits for
        self.liveness: Liveness | None = None
        self.aborted = ""  # why the table was aborted; "" while it is not
        self.fresh_communicators = False  # True: never split a group from WORLD's (healed)
        self.abort_failures: list[Exception] = []  # what failed while aborting, first first
        self.lock = threading.RLock()
        self.live: Mapping[dist.ProcessGroup, object] = _c10d.live_groups()
        self.ordered = _c10d.keeps_member_order()
        self.store_use = StoreUse()  # whether a formation clones torch's store client
        self.standby: StandbyPool | None = None  # groups formed ahead for this table's requests
        self._finishing: list[threading.Thread] = []  # NCCL aborts, then destroys, oldest first
        self._dropping: list[threading.Thread] = []  # gloo destructors a hand-over left running
        self.hand_over = False  # True: leave destroys to threads the next table waits for
        self.inherited: list[threading.Thread] = []  # the replaced table's, for finish()
        self._record()

    def _record(self) -> None:
        """Write this rank's process record (one ``set``), so that a peer whose group waits
        for it can tell it runs, even if it never asks for a group (the diagnosis says
        "is alive and outside any group request" rather than listing likely causes).

        At the table's making (a root mesh's construction), not at its first formation:
        a rank that has formed nothing is the one a peer most needs to see. Not on the
        fake backend (one process, nobody to see it); a store that fails here is tried
        again at the first formation.
        """
        if self._recorded or not dist.is_initialized() or dist.get_backend() == "fake":
            return
        try:
            _c10d.record_process()
        except RuntimeError:  # the store is unreachable now: the first formation tries again
            return
        self._recorded = True

    def __len__(self) -> int:
        """The number of groups registered (formed and not yet released)."""
        return len(self._entries)

    def get(self, key: GroupKey) -> Entry | None:
        """The registered entry for ``key``, or None."""
        return self._entries.get(key)

    def is_live(self, entry: Entry) -> bool:
        """Whether ``entry``'s group is still registered with torch (a non-member's is)."""
        return entry.group is None or entry.group in self.live

    def form(
        self,
        key: GroupKey,
        options: Any,
        *,
        timeout: timedelta | None,
        what: str,
        description: str,
    ) -> Entry:
        """Make the group of ``key`` (this rank is a member) and register it.

        ``what`` names it in the error (``"axis 'tp'"``), ``description`` in
        torch's tools (``"scopedmesh:tp"``).
        A group that cannot be made raises :class:`GroupFormationError`; nothing
        is registered then; an abort (:meth:`abort`) while it forms stops it
        with :class:`MeshClosedError`, within a slice of its waits. The caller
        holds :attr:`lock`.
        """
        ranks, backend = key
        ready = self.standby.take(key) if self.standby is not None else None
        if ready is not None:  # formed before the death: nothing forms now
            entry = Entry(key, ready, options)
            self._entries[key] = entry
            return entry
        try:
            if not self._recorded and len(ranks) > 1 and backend != "fake":
                _c10d.record_process()  # once per table: peers can tell if this rank dies
                self._recorded = True
            group = _c10d.new_member_group(
                ranks,
                backend=backend,
                timeout=timeout,
                pg_options=options,
                description=description,
                what=what,
                grace=self.grace,
                liveness=self.liveness,
                store_use=self.store_use,
                aborted=self._why_aborted,
                on_abort=self.on_abort,
                unsplit=self.fresh_communicators,
            )
        except (GroupFormationError, MeshClosedError):  # diagnosed, or aborted while it formed
            raise
        except RuntimeError as error:
            raise formation_error(backend, what, ranks, timeout, error) from error
        entry = Entry(key, group, options)
        self._entries[key] = entry
        if self.aborted:  # aborted while it formed: shut it down like the others
            entry.alive = False
            if group is not None:
                self._shut_down([group])
        return entry

    def _why_aborted(self) -> str:
        """Why the table was aborted (``""`` while it is not): what a formation asks."""
        return self.aborted

    def on_abort(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake()`` at the next :meth:`abort` (a formation's wait ends then, from the
        aborting thread); returns the call that cancels it. Safe from any thread.

        ``wake`` is called only by an abort that sets :attr:`aborted` after this call; one
        that set it before is seen by the caller's next look at :attr:`aborted`.
        """
        self._wakers.append(wake)

        def cancel() -> None:
            with contextlib.suppress(ValueError):  # the abort took it already
                self._wakers.remove(wake)

        return cancel

    def abort(self, because: str) -> None:
        """Refuse every group of the table from now on; shut down or abort the groups it has.

        An abort is a state of the table, not an action on the groups of the
        moment (as a trio cancel scope is cancelled, not its tasks): a group
        formed earlier is shut down here, one forming now is shut down when its
        formation ends, and every later request, from any scope over the
        table, raises :class:`MeshClosedError` (so does a DeviceMesh made over
        one of them: ``Binding.check_open``). A gloo group is interrupted
        (``ClosableGroup.interrupt``); every other group, the groups torch made
        for the scopes' DeviceMeshes included (:meth:`adopt`), is aborted, all
        in one NCCL group call (:func:`scopedmesh.c10d.nccl.abort_groups`), so a
        collective blocked on one raises. ``because`` ends the sentence "... was
        shut down"; the first reason stays. Safe from any thread: it takes no
        lock (a formation may hold it) and never drops the last reference to a
        group in a collective. Every group is tried and nothing is raised here
        (a watch's thread goes on to its other meshes): a failure is kept in
        :attr:`abort_failures` and told, chained, by every later refusal
        (:meth:`check_not_aborted`).

        The NCCL aborts run on a thread of their own, started here: ``abort()``
        took 0.51 to 0.53 s per communicator on an H200 (NCCL 2.28.9), while the
        kernels in flight exited within 6 ms of its start and collectives on other
        communicators went on meanwhile (docs/GPU.md). The thread is not a daemon;
        :meth:`destroy` waits for it before it destroys an aborted group.
        """
        if not self.aborted:
            self.aborted = because
        entries = list(self._entries.values())
        for entry in entries:
            entry.alive = False  # the mesh's cached lookups go the slow way, which refuses
        held = [entry.group for entry in entries if entry.group is not None]
        self._shut_down([*held, *list(self._adopted)])
        wakers, self._wakers[:] = list(self._wakers), []
        for wake in wakers:  # the formations waiting now: each ends every member's wait
            try:
                wake()
            except Exception as error:  # kept like a group's: the other wakers still run
                self.abort_failures.append(error)

    def adopt(self, group: dist.ProcessGroup) -> None:
        """Shut ``group`` (made by torch for a scope of this table: a DeviceMesh's ``_flatten``
        or ``_unflatten``) down with the table's own on :meth:`abort`, at once if the table is
        aborted already; :meth:`destroy` forgets it. Safe from any thread, as ``abort`` is."""
        self._adopted.append(group)
        if self.aborted:  # aborted while torch made it
            self._shut_down([group])

    def check_not_aborted(self, what: object) -> None:
        """Raise :class:`MeshClosedError` naming ``what`` once the table is aborted (chained to
        the first failure of the abort itself, if any, and saying so)."""
        if self.aborted:
            failures = list(self.abort_failures)
            failed = (
                f" (aborting them failed too: {type(failures[0]).__name__}: {failures[0]})"
                if failures
                else ""
            )
            raise MeshClosedError(
                f"{what} was aborted: its groups were shut down {self.aborted}{failed}. Close it "
                "and re-form the survivors' mesh (LivenessWatch.heal, or agree_on_lost and reform)"
            ) from (failures[0] if failures else None)

    def release(self, entries: Iterable[Entry]) -> list[Exception]:
        """Unregister ``entries`` and destroy their groups, in the order given; no communication.

        Groups already destroyed behind the table's back are skipped. A failure
        does not stop the others; the failures are returned, first first. The
        caller holds :attr:`lock`.
        """
        groups: list[dist.ProcessGroup] = []
        for entry in entries:
            entry.alive = False
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            if entry.group is not None:
                groups.append(entry.group)
        return self.destroy(groups)

    def destroy(self, groups: Iterable[dist.ProcessGroup]) -> list[Exception]:
        """Destroy ``groups`` that torch made for a scope (never registered here), in the
        order given; no communication. Returns the failures, first first.

        Once the table is aborted, an NCCL group is destroyed only after its abort
        ended (a destroy racing the abort is the suspect of a heap corruption seen on
        an H200, docs/GPU.md): here, once the abort is over (:meth:`finish`), or, where
        :attr:`hand_over` is set, on a thread that waits for it (its failures go to
        :attr:`abort_failures`).
        """
        chosen = list(groups)
        for group in chosen:
            if group in self._adopted:
                self._adopted.remove(group)
        aborted = [g for g in chosen if self.aborted and _nccl.needs_abort(g)]
        if not aborted:
            return self._destroy_now(chosen)
        rest = [g for g in chosen if g not in aborted]
        if self.hand_over:
            self._then(functools.partial(_destroy_all, aborted), "scopedmesh-nccl-destroy")
            return self._destroy_now(rest)
        try:
            self.finish(own=True)
        except TimeoutError as error:  # the abort hangs: destroying now would race it
            return [error, *self._destroy_now(rest)]
        return self._destroy_now(chosen)

    def _destroy_now(self, groups: list[dist.ProcessGroup]) -> list[Exception]:
        """:func:`_destroy_all`, and the gloo destructors it leaves on threads waited for
        together, up to the closable groups' ``DROP_WAIT``, or, with :attr:`hand_over`,
        left to the table that replaces this one (:meth:`inherit`)."""
        dropping: list[threading.Thread] = []
        errors = _destroy_all(groups, dropping)
        if self.hand_over:
            self._dropping += dropping
        elif dropping:
            wait = sys.modules["scopedmesh.c10d.closable"].DROP_WAIT  # its groups left them
            if running := _nccl.join_within(dropping, wait):
                errors.append(
                    TimeoutError(
                        f"waited {wait:g} s for {len(running)} gloo group destructors "
                        f"({running[0].name}) to end; they go on on their threads"
                    )
                )
        return errors

    def inherit(self, replaced: GroupTable) -> None:
        """Take over the NCCL work and gloo destructors still running for ``replaced`` (whose
        mesh this table's replaced), for :meth:`finish`."""
        pending = [*replaced.inherited, *replaced._finishing, *replaced._dropping]
        self.inherited = [t for t in pending if t.is_alive()]  # not one more per heal

    def finish(self, *, own: bool = False, timeout: float = FINISH_TIMEOUT) -> None:
        """Wait for the work of the table this one replaced (:attr:`inherited`), and
        with ``own`` for this table's too (its NCCL aborts and destroys, and the gloo
        destructors a hand-over left running); ``TimeoutError`` naming what after
        ``timeout`` seconds."""
        threads = [*self.inherited, *([*self._finishing, *self._dropping] if own else [])]
        running = _nccl.join_within(threads, timeout)
        if running:
            raise TimeoutError(
                f"waited {timeout:g} s for {running[0].name} (the teardown of an aborted "
                "mesh's groups: NCCL's ProcessGroup.abort or destroy_process_group, or "
                "gloo's destructor) to end"
            )

    def _shut_down(self, groups: list[dist.ProcessGroup]) -> None:
        """Interrupt the closable gloo groups of ``groups`` here; abort the others (NCCL's,
        in one group call) on a thread (:meth:`abort`). Every group is tried; the
        failures go to :attr:`abort_failures`."""
        closable = sys.modules.get("scopedmesh.c10d.closable")  # loaded with the first gloo group
        others: list[dist.ProcessGroup] = []
        for group in groups:
            if closable is not None and isinstance(group, closable.ClosableGroup):
                group.interrupt(self.aborted)
            else:
                others.append(group)
        if any(_nccl.needs_abort(g) for g in others):
            self._then(functools.partial(_nccl.abort_groups, others), "scopedmesh-nccl-abort")

    def _then(self, work: Callable[[], list[Exception]], name: str) -> None:
        """Run ``work`` on a new thread (not a daemon: an interpreter's exit waits for it)
        once this table's earlier NCCL work ended; its failures go to :attr:`abort_failures`."""
        before = list(self._finishing)

        def run() -> None:
            for thread in before:
                thread.join()
            try:
                self.abort_failures.extend(work())
            except Exception as error:  # kept like a group's failure
                self.abort_failures.append(error)

        thread = threading.Thread(target=run, name=name)
        self._finishing.append(thread)
        thread.start()

    def groups(self) -> list[dist.ProcessGroup]:
        """The registered groups, oldest first, then those torch made for the table's scopes
        (:meth:`adopt`), without taking :attr:`lock`.

        For a liveness watch's thread, which must not wait for a formation that
        holds the lock (copying the registry is atomic under the GIL).
        """
        own = [entry.group for entry in list(self._entries.values()) if entry.group is not None]
        return own + list(self._adopted)


def _destroy_all(
    groups: list[dist.ProcessGroup], dropping: list[threading.Thread] | None = None
) -> list[Exception]:
    """Destroy each of ``groups`` (:func:`scopedmesh.c10d.groups.destroy`); the failures,
    first first. A failure does not stop the others. With ``dropping``, a closable gloo
    group's destructor may go on on a thread, added there (so that the groups' event
    loops' ticks are waited for together, not one after another)."""
    errors: list[Exception] = []
    for group in groups:
        try:
            _c10d.destroy(group, wait=dropping is None)
        except Exception as error:  # keep going: the other groups must still go
            errors.append(error)
    if dropping is not None:
        dropping += [t for t in map(_c10d.destroying, groups) if t is not None]
    return errors


# Words of torch's store and gloo's transport when members did not meet in time.
def formation_error(
    backend: str,
    what: str,
    ranks: Sequence[int],
    timeout: timedelta | None,
    error: RuntimeError,
) -> GroupFormationError:
    """The error for a group that could not be made, with the likely cause.

    Members that did not meet, a rank cut off from the store, and a backend that
    failed on its own (say, NCCL without a CUDA device) read differently. Told
    apart by type, never by torch's words: ``DistNetworkError`` is the store's
    connection; ``DistStoreError`` (a store wait that timed out) and any failure
    of a gloo group's construction (gloo raises a plain ``RuntimeError`` when its
    rendezvous or connections fail) are members that did not meet; anything else
    is the backend's own failure. ``tests/world/test_boundary.py`` pins the
    store's error types.

    >>> str(formation_error("nccl", "axis 'dp'", [0, 1], None, RuntimeError("no GPU")))
    "the nccl backend failed to make the process group along axis 'dp' over ranks [0, 1]: no GPU"
    >>> cut_off = dist.DistNetworkError("Connection timed out")  # the store's host went silent
    >>> print(formation_error("gloo", "axis 'dp'", [0, 2], None, cut_off))  # doctest: +NORMALIZE_WHITESPACE
    could not form the gloo process group along axis 'dp' over ranks [0, 2]: this rank lost
    its connection to torch's store (the store's host is unreachable or down, or the store is
    gone), so no group can form. torch said: Connection timed out
    """
    text = str(error)
    if isinstance(error, dist.DistNetworkError):  # the store's connection, not the members
        return GroupFormationError(
            f"could not form the {backend} process group along {what} over ranks "
            f"{list(ranks)}: this rank lost its connection to torch's store (the store's host "
            f"is unreachable or down, or the store is gone), so no group can form. torch said: "
            f"{text}"
        )
    if not (isinstance(error, dist.DistStoreError) or backend == "gloo"):
        return GroupFormationError(
            f"the {backend} backend failed to make the process group along {what} over "
            f"ranks {list(ranks)}: {text}"
        )
    waited = f" within {timeout}" if timeout is not None else ""
    return GroupFormationError(
        f"could not form the {backend} process group along {what} over ranks "
        f"{list(ranks)}{waited}. Likely cause: a member never requested this group, a member "
        "died, or members requested overlapping groups in different orders (every member "
        f"must request the same groups in the same order). torch said: {text}"
    )
