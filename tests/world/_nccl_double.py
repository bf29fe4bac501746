"""Stand-ins for NCCL on the CPU: a registered Python backend that records every abort,
and (below) a working stand-in for ``ProcessGroupNCCL`` that Replicas' dp groups use.

Each group of the ``nccl_double`` backend is a :class:`RecordingGroup`, its making
logged (``made``: one communicator's init). Its
``_get_backend(cuda)`` answers with a stand-in for ``ProcessGroupNCCL`` that has
``_group_start`` / ``_group_end`` (NCCL's group call; none with ``Log.group_call``
False, as torch 2.14+'s ``nccl2``), and its collectives stay
in flight until the group is aborted, then fail, as a collective on an
aborted NCCL communicator raises ``DistBackendError``. Every event goes to the
:class:`Log` given as the group's ``pg_options``, with the thread it ran on.
Nothing here is module state: the log travels with the mesh's options.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "nccl_double"


class Log:
    """Events ``(what, group name, thread ident)``, in the order they happened."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.thread_names: dict[int, str] = {}  # ident -> name, of the threads in events
        self._lock = threading.Lock()
        self._timeout: timedelta | None = None  # read by DeviceMesh as backend options
        self.looks_done = False  # whether an aborted collective looks done, as on NCCL
        self.group_call = True  # False: no NCCL group call, as torch 2.14+'s nccl2 has none
        # NCCL's abort: the kernels in flight exit at once, the teardown takes its time
        # (0.5 s on an H200), and a destroy meanwhile waits for it (torch's lock on the
        # communicator). Cleared, an abort's teardown lasts until it is set again.
        self.teardown = threading.Event()
        self.teardown.set()

    def add(self, what: str, name: str) -> None:
        with self._lock:
            self.events.append((what, name, threading.get_ident()))
            self.thread_names[threading.get_ident()] = threading.current_thread().name

    def copy(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return list(self.events)


class GroupCall:
    """What ``ProcessGroupNCCL`` offers for one NCCL group call around several aborts."""

    def __init__(self, log: Log) -> None:
        self._log = log

    def _group_start(self) -> None:
        self._log.add("group_start", "")

    def _group_end(self) -> None:
        self._log.add("group_end", "")


class PendingWork(dist.Work):
    """A collective in flight until its group is aborted; then it has failed."""

    def __init__(self, aborted: threading.Event) -> None:
        super().__init__()
        self._aborted = aborted

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() or 60.0
        if not self._aborted.wait(seconds):
            raise TimeoutError(f"the double's collective was not aborted within {seconds} s")
        raise RuntimeError("the double's communicator was aborted")

    def is_completed(self) -> bool:
        return self._aborted.is_set()

    def is_success(self) -> bool:
        return False

    def exception(self) -> Any:
        return RuntimeError("aborted") if self._aborted.is_set() else None


class LooksDoneWork(PendingWork):
    """What NCCL gives for a collective its abort cut short: the kernel exits early, and
    ``wait()`` returns normally over whatever the cut left in the buffer."""

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() or 60.0
        if not self._aborted.wait(seconds):
            raise TimeoutError(f"the double's collective was not aborted within {seconds} s")
        return True

    def is_success(self) -> bool:
        return self._aborted.is_set()

    def exception(self) -> Any:
        return None


class RecordingGroup(dist.ProcessGroup):
    """One group of the double: records ``abort``; its collectives wait for it."""

    def __init__(self, rank: int, size: int, log: Log) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._log = log
        self._aborted = threading.Event()
        self._call = GroupCall(log)
        self._name = ""
        self._desc = ""

    def abort(self) -> None:
        self._log.add("abort", self._name)
        self._aborted.set()  # the kernels in flight exit
        if not self._log.teardown.wait(60):
            raise TimeoutError("the double's abort: its teardown was never let go (60 s)")
        self._log.add("abort_done", self._name)

    def shutdown(self) -> None:
        self._aborted.set()
        if not self._log.teardown.wait(20):  # torch's lock on the communicator
            raise TimeoutError(f"the double's group {self._name} was destroyed during its abort")
        self._log.add("shutdown", self._name)

    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        if self._log.looks_done:
            return LooksDoneWork(self._aborted)
        return PendingWork(self._aborted)

    def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
        return PendingWork(self._aborted)

    def _get_backend(self, device: torch.device) -> Any:
        if device.type == "cuda" and self._log.group_call:
            return self._call
        raise RuntimeError(f"no backend for {device}")

    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]


def _make(options: Any, log: Any) -> RecordingGroup:
    if not isinstance(log, Log):
        raise TypeError(f"the {BACKEND} backend needs a Log as pg_options, got {log!r}")
    log.add("made", str(options.group_id))  # one communicator's init, as NCCL would pay it
    return RecordingGroup(options.group_rank, options.group_size, log)


