"""Who a rank's process is, and whether it still runs: what the diagnosis asks about a peer.

A rank records itself in the store (``scopedmesh-process/<rank>``: host, pid
namespace, pid and start time, :func:`record_process`), so a peer on the same
host can tell from ``/proc`` whether it runs (:func:`peer_seen`). A liveness
watch guarding the mesh (:class:`Liveness`) answers instead, on any host: one
notion of alive. A rank that has made no mesh yet has no record; it can still
be found on this host by the environment it was launched with, as torchrun
launches a rank (:func:`launched_here`).

>>> process_gone(os.getpid())
False
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

from torch.distributed.distributed_c10d import Store

from scopedmesh.c10d.store import process_key, read
from scopedmesh.errors import clipped

__all__ = [
    "JOB_VARIABLES",
    "Liveness",
    "job_of",
    "launched_here",
    "peer_lost",
    "peer_seen",
    "process_gone",
    "read_process",
    "record_process",
    "this_process",
]

# The launch environment's variables that name a job: a process of this host is rank r
# of this job if it was started with RANK=r and each of these that this process has.
JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")


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


def _launch_environment(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``); None if
    it cannot be read (gone, or another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            raw = file.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def job_of(environment: Mapping[str, str]) -> dict[str, str] | None:
    """The :data:`JOB_VARIABLES` that ``environment`` has; None without ``MASTER_PORT``
    (a world made over a store given by hand: no launch environment names its job).

    >>> job_of({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3"})
    {'MASTER_ADDR': '10.0.0.1', 'MASTER_PORT': '29500'}
    """
    job = {key: environment[key] for key in JOB_VARIABLES if key in environment}
    return job if "MASTER_PORT" in job else None


def launched_here(job: Mapping[str, str] | None = None) -> dict[int, int]:
    """The ranks of ``job`` running on this host, each with its pid, by launch environment.

    ``job`` (default: this process's, :func:`job_of` ``os.environ``) is matched against
    each visible process's launch environment, as torchrun, ``torch.multiprocessing``
    with ``env://`` or a cluster's launcher set it: ``RANK`` and every job variable must
    agree. A rank's own children (a DataLoader's workers) inherit its environment: the
    process whose parent is not of that rank is the rank. What cannot be read (another
    user's process, no ``/proc``) is not seen, nor a rank whose launcher set its
    variables only after it started. This process is left out. Reads ``/proc`` of every
    process: once per diagnosis, on its error path.

    >>> launched_here({"MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "no-such-job"})
    {}
    """
    if job is None:
        job = job_of(os.environ)
    if job is None:
        return {}
    try:
        pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return {}
    found: dict[int, dict[int, int]] = {}  # rank -> {pid: parent pid}
    for pid in pids:
        environment = _launch_environment(pid) if pid != os.getpid() else None
        if environment is None or not environment.get("RANK", "").isdigit():
            continue
        if any(environment.get(key) != value for key, value in job.items()):
            continue
        fields = _stat(pid)
        if _running(fields) and len(fields) > 1 and fields[1].isdigit():
            found.setdefault(int(environment["RANK"]), {})[pid] = int(fields[1])
    return {rank: _eldest(processes) for rank, processes in found.items()}


def _eldest(processes: Mapping[int, int]) -> int:
    """Of ``{pid: parent pid}``, all launched as one rank, the one no other one started."""
    roots = [pid for pid, parent in processes.items() if parent not in processes]
    return min(roots or processes)


def read_process(store: Store, rank: int) -> dict[str, Any] | None:
    """``rank``'s process record (:func:`this_process`, as it wrote it), or None if it
    wrote none (it has made no mesh yet) or the record cannot be read."""
    text = read(store, process_key(rank))
    try:
        process = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return process if isinstance(process, dict) else None


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
        process = read_process(store, rank)
    if not isinstance(process, dict):
        return None, None
    alive = _process_alive(process)
    if alive is False:
        return False, f"has died ({_where(process)} is gone)"
    return alive, None


def _where(process: dict[str, Any]) -> str:
    return f"its process {process.get('pid')} on host {clipped(str(process.get('host')), 80)}"
