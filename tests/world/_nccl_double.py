"""A stand-in for NCCL on the CPU: a registered Python backend that records every abort.

Each group of the ``nccl_double`` backend is a :class:`RecordingGroup`. Its
``_get_backend(cuda)`` answers with a stand-in for ``ProcessGroupNCCL`` that has
``_group_start`` / ``_group_end`` (NCCL's group call), and its collectives stay
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
        self._lock = threading.Lock()
        self._timeout: timedelta | None = None  # read by DeviceMesh as backend options
        self.looks_done = False  # whether an aborted collective looks done, as on NCCL

    def add(self, what: str, name: str) -> None:
        with self._lock:
            self.events.append((what, name, threading.get_ident()))

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
        self._aborted.set()

    def shutdown(self) -> None:
        self._aborted.set()

    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        if self._log.looks_done:
            return LooksDoneWork(self._aborted)
        return PendingWork(self._aborted)

    def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
        return PendingWork(self._aborted)

    def _get_backend(self, device: torch.device) -> Any:
        if device.type == "cuda":
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
