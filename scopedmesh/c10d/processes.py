"""Who a rank's process is, and whether it still runs: what the diagnosis asks about a peer.

A rank records itself in the store (``scopedmesh-process/<rank>``: host, pid
namespace, pid and start time, :func:`record_process`), so a peer on the same
host can tell from ``/proc`` whether it runs (:func:`peer_seen`). A liveness
watch guarding the mesh (:class:`Liveness`) answers instead, on any host: one
notion of alive.

>>> process_gone(os.getpid())
False
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Protocol, TypeGuard

from torch.distributed.distributed_c10d import Store

from scopedmesh.c10d.store import process_key, read
from scopedmesh.errors import clipped

__all__ = [
    "Liveness",
    "peer_lost",
    "peer_seen",
    "process_gone",
    "record_process",
    "this_process",
]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name; None if there is no such file."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _running(fields: list[str] | None) -> TypeGuard[list[str]]:
    """Whether a process whose ``/proc/<pid>/stat`` reads ``fields`` runs: the file exists,
    and it is not a zombie nobody reaped yet."""
    return fields is not None and fields[0] not in ("Z", "X")


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host (and pid namespace) has ended; Linux ``/proc``.

    >>> process_gone(os.getpid())
    False
    """
    return not _running(_stat(pid))


def _namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process() -> dict[str, Any]:
    """Who this process is, so that a peer on the same host can tell whether it still runs."""
    pid = os.getpid()
    fields = _stat(pid)
    return {
        "host": socket.gethostname(),
        "ns": _namespace(),
        "pid": pid,
        "start": fields[19] if fields and len(fields) > 19 else "",
    }


def _process_alive(process: dict[str, Any]) -> bool | None:
    """Whether ``process`` (from :func:`this_process` on some rank) runs: None if we cannot see it."""
    here = this_process()
    if process.get("host") != here["host"] or process.get("ns") != here["ns"]:
        return None  # another host or pid namespace: only a liveness watch can tell (peer_lost)
    pid = process.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    if os.path.isdir("/proc/self"):
        fields = _stat(pid)
        if not _running(fields):
            return False
        return not process.get("start") or len(fields) <= 19 or fields[19] == process["start"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by someone else
        return True
    return True


def record_process(store: Store, rank: int) -> None:
    """Write who ``rank`` is to the store (one ``set``): :func:`peer_lost` reads it."""
    store.set(process_key(rank), json.dumps(this_process()))


class Liveness(Protocol):
    """What the diagnosis asks an opt-in liveness watch (:class:`scopedmesh.LivenessWatch`)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks it watches."""
        ...

    def why_lost(self, rank: int) -> str | None:
        """How ``rank`` was lost (``"has died (...)"``), or None while it is alive."""
        ...


def peer_lost(
    store: Store,
    rank: int,
    process: dict[str, Any] | None = None,
    liveness: Liveness | None = None,
) -> str | None:
    """How ``rank`` was lost (``"has died (...)"``), or None: alive, or nobody can tell.

    The one place the diagnosis asks (:func:`peer_seen` says which of the two
    a None is).
    """
    return peer_seen(store, rank, process, liveness)[1]


def peer_seen(
    store: Store,
    rank: int,
    process: dict[str, Any] | None = None,
    liveness: Liveness | None = None,
) -> tuple[bool | None, str | None]:
    """Whether ``rank`` runs, as far as this rank can see, and how it was lost.

    ``(True, None)``: alive; ``(False, "has died (...)")``: lost; ``(None, None)``:
    nobody here can tell. A rank that ``liveness`` (the caller's liveness
    watch, when there is one) watches is lost when the watch says so, else
    alive: one notion of alive, whichever host it is on. Otherwise a rank is
    seen through its process, as it recorded it (``process``, from its
    announcement, or its process record) on this host; a rank on another
    host, or one that never recorded itself, cannot be told.
    """
    if liveness is not None and rank in liveness.ranks:
        why = liveness.why_lost(rank)
        return (why is None), why
    if process is None:
        text = read(store, process_key(rank))
        try:
            process = json.loads(text) if text is not None else None
        except ValueError:
            process = None
    if not isinstance(process, dict):
        return None, None
    alive = _process_alive(process)
    if alive is False:
        return False, f"has died ({_where(process)} is gone)"
    return alive, None


def _where(process: dict[str, Any]) -> str:
    return f"its process {process.get('pid')} on host {clipped(str(process.get('host')), 80)}"