def register() -> None:
    """Register the double with torch (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _make, extended_api=True, devices=["cpu"])


def wait_for(condition: Any, seconds: float, what: str) -> None:
    """Poll ``condition()`` until true, or raise ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s for {what}")
        time.sleep(0.005)


# ------------------------------------------------------------------ a working stand-in


class StandInOptions:
    """What ``ProcessGroupNCCL.Options()`` offers the library."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream


class StandInWork:
    """One operation of the stand-in: done once its gloo operation succeeded (a thread
    waits for it: gloo's send and receive complete only inside ``wait``). One whose
    peer died or dropped the group never completes (NCCL's kernel waits for the peer)
    until the stand-in is aborted; then it looks done (``wait`` returns normally), as a
    collective an abort cut short does on NCCL."""

    def __init__(self, inner: Any, aborted: threading.Event) -> None:
        self._aborted = aborted
        self._ok = threading.Event()

        def wait() -> None:
            try:
                inner.wait()
            except RuntimeError:  # the peer is gone: on NCCL nothing would complete
                return
            self._ok.set()

        threading.Thread(target=wait, name="stand-in-work", daemon=True).start()

    def is_completed(self) -> bool:
        return self._aborted.is_set() or self._ok.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        deadline = time.monotonic() + 60.0
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("the stand-in's NCCL operation waited 60 s: nothing aborted it")
            time.sleep(0.001)
        return True


def nccl_stand_in(events: list[tuple[Any, ...]], teardown: threading.Event | None = None) -> type:
    """A class to put in place of ``torch.distributed.ProcessGroupNCCL`` in one rank
    process, over gloo on the CPU, that behaves as NCCL where the library must care:

    - its constructor connects nothing: ``eager_connect_single_device`` (or the first
      operation) forms the gloo group over the store it was given, and records
      ``("init", rank, size, n)``, ``n`` counting the inits over that store (an
      epoch's own store sees at most its ``size``);
    - an operation a dead or departed peer never joins never completes, until
      ``abort()`` (recorded); then it looks done;
    - each tensor it sends (``send``, or ``broadcast`` from the root) is recorded with
      its storage address: ``("sent", data_ptr, nbytes)``;
    - with ``teardown``, ``abort()`` ends its operations at once, then "tears down"
      until ``teardown`` is set (NCCL's took 0.5 s on an H200), recorded as
      ``("abort_done", rank, size, thread name)``.

    It has no ``split``: a formation that tried to derive from another communicator
    would fail. ``events`` (the caller's list) receives the records.
    """
    lock = threading.Lock()

    def record(*event: Any) -> None:
        with lock:
            events.append(event)

    class StandIn:
        Options = StandInOptions

        def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
            if not isinstance(options, StandInOptions):
                raise TypeError(f"ProcessGroupNCCL takes Options, got {options!r}")
            self._store, self._rank, self._size = store, rank, size
            self._inner: Any = None
            self._aborted = threading.Event()

        def eager_connect_single_device(self, device: torch.device | None) -> None:
            if self._inner is None:
                n = self._store.add("nccl-stand-in/inits", 1)
                self._inner = dist.ProcessGroupGloo(
                    self._store, self._rank, self._size, timedelta(seconds=10)
                )
                record("init", self._rank, self._size, n)

        def abort(self) -> None:
            record("abort", self._rank, self._size)
            self._aborted.set()
            if teardown is not None:
                if not teardown.wait(60):
                    raise TimeoutError("the stand-in's teardown was not let go of within 60 s")
                name = threading.current_thread().name
                record("abort_done", self._rank, self._size, name)

        def _run(self, call: Any) -> StandInWork:
            if self._aborted.is_set():
                raise RuntimeError("the stand-in's communicator was aborted")
            self.eager_connect_single_device(None)
            return StandInWork(call(self._inner), self._aborted)

        def allreduce(self, tensors: list[torch.Tensor], options: Any) -> StandInWork:
            return self._run(lambda g: g.allreduce(tensors, options))

        def broadcast(self, tensors: list[torch.Tensor], options: Any) -> StandInWork:
            if options.rootRank == self._rank:
                for t in tensors:
                    record("sent", t.data_ptr(), t.numel() * t.element_size())
            return self._run(lambda g: g.broadcast(tensors, options))

        def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> StandInWork:
            for t in tensors:
                record("sent", t.data_ptr(), t.numel() * t.element_size())
            return self._run(lambda g: g.send(tensors, peer, tag))

        def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> StandInWork:
            return self._run(lambda g: g.recv(tensors, peer, tag))

    return StandIn
