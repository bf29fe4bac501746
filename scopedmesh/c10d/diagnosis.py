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
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from scopedmesh.c10d.processes import (
    Liveness,
    launched_here,
    peer_lost,
    peer_seen,
    process_gone,
    read_process,
    record_process,
    this_process,
)
from scopedmesh.c10d.store import (
    announcement_key,
    deadlock_key,
    process_key,
    read,
    wait_timed_out,
)
from scopedmesh.errors import GroupFormationError, MeshClosedError

__all__ = [
    "DEFAULT_GRACE",
    "Liveness",
    "Request",
    "Stop",
    "Subscribe",
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
SLICE = 0.1  # seconds: a formation's wait asks whether to stop (Stop.why) at least this often


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


# ------------------------------------------------------------------ stopping


def lost_error(
    store: Store, group: str, rank: int, lost: str, request: Request | None = None
) -> GroupFormationError:
    """``could not form <group>: rank 3 has died (...), so the group can never form.``, then
    what the lost rank was last waiting for (its announcement, read if not given)."""
    if request is None:
        try:
            request = Request.from_text(read(store, announcement_key(rank)))
        except RuntimeError:  # the store failed too: say what is known
            request = None
    last = (
        f"It was last waiting for rank {request.waits_for} in {request.group()}{request.asked_at()}."
        if request is not None
        else "It was not requesting any group when last seen."
    )
    return GroupFormationError(
        f"could not form {group}: rank {rank} {lost}, so the group can never form. {last}"
    )


Subscribe = Callable[[Callable[[], None]], Callable[[], None]]  # subscribe(wake) -> cancel


class Stop:
    """Why a formation must stop waiting now: asked between the slices of its waits.

    Its mesh was aborted (``aborted()`` says why, ``""`` while it is not: an
    abort is a state every wait sees, even of a group not registered yet), or
    ``liveness`` (the watch guarding the mesh) knows a member is lost. Both
    answer from memory, so a slice costs one store request (the wait itself).
    ``group`` names the group in the error (``"the gloo group along axis 'tp' ..."``).
    ``subscribe``, if given, is how a wait is woken instead of sliced:
    ``subscribe(wake)`` has ``wake()`` called once whatever makes :meth:`why`
    answer happens (the mesh's abort, which a lost member's watch makes), and
    returns the call that cancels it (see :mod:`scopedmesh.c10d.barrier`).
    """

    def __init__(
        self,
        store: Store,
        group: str,
        ranks: Sequence[int],
        rank: int,
        liveness: Liveness | None = None,
        aborted: Callable[[], str] | None = None,
        subscribe: Subscribe | None = None,
    ) -> None:
        self.store, self.group, self.ranks, self.rank = store, group, ranks, rank
        self.liveness, self.aborted, self.subscribe = liveness, aborted, subscribe

    def why(self) -> RuntimeError | None:
        """The error to raise now, or None (wait on): a lost member is named first."""
        liveness = self.liveness
        if liveness is not None:
            for rank in self.ranks:  # a rank it does not watch reads as alive
                lost = liveness.why_lost(rank) if rank != self.rank else None
                if lost is not None:
                    return lost_error(self.store, self.group, rank, lost)
        reason = self.aborted() if self.aborted is not None else ""
        if reason:
            return MeshClosedError(
                f"stopped forming {self.group}: its mesh was aborted (its groups were shut down "
                f"{reason}). Close it and re-form the survivors' mesh"
            )
        return None

    def wait(self, store: Store, keys: list[str], deadline: float, first: float) -> bool:
        """``store.wait(keys)`` until ``deadline`` (``time.monotonic()``) in slices, the first
        ``first`` seconds long (one request when the keys come in time), then
        :data:`SLICE`, asking :meth:`why` between two. True once the keys are
        there, False at ``deadline``; raises :meth:`why`'s error, or the store's."""
        limit = first
        while True:
            start = time.monotonic()
            limit = max(min(limit, deadline - start), 0.001)
            try:
                store.wait(keys, timedelta(seconds=limit))
                return True
            except RuntimeError as error:  # by type: see wait_timed_out
                if not wait_timed_out(error, time.monotonic() - start, limit):
                    raise
            stop = self.why()
            if stop is not None:
                raise stop
            if time.monotonic() >= deadline:
                return False
            limit = SLICE


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
        aborted: Callable[[], str] | None = None,
    ) -> None:
        self.store = store
        self.liveness = liveness
        self.stop = Stop(store, request.group(), ranks, request.rank, liveness, aborted)
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
        # Under a liveness watch the grace is cut into slices (a lost member or an
        # abort stops the wait within one); else it is one request.
        first = SLICE if self.stop.liveness is not None else self.grace
        if self.stop.wait(
            self.store, keys, min(time.monotonic() + self.grace, self.deadline), first
        ):
            return
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
            stop = self.stop.why()
            if stop is not None:
                raise stop
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
        self.liveness = self.stop.liveness = self.stop.aborted = None
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
        return lost_error(self.store, self.request.group(), rank, lost, request)

    def _timeout_error(self) -> GroupFormationError:
        """After the timeout: what each member that has not arrived is doing.

        What is known leads; the likely causes are listed only for members
        whose state this rank cannot see (see :func:`_timeout_text`).
        """
        own = self.request
        seen: list[tuple[int, str, bool]] = []
        stem = self.request.waits_on.rsplit("/", 1)[0]
        more = False
        here = _LaunchedHere()
        for position, rank in enumerate(self.ranks):
            if rank == own.rank or (stem and self.store.check([f"{stem}/{position}"])):
                continue
            if len(seen) == _LISTED:
                more = True
                break
            seen.append((rank, *self._doing(rank, here)))
        group = f"the {own.backend} process group along {own.what} over ranks {own.ranks}"
        return GroupFormationError(_timeout_text(group, self.timeout, seen, more))

    def _doing(self, rank: int, here: _LaunchedHere) -> tuple[str, bool]:
        """What ``rank`` is doing, as a predicate, and whether that is known (else a guess).

        A rank with no process record has made no mesh yet: found on this host by its
        launch environment (:func:`launched_here`), it is named as running here; not
        found, it is not said to be elsewhere, only that nothing here shows it. The
        other-host wording is for a rank whose record names another host or pid namespace.
        """
        request = Request.from_text(read(self.store, announcement_key(rank)))
        process = request.process if request is not None and request.process else None
        if process is None:
            process = read_process(self.store, rank)
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
        if process is None:  # no record: it has made no mesh yet
            pid = here.pid(rank)
            if pid is not None:
                return _NO_MESH_HERE.format(pid=pid), True
            return _NO_MESH_UNSEEN.format(rank=rank), False
        return (
            "requested no group that this rank can see, and whether it still runs cannot be "
            "seen from here (another host or pid namespace, and no liveness watch guards the mesh)",
            False,
        )


class _LaunchedHere:
    """The ranks of this job running on this host (:func:`launched_here`), looked for once,
    when a timeout's message first needs a rank that left no process record.

    >>> _LaunchedHere().pid(-1) is None  # no launcher names a negative rank
    True
    """

    def __init__(self) -> None:
        self._pids: dict[int, int] | None = None

    def pid(self, rank: int) -> int | None:
        """The pid of ``rank``'s process on this host, or None if none is seen."""
        if self._pids is None:
            self._pids = launched_here()
        return self._pids.get(rank)


_OUTSIDE = (
    "outside any group request: running user code or a collective (a barrier, say), "
    "or it closed its mesh without requesting this group"
)
_NO_MESH_HERE = (
    "is running on this host (process {pid}) but has not asked for this group: it has made "
    "no mesh yet"
)
_NO_MESH_UNSEEN = (
    "has made no mesh yet (it wrote no process record), and whether it runs cannot be told "
    "from here (no process of this host names rank {rank} of this job in the environment it "
    "started with, and no liveness watch guards the mesh)"
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
