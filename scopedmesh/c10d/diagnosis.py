"""Why a group does not form: who waits for whom, read from torch's store alone.

gloo's rendezvous blocks inside torch's C++ group constructor, waiting in the
store for each member's address, and cannot be polled from outside. So the
constructor gets a :class:`WatchedStore`: it forwards every request, and its
``wait`` belongs to a :class:`Watch` of the formation. The first wait for a
key lasts the grace period, in one request: when every member arrives in time
that is the only request, exactly the one gloo made before. Past the grace the
member is on the slow path: it announces what it waits in
(``scopedmesh-forming/<rank>``: the incarnation, its generation, axes, ranks,
``group_desc``, the rank it waits for and the user's call site), polls with
``check`` and, once per grace period, follows the announcements from the rank
it waits for:

* a cycle of members, each waiting in a group the next has not requested
  (the key it waits on is still absent), is a certain deadlock:
  :class:`~scopedmesh.errors.GroupFormationError` at once, naming every rank's
  group and the order rule broken;
* a member that waits for a rank known lost (:func:`peer_lost`: its process
  is gone, or the caller's liveness watch declared it dead or unreachable)
  fails at once;
* anything else (a slow peer, a peer in user code or a collective) waits on,
  and at the timeout the error says what each missing member is doing.

Its keys (``scopedmesh-forming/<rank>``, slow path only, deleted when that
formation ends; ``scopedmesh-process/<rank>``, written at a group table's
first formation, one per rank, overwritten, kept like the generation
counters; ``scopedmesh-deadlock/<digest>``, the agreement of a proven cycle)
are laid out in :mod:`scopedmesh.c10d.store`, with every other key the
library writes.

>>> announcement_key(3), process_key(3)
('scopedmesh-forming/3', 'scopedmesh-process/3')
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeGuard

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from scopedmesh.c10d.store import (
    announcement_key,
    deadlock_key,
    process_key,
    read,
    wait_timed_out,
)
from scopedmesh.errors import GroupFormationError, clipped

__all__ = [
    "DEFAULT_GRACE",
    "Liveness",
    "Request",
    "Watch",
    "WatchedStore",
    "announcement_key",
    "peer_lost",
    "peer_seen",
    "process_gone",
    "process_key",
    "read",
    "record_process",
    "this_process",
]

DEFAULT_GRACE = timedelta(milliseconds=500)
_POLL_CAP = 0.1  # seconds between two ``check`` requests on the slow path, at most
_HOPS = 64  # announcements followed per diagnosis, at most
_LISTED = 16  # missing members described in a timeout's message, at most


# ------------------------------------------------------------------ processes


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


# ------------------------------------------------------------------ requests


class Request:
    """What one rank waits in: the incarnation, its group, and the rank it waits for."""

    __slots__ = (
        "backend",
        "description",
        "generation",
        "name",
        "process",
        "rank",
        "ranks",
        "site",
        "waits_for",
        "waits_on",
        "what",
    )

    def __init__(
        self,
        *,
        rank: int,
        name: str,
        generation: int,
        ranks: str,
        backend: str,
        what: str,
        description: str,
        site: str = "",
        waits_for: int | None = None,
        waits_on: str = "",
        process: dict[str, Any] | None = None,
    ) -> None:
        self.rank, self.name, self.generation = rank, name, generation
        self.ranks, self.backend, self.what, self.description = ranks, backend, what, description
        self.site, self.waits_for = site, waits_for
        self.waits_on = waits_on  # the store key it waits for: absent until waits_for arrives
        self.process = process or {}

    def to_text(self) -> str:
        return json.dumps({slot: getattr(self, slot) for slot in self.__slots__})

    @classmethod
    def from_text(cls, text: str | None) -> Request | None:
        """The request in ``text``, or None if it is absent or unreadable."""
        if text is None:
            return None
        try:
            data = json.loads(text)
            return cls(**{slot: data[slot] for slot in cls.__slots__})
        except (ValueError, TypeError, KeyError):
            return None

    def group(self) -> str:
        """``the gloo group along axis 'tp' over ranks [0, 1] (group_desc 'scopedmesh:tp')``."""
        return (
            f"the {self.backend} group along {self.what} over ranks {self.ranks} "
            f"(group_desc {self.description!r})"
        )

    def asked_at(self) -> str:
        return f", requested at {self.site}" if self.site else ""


def call_site() -> str:
    """``file.py:12 in fn``: the innermost caller outside scopedmesh and torch."""
    skipped = (
        os.path.dirname(os.path.abspath(sys.modules["scopedmesh.errors"].__file__ or "")) + os.sep,
        os.path.dirname(os.path.dirname(os.path.abspath(dist.__file__ or ""))) + os.sep,
    )
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(skipped):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


# ------------------------------------------------------------------ the watch


class Watch:
    """One member's watch over one formation: sliced waits, announcement, diagnosis.

    ``ranks`` are the members in group-rank order (gloo's key ``.../<k>`` is
    ``ranks[k]``'s address); ``request`` is this member's formation, as its
    announcement will show it. Everything lives on this object and in the store.
    """

    def __init__(
        self,
        store: Store,
        request: Request,
        ranks: Sequence[int],
        grace: timedelta,
        timeout: timedelta,
        liveness: Liveness | None = None,
    ) -> None:
        self.store = store
        self.liveness = liveness
        self.ranks = ranks
        self.started = time.monotonic()
        self.deadline = self.started + timeout.total_seconds()
        self.timeout = timeout
        self.grace = grace.total_seconds()
        self.written: list[str] = []  # keys the backend set through this watch
        self.announced: int | None = None  # the rank announced as waited for, once announced
        self.done = False
        self.cycle: tuple[str, int] | None = None  # a proven deadlock: (agreement key, ranks)
        self.request = request  # what this rank waits in (``rank``, ``name``, ``ranks``, ...)

    # -- the wait ------------------------------------------------------------

    def wait(self, keys: list[str], timeout: timedelta | None) -> None:
        """Wait for ``keys`` as the backend asked; past the grace period, diagnose."""
        if self.done:  # after formation: the group's own later use of its store
            if timeout is None:
                self.store.wait(keys)
            else:
                self.store.wait(keys, timeout)
            return
        start = time.monotonic()
        limit = max(min(self.grace, self.deadline - start), 0.001)
        try:
            self.store.wait(keys, timedelta(seconds=limit))
            return
        except RuntimeError as error:  # by type: see wait_timed_out
            if not wait_timed_out(error, time.monotonic() - start, limit):
                raise
        self._slow(keys, self._waited(keys))

    def _waited(self, keys: list[str]) -> int | None:
        """The global rank whose address ``keys`` are (gloo's ``<name>//cpu//0/<k>``)."""
        try:
            return self.ranks[int(keys[0].rsplit("/", 1)[-1])]
        except (ValueError, IndexError):
            return None

    def _slow(self, keys: list[str], waited: int | None) -> None:
        if waited is not None and waited != self.announced:
            self._announce(waited, keys[0])
        next_look = time.monotonic()
        pause = 0.01
        while True:
            if self.store.check(keys):
                return
            now = time.monotonic()
            if now >= self.deadline:
                raise self._timeout_error()
            if now >= next_look and waited is not None:
                error = self.diagnose(waited)
                if error is not None:
                    if self.cycle is not None:
                        self._agree(*self.cycle)
                    raise error
                next_look = time.monotonic() + self.grace
            time.sleep(max(0.0, min(pause, next_look - now, self.deadline - now)))
            pause = min(2 * pause, _POLL_CAP)

    def _agree(self, key: str, size: int) -> None:
        """Stay announced until every rank of the deadlock cycle has seen it, then leave.

        A rank that left at once would delete the announcement its peers still
        need to prove the cycle. Each counts itself in on ``key``, waits (until its
        deadline) for the count to reach ``size``, and counts itself out; the last
        one out deletes ``key``. Store requests only, on the failure path.
        """
        store = self.store
        if int(store.add(key, 1)) < size:
            pause = 0.005
            while time.monotonic() < self.deadline:
                seen = read(store, key)
                if seen is None or int(seen) >= size:
                    break
                time.sleep(pause)
                pause = min(2 * pause, _POLL_CAP)
        if int(store.add(key, 1)) == 2 * size:
            store.delete_key(key)

    def _announce(self, waited: int, key: str) -> None:
        request = self.request
        if self.announced is None:
            request.site = call_site()
            request.process = this_process()
        request.waits_for, request.waits_on = waited, key
        self.store.set(announcement_key(request.rank), request.to_text())
        self.announced = waited

    def finish(self) -> None:
        """The formation ended: later waits pass through; the announcement goes.

        The liveness watch is let go: the group keeps its store, and so this
        watch, for its whole life, and the liveness watch holds the meshes that
        hold the group (a cycle the collector would have to find).
        """
        self.done = True
        self.liveness = None
        if self.announced is not None:
            self.announced = None
            try:
                self.store.delete_key(announcement_key(self.request.rank))
            except RuntimeError:  # the store is gone: nothing is left to read it
                pass

    def forget_written(self) -> None:
        """The formation failed: delete what the backend wrote through this watch (its address)."""
        for key in self.written:
            try:
                self.store.delete_key(key)
            except RuntimeError:
                pass
        self.written.clear()

    # -- diagnosis -----------------------------------------------------------

    def diagnose(self, waited: int) -> GroupFormationError | None:
        """The error if the wait for ``waited`` can never end, else None (wait on).

        Announcements are read first, then the keys that prove each edge (the
        key a rank waits on is still absent: the next rank has not arrived in
        its group): at the moment of the first of those reads every member of
        the chain was in its announced formation, and none can leave it without
        the next arriving.
        """
        chain = [self.request]
        index = {self.request.rank: 0}
        current = waited
        loop = None
        for _ in range(_HOPS):
            request = Request.from_text(read(self.store, announcement_key(current)))
            if current == waited:
                process = request.process if request is not None and request.process else None
                lost = peer_lost(self.store, current, process, self.liveness)
                if lost is not None:
                    return self._lost_error(waited, lost, request)
            if request is None or request.name == chain[-1].name:
                return None
            if request.waits_for is None:
                return None
            chain.append(request)
            if request.waits_for in index:
                loop = index[request.waits_for]
                break
            index[request.rank] = len(chain) - 1
            current = request.waits_for
        if loop is None:
            return None
        for request in chain:
            if not request.waits_on or self.store.check([request.waits_on]):
                return None  # the one it waited for has arrived: not (yet) proven
        names = [request.name for request in chain[loop:]]
        self.cycle = (deadlock_key(names), len(names)) if loop == 0 else None
        return GroupFormationError(_deadlock_text(chain, loop, time.monotonic() - self.started))

    def _lost_error(self, rank: int, lost: str, request: Request | None) -> GroupFormationError:
        own = self.request
        last = (
            f"It was last waiting for rank {request.waits_for} in {request.group()}"
            f"{request.asked_at()}."
            if request is not None
            else "It was not requesting any group when last seen."
        )
        return GroupFormationError(
            f"could not form {own.group()}: rank {rank} {lost}, so the group can never form. {last}"
        )

    def _timeout_error(self) -> GroupFormationError:
        """After the timeout: what each member that has not arrived is doing.

        What is known leads; the likely causes are listed only for members
        whose state this rank cannot see (see :func:`_timeout_text`).
        """
        own = self.request
        seen: list[tuple[int, str, bool]] = []
        stem = self.request.waits_on.rsplit("/", 1)[0]
        more = False
        for position, rank in enumerate(self.ranks):
            if rank == own.rank or (stem and self.store.check([f"{stem}/{position}"])):
                continue
            if len(seen) == _LISTED:
                more = True
                break
            seen.append((rank, *self._doing(rank)))
        group = f"the {own.backend} process group along {own.what} over ranks {own.ranks}"
        return GroupFormationError(_timeout_text(group, self.timeout, seen, more))

    def _doing(self, rank: int) -> tuple[str, bool]:
        """What ``rank`` is doing, as a predicate, and whether that is known (else a guess)."""
        request = Request.from_text(read(self.store, announcement_key(rank)))
        process = request.process if request is not None and request.process else None
        alive, lost = peer_seen(self.store, rank, process, self.liveness)
        if lost is not None:
            return lost, True
        if request is not None and request.waits_for is not None:
            return (
                f"waits for rank {request.waits_for} in another group: {request.group()}"
                f"{request.asked_at()}",
                True,
            )
        if alive:
            return f"is alive and {_OUTSIDE}", True
        return (
            "requested no group that this rank can see, and whether it still runs cannot be "
            "seen from here (another host or pid namespace, and no liveness watch guards the mesh)",
            False,
        )


_OUTSIDE = (
    "outside any group request: running user code or a collective (a barrier, say), "
    "or it closed its mesh without requesting this group"
)
_CAUSES = (
    "it never requested this group, it died, or members requested overlapping groups in "
    "different orders (every member must request the same groups in the same order)"
)


def _timeout_text(
    group: str, timeout: timedelta, seen: list[tuple[int, str, bool]], more: bool
) -> str:
    """The timeout's message: each missing member's state, then causes only for the unknown.

    >>> print(_timeout_text("the group", timedelta(seconds=3), [(1, "is alive", True)], False))
    could not form the group within 0:00:03. The members that did not arrive:
      rank 1 is alive
    >>> print(_timeout_text("the group", timedelta(seconds=3), [(2, "is far", False)], True))
    could not form the group within 0:00:03. The members that did not arrive:
      rank 2 is far
      ... (more members did not arrive)
    Likely cause for rank 2 and the members not listed: it never requested this group, it died, or members requested overlapping groups in different orders (every member must request the same groups in the same order).
    """
    lines = [f"  rank {rank} {doing}" for rank, doing, _ in seen]
    if more:
        lines.append("  ... (more members did not arrive)")
    if not lines:
        lines.append("  none: every member arrived, but not in time")
    unknown = [f"rank {rank}" for rank, _, known in seen if not known]
    if more:
        unknown.append("the members not listed")
    text = (
        f"could not form {group} within {timeout}. The members that did not arrive:\n"
        + "\n".join(lines)
    )
    if unknown:
        listed = unknown[0] if len(unknown) == 1 else f"{', '.join(unknown[:-1])} and {unknown[-1]}"
        text += f"\nLikely cause for {listed}: {_CAUSES}."
    return text


def _deadlock_text(chain: list[Request], loop: int, seconds: float) -> str:
    cycle = chain[loop:]
    ranks = [request.rank for request in cycle]
    lines = [
        f"  rank {request.rank} waits for rank {request.waits_for} in {request.group()}"
        f"{request.asked_at()}"
        for request in chain
    ]
    rules = []
    for position, request in enumerate(cycle):
        following = cycle[(position + 1) % len(cycle)]
        rules.append(
            f"rank {following.rank} requested the group over ranks {following.ranks} before "
            f"the one over ranks {request.ranks}"
        )
    head = (
        f"deadlock in group formation: ranks {ranks} each wait for the next to join a group "
        "it has not requested, so none of these groups can ever form"
    )
    if loop:
        head = (
            f"could not form {chain[0].group()}: rank {chain[0].waits_for} is held by a "
            f"deadlock in group formation among ranks {ranks}, so it can never arrive"
        )
    return (
        f"{head} (seen after {seconds:.1f} s):\n"
        + "\n".join(lines)
        + "\nOrder rule broken: members must request the groups they share in the same order "
        "(overlapping groups requested in different orders deadlock), but "
        + "; ".join(rules)
        + ". Request the groups in one order on every rank (e.g. mesh order, or eager=True)."
    )


# ------------------------------------------------------------------ the store


class WatchedStore(Store):
    """The store a gloo group rendezvous over: forwards to ``inner``; waits go to ``watch``."""

    def __init__(self, inner: Store, watch: Watch) -> None:
        super().__init__()
        self.inner = inner
        self.watch = watch

    def set(self, key: str, value: Any) -> None:
        if not self.watch.done:
            self.watch.written.append(key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.watch.wait(list(keys), timeout)
