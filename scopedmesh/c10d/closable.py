"""Gloo groups that a closing mesh really shuts: their sockets and threads go, later use raises.

torch's gloo backend has no shutdown (its ``abort`` and ``shutdown`` do
nothing), and a ``ProcessGroup`` keeps its backend alive for as long as any
handle to it lives. So a handle kept past its mesh's scope (the common
``self.tp_group = mesh.get_group_along_axis("tp")``) kept 5 file descriptors
and 3 threads per 2-rank group and went on working. The handle a mesh gives
out for a gloo group is therefore a :class:`ClosableGroup`: a Python
``ProcessGroup`` that forwards every operation to a plain gloo group it owns.
:meth:`ClosableGroup.release` drops that inner group, so torch's destructor
closes its sockets and joins its threads, and any later operation raises
:class:`~scopedmesh.errors.MeshClosedError` at once. Releasing is local: no
message goes to a peer.

torch calls :func:`make_closable_gloo` through its custom-backend registry
(``register()``), so the group is named and registered exactly as a gloo group
would be; :func:`~scopedmesh.c10d.groups.new_member_group` then records it as gloo.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from scopedmesh.c10d.gloo_sockets import Connections, open_descriptors
from scopedmesh.errors import MeshClosedError

__all__ = [
    "BACKEND",
    "ClosableGroup",
    "HandedOutBackend",
    "Handle",
    "make_closable_gloo",
    "register",
    "supported",
]

# The name of the backend in torch's registry. torch records it for the group;
# new_member_group replaces that record with "gloo", which is what the group is.
BACKEND = "scopedmesh_gloo"

# Every operation of ``ProcessGroup`` that moves data, synchronises or reaches the
# backend, under each name some torch release uses for it (Python callers use the
# bound names; the C++ trampoline looks the newer ones up, then the older ones).
# Names this torch lacks are skipped; ``tests/unit/test_closable.py`` checks that every
# operation this torch has is here.
FORWARDED = (
    "_allgather_base",
    "_reduce_scatter_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "all_to_all_single",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "barrier",
    "broadcast",
    "gather",
    "gather_into_tensor",
    "gather_single",
    "get_backend",
    "get_reconfigure_handle",
    "monitored_barrier",
    "new_window",
    "reconfigure",
    "recv",
    "recv_anysource",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "register_abort_hook",
    "register_post_hook",
    "register_pre_hook",
    "scatter",
    "send",
    "set_timeout",
    "supports_abort_hooks",
    "supports_completion_hooks",
    "supports_reconfigure",
    "supports_window",
    "unregister_abort_hook",
    "unregister_post_hook",
    "unregister_pre_hook",
)


class Handle(dist.Work):
    """What a collective on a :class:`ClosableGroup` returns: gloo's work, let go of in time.

    A gloo work holds its group's connections (its gloo context). Were the
    work kept after its collective failed, the connections to every other
    member would stay open, and a member waiting on this rank would wait for
    the collective's timeout: the exception a failed ``dist.all_reduce`` raises
    keeps that work alive through its traceback (``all_reduce``'s frame), for as
    long as the caller handles it (say, while it heals inside its ``except``
    block). So the handle lets go of the work once a wait on it has failed, and
    whenever its group closes (:meth:`ClosableGroup.release`, :meth:`~ClosableGroup.settle`).

    A handle let go of is completed, and reports the collective as it stood
    then: one that had completed successfully still does (``wait`` returns
    ``True``, its future holds the result); any other never will. Its ``wait``
    raises :class:`~scopedmesh.errors.MeshClosedError` saying why the group was
    shut down (chained to gloo's error, where gloo had one), ``is_success`` is
    False and its future never resolves as a success, so a buffer the collective left
    half-written is never passed off as its result.
    """

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._verdict = _Verdict()  # how it ended, once that is decided (shared with the future)
        self._future: Any = None  # the future given out, if any
        self._failure = ""  # "<type>: <message>" of the failed wait that let go of the work

    def busy(self) -> bool:
        """Whether the collective is still in flight (its group must not close under it)."""
        work = self._work
        return work is not None and not work.is_completed()

    def let_go(self, because: str = "its process group was shut down") -> None:
        """Drop gloo's work (and with it this handle's hold on the group's connections).

        ``because`` says why, for a collective that had not completed successfully.
        The verdict is recorded before the work is dropped: a caller on another
        thread that finds no work (``is_completed``, then ``wait``) must find how
        it ended, never an undecided handle that ``wait`` would report as done.
        """
        work = self._work
        if work is not None:
            self._verdict.decide(work, because)  # idempotent: a second let-go keeps the first
        self._work = None
        del work  # the last reference may be this frame's: gloo's work goes here

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:  # torch's default
        """Wait for the collective; on failure, let go of the work, then raise."""
        work = self._work
        if work is None:
            if self._failure:
                raise RuntimeError(f"this collective failed earlier: {self._failure}")
            self._verdict.check()
            return True
        try:
            done = bool(work.wait(timeout))
        except BaseException as error:
            if work.is_completed():  # failed, not merely timed out: nothing is in flight
                self._failure = f"{type(error).__name__}: {error}"
                self._work = None
            raise
        finally:
            del work  # the traceback keeps this frame: it must not keep the work
        self._verdict.check()  # let go of (its group closed) while this thread waited
        return done

    def is_completed(self) -> bool:
        """Whether the collective has ended (a handle let go of has)."""
        work = self._work
        return work is None or work.is_completed()

    def is_success(self) -> bool:
        """Whether the collective ended without an error (let go of: whether it had)."""
        work = self._work
        if work is None:
            return not self._failure and self._verdict.error is None
        return work.is_success()

    def exception(self) -> Any:
        """gloo's error while the work is held; once let go of, why it did not succeed."""
        work = self._work
        return self._verdict.error if work is None else work.exception()

    def get_future(self) -> Any:
        """A future of the collective's result that resolves as :meth:`wait` reports it.

        Once let go of, the future holds the error a later ``wait`` raises,
        even if gloo's own future ends well after the group was shut down.
        """
        if self._future is None:
            work = self._work
            if work is None and not self._verdict.decided:
                work = self._held()  # let go of after a failed wait: nothing to tell
            self._future = self._verdict.future(work)
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensors, while the work is held."""
        return self._held().result()

    def source_rank(self) -> int:
        """The sender of a ``recv_anysource``, while the work is held."""
        return self._held().source_rank()

    def synchronize(self) -> None:
        """Nothing to synchronise on CPU once let go of."""
        work = self._work
        if work is not None:
            work.synchronize()

    def _held(self) -> dist.Work:
        work = self._work
        if work is None:
            raise MeshClosedError(
                "this collective's work was let go of (it failed, or its group was shut down)"
                + (f": {self._failure}" if self._failure else "")
            )
        return work


class _Verdict:
    """How a collective ended, as its :class:`Handle` reports it once gloo's work is gone.

    Decided once, by whichever comes first: the handle letting go of the work
    (:meth:`decide`), or gloo's future ending (the callback of :meth:`future`).
    It holds no gloo work (gloo's future keeps the callback, and so this),
    only the result or the error.
    """

    __slots__ = ("decided", "error", "lock", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.decided = False
        self.error: BaseException | None = None  # why it did not succeed
        self.value: Any = None  # gloo's future, done, if it succeeded before being let go of

    def decide(self, work: dist.Work, because: str) -> None:
        """Decide from ``work`` as it stands: completed successfully, or failed ``because``."""
        ended, cause = _ending(work)
        with self.lock:
            if self.decided:
                return
            self.decided = True
            if ended:
                self.value = work.get_future()
                return
            error = MeshClosedError(
                f"this collective did not complete: {because}; its output buffers hold no "
                "result (re-form the survivors' mesh and run it again)"
            )
            error.__cause__ = cause
            self.error = error

    def check(self) -> None:
        """Raise the error that ended the collective, if it was decided that one did."""
        error = self.error
        if error is not None:
            raise MeshClosedError(str(error)) from error.__cause__

    def future(self, work: dist.Work | None) -> Any:
        """A future that resolves as the handle reports: from gloo's while ``work`` is held."""
        source = self.value if work is None else work.get_future()
        if source is None:  # decided as failed before the future was asked for
            failed: Any = torch.futures.Future()
            failed.set_exception(self.failure())
            return failed
        return source.then(self._resolve)

    def failure(self) -> MeshClosedError:
        """A fresh copy of the error (each raise gets its own traceback)."""
        error = self.error
        if error is None:
            raise RuntimeError("no failure was decided")  # internal: callers check first
        copy = MeshClosedError(str(error))
        copy.__cause__ = error.__cause__
        return copy

    def _resolve(self, source: Any) -> Any:
        """gloo's future ended: its value, unless the collective was decided failed first.

        Success decides (a later let-go keeps it); gloo's error does not: it
        reaches this future as is, and a later let-go words it as :meth:`decide` does.
        """
        if self.error is not None:
            raise self.failure()
        value = source.value()  # raises gloo's error if its collective failed
        with self.lock:
            if not self.decided:
                self.decided, self.value = True, source
            elif self.error is not None:  # decided failed meanwhile: the handle says so
                raise self.failure()
        return value


def _ending(work: dist.Work) -> tuple[bool, BaseException | None]:
    """(True, None) if ``work`` completed successfully; else (False, gloo's error or None).

    ``wait`` on a completed work returns at once, or raises its error (torch's
    ``exception`` and ``is_success`` are deprecated and warn).
    """
    if not work.is_completed():
        return False, None
    try:
        work.wait()
    except Exception as error:
        return False, error.with_traceback(None)  # this frame holds the work: drop it
    return True, None


class ClosableGroup(dist.ProcessGroup):
    """A gloo group whose connections end when :meth:`release` is called.

    Every collective's work is given out as a :class:`Handle` and remembered
    while in flight, so :meth:`interrupt` knows, on any thread and at any
    moment, whether closing the connections now would wait for a collective.

    >>> issubclass(ClosableGroup, dist.ProcessGroup)
    True
    """

    def __init__(self, inner: dist.ProcessGroup, connections: Connections | None = None) -> None:
        # torch's stubs list only (store, rank, size); (rank, size) holds no store.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self._inner: dist.ProcessGroup | None = inner
        # The inner group's sockets, shut at once when an abort closes it idle.
        self._connections = connections if connections is not None else Connections([])
        # gloo's destructor after an interrupt or a settle; set and read under the lock
        self._dropping: threading.Thread | None = None
        self._held: dist.ProcessGroup | None = None  # interrupted while busy: kept until settled
        self._handles: list[Handle] = []  # the handles of collectives in flight, as last seen
        self._given: weakref.WeakSet[Handle] = weakref.WeakSet()  # every handle still kept
        self._calls = 0  # operations between taking the inner group and recording their work
        self._lock = threading.Lock()  # guards the three above against interrupt()'s thread
        self._released_because = ""
        self._name = ""
        self._desc = ""

    def inner(self) -> dist.ProcessGroup:
        """The plain gloo group underneath; ``MeshClosedError`` once released."""
        inner = self._inner
        if inner is None:
            raise MeshClosedError(
                f"process group {self.group_name!r} was shut down {self._released_because}; "
                "a handle kept past its mesh's scope cannot communicate: take the group "
                "from an open mesh"
            )
        return inner

    def release(self, because: str = "when its mesh closed", *, wait: bool = True) -> bool:
        """Drop the inner group: its sockets close and its threads end (local, idempotent).

        Later operations raise :class:`~scopedmesh.errors.MeshClosedError` at once.
        An idle group's connections are shut first (every peer learns at once,
        not pair by pair as gloo's destructor reaches each), then the group is
        dropped here (gloo's destructor waits for a collective in flight, and
        for its event loop's next tick: about 10 ms) and True is returned. With
        ``wait=False`` an idle group is dropped on a thread instead
        (:attr:`dropping`), so that a caller closing many groups waits for their
        ticks once, not once per group; False is returned while that thread
        runs. A group :meth:`interrupt` held (its mesh was aborted while a
        collective was in flight, and it has not ended in gloo yet) is dropped
        on a thread of its own, which ends when the collective does (it fails as
        its peers' connections close, at the latest at the group's timeout), and
        False is returned. A group an abort shut while idle is being destroyed on a
        thread since (:meth:`interrupt`): that thread is waited for (unless
        ``wait=False``), up to :data:`DROP_WAIT` seconds (False past it). A
        mesh's close is the one caller: a heal's re-form never waits for a
        collective the death left behind.
        """
        with self._lock:
            if self._inner is not None:
                self._released_because = because
            busy = self._busy()
            held_busy = self._held is not None and busy
            if not busy:
                self._connections.shut()
            handles, self._handles = list(self._given), []
            box = [group for group in (self._inner, self._held) if group is not None]
            self._inner = self._held = None
            self._let_go(handles)
            if box and not (wait or busy):
                self._dropping, box = _drop_on_a_thread(box), []  # the thread's list now
            dropping = self._dropping
        if held_busy:
            _drop_on_a_thread(box)
            return False
        box.clear()  # if not dropped on a thread: the last references, gloo's destructor here
        if dropping is None:
            return True
        if wait:
            dropping.join(DROP_WAIT)
        return not dropping.is_alive()

    @property
    def dropping(self) -> threading.Thread | None:
        """The thread on which gloo's destructor of this group still runs (started by an
        abort, a settle, or a ``release(wait=False)``), or None. A group :meth:`interrupt`
        held and still busy at its release is dropped on a thread not recorded here: it
        ends with the collective, which nobody waits for."""
        with self._lock:
            thread = self._dropping
        return thread if thread is not None and thread.is_alive() else None

    def interrupt(self, because: str) -> bool:
        """Shut the group down from another thread, without waiting for a collective on it.

        Later operations raise :class:`~scopedmesh.errors.MeshClosedError` at once.
        If no collective is in flight, the connections are shut now, so peers
        blocked in a collective with this rank raise at once, and the group is
        dropped on a thread of its own (gloo's destructor waits for its event
        loop's ticks); returns True. Otherwise gloo's destructor would wait for
        that collective, so the group is held and False is returned: the
        collective in flight ends (it completes, or fails when a peer's
        connections close), and then :meth:`settle` shuts the connections.
        Local, idempotent; it never waits.
        """
        with self._lock:
            inner = self._inner
            if inner is None:
                return self._held is None
            self._released_because = because
            self._inner = None
            if self._busy():
                self._held = inner
                return False
            box = [inner]
            del inner
            self._close_idle(box)
        return True

    def settle(self) -> bool:
        """Close a group :meth:`interrupt` held, once the collectives in flight have ended.

        A held group whose collective has completed (or failed) is idle, and
        nothing new can start on it; were it kept open until its mesh closes,
        a peer that went on to its next collective on this group would wait for
        the group's timeout (and a survivor's agreement for that peer with it).
        Returns whether the group is now closed (True when nothing is held).
        Local, idempotent; a liveness watch calls it every interval for the
        meshes it guards.
        """
        with self._lock:
            held = self._held
            if held is None:
                return True
            if self._busy():
                return False
            self._held = None
            box = [held]
            del held
            self._close_idle(box)
        return True

    def _close_idle(self, box: list[dist.ProcessGroup]) -> None:
        """Close the idle group ``box`` holds the last reference to, under the lock, which
        the caller holds: let go of its handles, shut its connections (every peer learns
        now, not as gloo's destructor gets there) and drop it on a thread that
        :meth:`release` joins."""
        handles, self._handles = list(self._given), []
        self._let_go(handles)
        self._connections.shut()
        self._dropping = _drop_on_a_thread(box)

    def _let_go(self, handles: list[Handle]) -> None:
        """Let go of ``handles`` under the lock, which the caller holds: a ``settle`` or
        ``interrupt`` on another thread that finds the group closed returns only once every
        handle says how its collective ended. Nothing here waits (gloo's work has ended,
        or is not asked to: ``_ending``), and no other lock is taken but each verdict's."""
        for handle in handles:
            handle.let_go(self._shut_down())

    def _shut_down(self) -> str:
        """Why a collective cut short by the shutdown did not complete."""
        return f"process group {self._name!r} was shut down {self._released_because}"

    def busy(self) -> bool:
        """Whether a collective on this group is in flight (or being started)."""
        with self._lock:
            return self._busy()

    def _busy(self) -> bool:
        self._handles = [handle for handle in self._handles if handle.busy()]
        return self._calls > 0 or bool(self._handles)

    def _enter(self) -> dist.ProcessGroup:
        with self._lock:
            inner = self.inner()
            self._calls += 1
        return inner

    def _leave(self, result: Any) -> Any:
        with self._lock:
            self._calls -= 1
            if isinstance(result, dist.Work):
                result = Handle(result)
                self._handles = [handle for handle in self._handles if handle.busy()]
                self._handles.append(result)
                self._given.add(result)
        return result

    def __repr__(self) -> str:
        # torch names a group it no longer knows by its repr ("Process group {pg}
        # is not initialized ..."): say what happened to it.
        if self._inner is None:
            return f"<scopedmesh group {self._name!r}, shut down {self._released_because}>"
        return f"<scopedmesh group {self._name!r}, gloo, rank {self.rank()} of {self.size()}>"

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run."""
        return self._inner is None

    # torch's C++ side reads these through its trampoline, under their C++ names. A
    # plain ProcessGroup keeps its name on its backends; this one has none of its own.
    def getBackendName(self) -> str:
        """Not "gloo": C++ code that reads "gloo" casts the registered backend to gloo's class.

        ``dist.get_backend(group)`` still says ``"gloo"``: the group runs on gloo.
        """
        return BACKEND

    def getGroupName(self) -> str:
        """The group's name (torch's ``group_name``)."""
        return self._name

    def setGroupName(self, name: str) -> None:
        """Set the name, here and on the inner group."""
        self._name = name
        if self._inner is not None:
            self._inner._set_group_name(name)  # type: ignore[arg-type]  # GroupName is a str

    def getGroupDesc(self) -> str:
        """The group's description (torch's ``group_desc``)."""
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        """Set the description, here and on the inner group."""
        self._desc = desc
        if self._inner is not None:
            self._inner._set_group_desc(desc)

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: torch.device) -> Any:  # a HandedOutBackend
        """The gloo backend for ``device``, as a stand-in that is refused once the group is
        shut down (:class:`HandedOutBackend`); torch's error for a device it lacks."""
        self.inner()._get_backend(device)  # RuntimeError for a device it has no backend for
        return HandedOutBackend(self, device)

    def _start_coalescing(self, device: torch.device) -> None:
        self.inner()._start_coalescing(device)

    def _end_coalescing(self, device: torch.device) -> Any:
        return self.inner()._end_coalescing(device)

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    def split_group(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not supported: torch would split the stand-in backend, not the gloo group."""
        raise NotImplementedError(
            f"{self!r} does not split or merge: ask its mesh for the group you need "
            "(get_group_along_axis, submesh)"
        )

    # The C++ names too: torch's trampoline looks those up.
    splitGroup = merge_remote_group = mergeRemoteGroup = split_group


def _drop_on_a_thread(box: list[dist.ProcessGroup]) -> threading.Thread | None:
    """Empty ``box``, which holds the last references to gloo groups, on a new thread: gloo's
    destructor runs there. The thread is not a daemon: the process waits for it at exit (a
    gloo group destroyed as the interpreter ends aborts the process: ``terminate called
    without an active exception``). Where no thread can start (the interpreter is ending),
    ``box`` is emptied here and None is returned."""
    thread = threading.Thread(target=box.clear, name="scopedmesh-gloo-close", daemon=False)
    try:
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        box.clear()
        return None
    return thread


class HandedOutBackend:
    """A :class:`ClosableGroup`'s gloo backend as ``_get_backend`` hands it out.

    Every attribute is looked up on the group's gloo backend at the moment of
    use, and its operations count as in flight on the group (their works are
    :class:`Handle` s), so it holds no socket of its own and is refused, with
    :class:`~scopedmesh.errors.MeshClosedError`, once the group is shut down
    (closed with its mesh, or aborted). torch's own callers (FSDP2's
    ``ProcessGroupAllocMixin``, ``_time_estimator``, ``shrink_group``) read
    attributes of it; gloo's backend itself, kept by a caller, would keep the
    group's connections open and go on communicating after an abort.
    """

    __slots__ = ("_device", "_group")

    def __init__(self, group: ClosableGroup, device: torch.device) -> None:
        self._group = group
        self._device = device

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._group.inner()._get_backend(self._device), name)
        if not callable(attribute):
            return attribute
        del attribute  # the backend itself: not kept past this call
        group, device = self._group, self._device

        def call(*args: Any, **kwargs: Any) -> Any:
            inner = group._enter()  # counted as in flight until its work is recorded
            result = None
            try:
                result = getattr(inner._get_backend(device), name)(*args, **kwargs)
            finally:
                del inner  # a traceback through this frame must not keep the group
                result = group._leave(result)
            return result

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"<gloo backend of {self._group!r}>"


def _forward(name: str) -> Any:
    """``name`` of the inner gloo group: a method or a property, as ``ProcessGroup`` has it."""

    def forward(self: ClosableGroup, *args: Any, **kwargs: Any) -> Any:
        inner = self._enter()  # counted as in flight until its work is recorded
        result = None
        try:
            result = getattr(inner, name)(*args, **kwargs)
        finally:
            del inner  # a traceback through this frame must not keep the group
            result = self._leave(result)
        return result

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` of the inner gloo group; ``MeshClosedError`` once released."
    if isinstance(vars(dist.ProcessGroup)[name], property):
        return property(lambda self: getattr(self.inner(), name), doc=forward.__doc__)
    return forward


for _name in FORWARDED:
    if _name in vars(dist.ProcessGroup):
        setattr(ClosableGroup, _name, _forward(_name))
del _name


# How long a close waits for gloo's destructors (about 10 ms each: gloo's event loop ends
# at its next tick), a group's own or a mesh's together; past it, the close returns and
# the threads go on.
DROP_WAIT = 10.0

# The device the stand-in is registered for: one whose ``c10d::`` ops never reach a
# backend (torch's meta kernels make a fake work without asking the group), so that
# no tensor's op finds the stand-in; an op on CPU tensors finds no backend and raises.
STAND_IN_DEVICE = "meta"


def _stand_in(rank: int, size: int) -> Any | None:
    """A backend that holds nothing, for look-ups by type; ``None`` if torch has none.

    torch's C++ side looks a group's backend up by type for bookkeeping (DDP's
    logger asks for it); the operations themselves reach the Python methods
    above. The stand-in answers the look-ups. It is torch's fake backend with
    ``error_on_collective``, which raises on a collective but does nothing in
    ``send``, ``recv`` and ``recvAnysource`` (their work reports success, the
    buffer untouched), so it is registered for :data:`STAND_IN_DEVICE`, not for
    the CPU: a C++ path (``torch.ops.c10d``) that sends an operation on CPU
    tensors to the group finds no backend and raises, point-to-point included.

    >>> stand_in = _stand_in(0, 2)
    >>> stand_in is None or type(stand_in).__name__ == "FakeProcessGroup"
    True
    """
    fake: Any = getattr(torch._C._distributed_c10d, "FakeProcessGroup", None)
    options = fake.Options() if fake is not None else None
    if options is None or not hasattr(options, "error_on_collective"):
        return None
    options.error_on_collective = True
    return fake._create_internal(rank, size, options)


def make_closable_gloo(options: Any, backend_options: object | None = None) -> ClosableGroup:
    """torch's custom-backend creator (extended API): a gloo group, wrapped to be closable.

    ``options`` carries what torch's own gloo branch uses: the store (already
    prefixed with the group's name and device), the member's group rank, the
    group size, the timeout, the group's name and its global ranks.
    """
    store, group_rank, group_size = options.store, options.group_rank, options.group_size
    before = open_descriptors()
    backend = dist.ProcessGroupGloo(store, group_rank, group_size, options.timeout)
    connections = Connections.find(before, size=group_size)  # those of the loop it made
    # What torch's own gloo branch sets on the options, where this torch has them.
    with contextlib.suppress(AttributeError):
        backend.options.global_ranks_in_group = options.global_ranks_in_group
        backend.options.group_name = options.group_id
    backend._set_sequence_number_for_group()
    inner = dist.ProcessGroup(store, group_rank, group_size)
    inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group = ClosableGroup(inner, connections)
    stand_in = _stand_in(group_rank, group_size)  # register() made sure this torch has one
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    device = torch.device(STAND_IN_DEVICE)  # never "cpu": see _stand_in
    group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, stand_in)
    return group


def register() -> str | None:
    """Register :data:`BACKEND` with torch once per process and return its name.

    ``None`` on a torch without the stand-in backend: there a mesh's gloo groups
    are torch's own, as before.
    """
    if BACKEND.upper() not in dist.Backend._plugins:
        if _stand_in(0, 1) is None:
            return None
        dist.Backend.register_backend(
            BACKEND, make_closable_gloo, extended_api=True, devices=["cpu"]
        )
    return BACKEND


def supported() -> bool:
    """Whether this torch lets a mesh's gloo groups be closable."""
    return register() is not None
