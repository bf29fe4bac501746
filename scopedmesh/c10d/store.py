"""torch's distributed store: how the library reaches it, and every key it writes there.

One module for both, so that a reader (or a torch upgrade) finds every store
request's shape and every key in one place:

* **access**: :func:`default_store`, the one store every group forms over;
  :func:`read`, a look that never blocks and creates nothing;
  :func:`wait_timed_out`, which tells a wait's timeout from a lost store by the
  error's type (never its text); :class:`StoreUse`, the explicit decision to
  share torch's store client or clone it for a formation.
* **key layouts**, one section per family, each a pure function of its inputs:
  the incarnations of a group (generation counters, gloo's addresses, the
  formation barrier), the diagnosis (announcements, process records,
  deadlock agreements), the liveness watch (:class:`WatchKeys`: its ring's
  addresses, its deaths, its agreements) and the watch-free agreement on lost
  ranks (:func:`heal_keys`).

Every key is relative to torch's default store (the store the default process
group rendezvoused on), which torch prefixes per group for the group's own keys.

>>> formation_keys("g-1")
('g-1/formed', 'g-1/all-formed')
>>> announcement_key(3), process_key(3)
('scopedmesh-forming/3', 'scopedmesh-process/3')
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from scopedmesh.c10d.names import group_name

__all__ = [
    "REPLICAS_ROOT",
    "WATCH_ROOT",
    "AgreementKeys",
    "ReplicaKeys",
    "StoreUse",
    "WatchKeys",
    "announcement_key",
    "deadlock_key",
    "default_store",
    "formation_keys",
    "formation_stop_key",
    "generation_key",
    "gloo_address_key",
    "gloo_connects_eagerly",
    "heal_keys",
    "incarnation_keys",
    "own_keys",
    "process_key",
    "read",
    "wait_timed_out",
]

# compare_set's expected value: an absent key reads back as this, and nothing is created.
_ABSENT = "\x00scopedmesh-absent"


# ------------------------------------------------------------------ access


def default_store() -> c10d.Store:
    """torch's distributed store: the one the default process group rendezvoused on."""
    return c10d._get_default_store()


def read(store: c10d.Store, key: str) -> str | None:
    """``key``'s value, or None if absent: one request that never blocks and creates nothing.

    ``compare_set`` on an absent key with a non-empty expected value answers
    that value and writes nothing (``tests/world/test_boundary.py`` pins it).
    """
    value = store.compare_set(key, _ABSENT, _ABSENT)
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None if text == _ABSENT else text


def wait_timed_out(error: BaseException, waited: float, limit: float) -> bool:
    """Whether ``error``, raised by a store ``wait`` after ``waited`` of ``limit`` seconds, is
    that wait's timeout (else the store failed: re-raise it).

    By type, never by text: torch's TCP, prefix and hash stores raise
    ``DistStoreError`` at a wait's timeout, and ``DistNetworkError`` when the
    connection to the store is lost. torch's ``FileStore`` raises a plain
    ``RuntimeError`` at its timeout; such an error counts only once the wait
    has lasted its whole ``limit``. ``tests/world/test_boundary.py`` pins each
    store's type per release.

    >>> wait_timed_out(dist.DistStoreError("any words"), 0.01, 0.5)
    True
    >>> wait_timed_out(dist.DistNetworkError("timed out"), 0.5, 0.5)
    False
    >>> wait_timed_out(RuntimeError("any words"), 0.01, 0.5), wait_timed_out(RuntimeError(), 0.5, 0.5)
    (False, True)
    """
    if isinstance(error, dist.DistNetworkError):  # the store's connection: never a timeout
        return False
    if isinstance(error, dist.DistStoreError):
        return True
    return isinstance(error, RuntimeError) and waited >= limit


class StoreUse:
    """Which threads of this process may use torch's store client: whether to clone it.

    torch's TCPStore client runs one request at a time, and a blocking
    ``wait`` (gloo's rendezvous, the formation barrier) holds it: two threads
    forming groups at once over one client queue behind each other's waits,
    and across ranks that can deadlock until the timeout. So a formation
    clones the client (one more connection, kept by the group's backend while
    the group lives) unless this is the only thread that may use it.

    Which threads may: every live Python thread except those declared, by
    their owner, to talk to the store over clients of their own
    (:meth:`declare_own_clients`; a liveness watch declares its thread on the
    meshes it guards). Nothing is read from a thread's name. The decision is
    the caller's object, passed to each formation: a group table holds one.

    Why not always clone: torch's store server looks up every new client
    connection's peer in DNS, on the one thread that serves every request;
    where the resolver loses the query, every rank's store requests wait its
    5 s timeout (docs/measured.md, "The 5 s outliers"). A formation under a
    watch (a heal) therefore opens no connection; a process with threads of
    its own still pays one per formation.

    >>> use = StoreUse()
    >>> use.sharing_threads() == threading.active_count()
    True
    >>> use.declare_own_clients(threading.current_thread())
    >>> use.sharing_threads() == threading.active_count() - 1
    True
    """

    __slots__ = ("_own",)

    def __init__(self) -> None:
        self._own: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

    def declare_own_clients(self, thread: threading.Thread) -> None:
        """``thread`` uses store clients of its own, never torch's default one."""
        if not isinstance(thread, threading.Thread):
            raise TypeError(f"thread must be a threading.Thread, got {type(thread).__name__}")
        self._own.add(thread)

    def sharing_threads(self) -> int:
        """The live Python threads that may use torch's default client (the caller included)."""
        return sum(1 for thread in threading.enumerate() if thread not in self._own)

    def formation_store(self, store: c10d.Store) -> c10d.Store:
        """``store`` if the caller is its only user, else a clone (``store`` if it cannot clone)."""
        if self.sharing_threads() <= 1:
            return store
        clone: Any = getattr(store, "clone", None)
        try:
            cloned: c10d.Store = clone()
        except (RuntimeError, TypeError):  # a store that cannot clone (or no clone): share it
            return store
        return cloned


# ------------------------------------------------------------------ incarnations of a group


def generation_key(ranks: Sequence[int], backend: str, rank: int) -> str:
    """The counter of ``rank``'s incarnations of the group over ``ranks`` (kept for good).

    >>> generation_key((0, 1), "gloo", 1)
    'scopedmesh-40e50a5e73f9591580d9-0/generation/1'
    """
    return f"{group_name(ranks, backend, 0)}/generation/{rank}"


def gloo_connects_eagerly() -> bool:
    """Whether gloo rendezvous inside group construction (torch's default), not on first use.

    Under ``TORCH_GLOO_LAZY_INIT=1`` gloo connects on the first collective, after
    formation: no rendezvous to watch then, and its keys are still needed after it.
    """
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "0") in ("", "0")


def gloo_address_key(name: str, group_rank: int) -> str:
    """Where gloo's member ``group_rank`` of incarnation ``name`` writes its address.

    torch's layout (one CPU device): ``<group name>/<device>/<device index>/<rank>``
    under torch's per-group prefix, ``tests/world/test_boundary.py`` pins it.

    >>> gloo_address_key("g-1", 3)
    'g-1//cpu//0/3'
    """
    return f"{name}//cpu//0/{group_rank}"


def formation_keys(name: str) -> tuple[str, str]:
    """The formation barrier's keys of incarnation ``name``: arrivals, and the release."""
    return f"{name}/formed", f"{name}/all-formed"


def formation_stop_key(name: str) -> str:
    """Why the formation barrier of incarnation ``name`` was stopped (written only then).

    >>> formation_stop_key("g-1")
    'g-1/formation-stopped'
    """
    return f"{name}/formation-stopped"


def own_keys(name: str, group_rank: int, backend: str) -> list[str]:
    """The gloo address this member wrote for incarnation ``name``, if gloo connected eagerly."""
    if backend == dist.Backend.GLOO and gloo_connects_eagerly():
        return [gloo_address_key(name, group_rank)]
    return []


def incarnation_keys(name: str, size: int, backend: str) -> list[str]:
    """The store keys that incarnation ``name`` writes (none is left after formation).

    gloo: each member's address (none under ``TORCH_GLOO_LAZY_INIT=1``); the
    formation barrier's two keys when there is more than one member.
    ``tests/world/test_heal.py`` pins the layout: after formation no key of the
    incarnation is left.

    >>> incarnation_keys("g-1", 2, "gloo")
    ['g-1//cpu//0/0', 'g-1//cpu//0/1', 'g-1/formed', 'g-1/all-formed']
    """
    keys = [key for r in range(size) for key in own_keys(name, r, backend)]
    if size > 1:
        keys += list(formation_keys(name))
    return keys


# ------------------------------------------------------------------ the diagnosis


def announcement_key(rank: int) -> str:
    """Where ``rank`` says what it waits in, while it waits past the grace period."""
    return f"scopedmesh-forming/{rank}"


def process_key(rank: int) -> str:
    """Where ``rank`` says which process it is (host, pid namespace, pid, start time)."""
    return f"scopedmesh-process/{rank}"


def deadlock_key(names: Sequence[str]) -> str:
    """The agreement key of a deadlock cycle among incarnations ``names`` (any order).

    >>> deadlock_key(["b-1", "a-1"]) == deadlock_key(["a-1", "b-1"])
    True
    """
    text = "|".join(sorted(names))
    return (
        f"scopedmesh-deadlock/{hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:20]}"
    )


# ------------------------------------------------------------------ the liveness watch

WATCH_ROOT = "scopedmesh-watch"  # every key a liveness watch writes starts with this


@dataclass(frozen=True)
class AgreementKeys:
    """The keys of one agreement among a watch's members, under ``base``.

    >>> keys = AgreementKeys("scopedmesh-watch/1/agree/t")
    >>> keys.entries, keys.appended
    ('scopedmesh-watch/1/agree/t/in', 'scopedmesh-watch/1/agree/t/appended')
    """

    base: str

    @property
    def decision(self) -> str:
        """The lost set the members agreed on (``lost:3,5``), written once."""
        return f"{self.base}/decision"

    @property
    def entries(self) -> str:
        """The members accounted for, ``rank:alive,`` or ``rank:lost,`` (appended; the one
        write that counts)."""
        return f"{self.base}/in"

    @property
    def appended(self) -> str:
        """How many entries were appended (a hint: who appends adds 1 after)."""
        return f"{self.base}/appended"

    @property
    def look(self) -> str:
        """Who claimed the one look of a member that is not the lowest (the first claimer)."""
        return f"{self.base}/look"

    def claim(self, rank: int) -> str:
        """How many survivors claimed to account for lost ``rank``: the first appends its entry."""
        return f"{self.base}/claim/{rank}"

    def all(self, lost: Iterable[int] = ()) -> list[str]:
        """Every key the agreement can write, given the ranks it ``lost`` (their claims)."""
        return [self.decision, self.entries, self.appended, self.look, *map(self.claim, lost)]


@dataclass(frozen=True)
class WatchKeys:
    """The keys of one liveness watch: its members' ring addresses, deaths and agreements.

    ``prefix`` is ``scopedmesh-watch/<n>``: the members' ``n``-th watch, numbered
    by :meth:`counter` (members make their watches in the same order).

    >>> keys = WatchKeys("scopedmesh-watch/1")
    >>> keys.addr(3), keys.lost, WatchKeys.counter(0)
    ('scopedmesh-watch/1/addr/3', 'scopedmesh-watch/1/lost', 'scopedmesh-watch/count/0')
    >>> keys.all([0], ["t", "t"])  # doctest: +NORMALIZE_WHITESPACE
    ['scopedmesh-watch/1/closed', 'scopedmesh-watch/1/lost', 'scopedmesh-watch/1/tags',
     'scopedmesh-watch/1/stops', 'scopedmesh-watch/1/asks', 'scopedmesh-watch/1/agree/t/decision',
     'scopedmesh-watch/1/agree/t/in', 'scopedmesh-watch/1/agree/t/appended',
     'scopedmesh-watch/1/agree/t/look', 'scopedmesh-watch/1/addr/0',
     'scopedmesh-watch/1/wake/0', 'scopedmesh-watch/1/declared/0']
    """

    prefix: str

    @staticmethod
    def counter(rank: int) -> str:
        """The counter that numbers ``rank``'s watches (kept: it names the next watch)."""
        return f"{WATCH_ROOT}/count/{rank}"

    @property
    def closed(self) -> str:
        """The members that closed their watch, as ``rank,`` entries (appended; once the
        closed and the dead account for every member, the last one cleans up)."""
        return f"{self.prefix}/closed"

    @property
    def lost(self) -> str:
        """The deaths as ``rank:reason,`` entries, appended by whoever declared each (the
        first entry of a rank is its reason; the one write a declaration needs)."""
        return f"{self.prefix}/lost"

    @property
    def tags(self) -> str:
        """The tags of the agreements held (one per line, once per member), for the clean-up."""
        return f"{self.prefix}/tags"

    @property
    def stops(self) -> str:
        """The steps a member's own exception stopped, as ``rank:count,`` entries (appended;
        every watch then aborts its guarded meshes that hold that rank; the members are
        woken through :meth:`wake`)."""
        return f"{self.prefix}/stops"

    @property
    def asks(self) -> str:
        """The steps a member is in doubt about, as ``members/attempt,`` entries (appended;
        every member's watch answers for its rank with its count of committed steps)."""
        return f"{self.prefix}/asks"

    def addr(self, rank: int) -> str:
        """``rank``'s ring listener (``host:port``); deleted when it leaves."""
        return f"{self.prefix}/addr/{rank}"

    def wake(self, rank: int) -> str:
        """The key ``rank``'s watch blocks on (a server-side ``wait``, no polling): set by
        whoever has news for it (a death, a stop, a decision), deleted by ``rank`` once woken."""
        return f"{self.prefix}/wake/{rank}"

    def declared(self, rank: int) -> str:
        """How many watchers declared ``rank``'s death: only the first one wakes the members."""
        return f"{self.prefix}/declared/{rank}"

    def agreement(self, tag: str) -> AgreementKeys:
        """The keys of the agreement ``tag``."""
        return AgreementKeys(f"{self.prefix}/agree/{tag}")

    def all(self, ranks: Iterable[int], tags: Iterable[str]) -> list[str]:
        """Every key the watches under this prefix over ``ranks`` can leave, given their
        agreement ``tags`` (each once; empty ones skipped); the per-rank counters are not
        among them."""
        keys = [self.closed, self.lost, self.tags, self.stops, self.asks]
        for tag in dict.fromkeys(tag for tag in tags if tag):
            keys += self.agreement(tag).all()
        ranks = list(ranks)
        keys += [self.addr(rank) for rank in ranks] + [self.wake(rank) for rank in ranks]
        return keys + [self.declared(rank) for rank in ranks]


# ------------------------------------------------------------------ agree_on_lost (no watch)


def heal_keys(tag: str, rank: int) -> tuple[str, str]:
    """``rank``'s check-in key and the verdict key of the agreement ``tag`` (``agree_on_lost``).

    >>> heal_keys("step-7", 2)
    ('scopedmesh-heal/step-7/alive/2', 'scopedmesh-heal/step-7/lost')
    """
    return f"scopedmesh-heal/{tag}/alive/{rank}", f"scopedmesh-heal/{tag}/lost"


# ------------------------------------------------------------------ replicas that grow back

REPLICAS_ROOT = "scopedmesh-replicas"  # every key of a replicated job's membership starts so


@dataclass(frozen=True)
class ReplicaKeys:
    """The keys of a replicated job's membership, on the job's store (one job per store).

    A member is a slot: (replica, coordinate inside the replica). An epoch is one
    membership, decided once; its dp groups live under :meth:`group`.

    >>> keys = ReplicaKeys()
    >>> keys.join(2, 1), keys.decision(3), keys.group(3, 1)
    ('scopedmesh-replicas/join/2/1', 'scopedmesh-replicas/epoch/3/decision', 'scopedmesh-replicas/epoch/3/dp1')
    >>> keys.gloo_address(3, 1, 0)
    'scopedmesh-replicas/epoch/3/dp1/0/0'
    """

    root: str = REPLICAS_ROOT

    @property
    def joins(self) -> str:
        """How many replica incarnations announced themselves (read once per step)."""
        return f"{self.root}/joins"

    @property
    def shape(self) -> str:
        """The job's ``replicas`` and ``local``, written once by its first slot (``compare_set``)."""
        return f"{self.root}/shape"

    @property
    def latest(self) -> str:
        """The newest epoch that formed (a joiner starts looking there)."""
        return f"{self.root}/latest"

    @property
    def finished(self) -> str:
        """The last epoch's decision, once every member agreed the job ended (``finish``)."""
        return f"{self.root}/finished"

    @property
    def step(self) -> str:
        """The job's agreed steps, as its source last reported them (``job_view``)."""
        return f"{self.root}/step"

    @property
    def cleaned(self) -> str:
        """The epochs below this one have no key left."""
        return f"{self.root}/cleaned"

    def join(self, replica: int, coordinate: int) -> str:
        """The token of the incarnation of ``replica`` whose ``coordinate`` wants in."""
        return f"{self.root}/join/{replica}/{coordinate}"

    def address(self, replica: int, coordinate: int, token: str) -> str:
        """Where incarnation ``token`` of slot (``replica``, ``coordinate``) listens (probes)."""
        return f"{self.root}/addr/{replica}/{coordinate}/{token}"

    def decision(self, epoch: int) -> str:
        """Epoch ``epoch``'s membership, written once (``compare_set``)."""
        return f"{self.root}/epoch/{epoch}/decision"

    def checked_in(self, epoch: int, replica: int, coordinate: int) -> str:
        """A slot of ``epoch`` that left it after a failure, alive."""
        return f"{self.root}/epoch/{epoch}/in/{replica}/{coordinate}"

    def ready(self, epoch: int, replica: int, coordinate: int) -> str:
        """A slot about to form ``epoch``'s groups."""
        return f"{self.root}/epoch/{epoch}/ready/{replica}/{coordinate}"

    def group(self, epoch: int, coordinate: int) -> str:
        """The store prefix of ``epoch``'s dp group along ``coordinate``."""
        return f"{self.root}/epoch/{epoch}/dp{coordinate}"

    def gloo_address(self, epoch: int, coordinate: int, member: int) -> str:
        """Where gloo's ``member`` of that group wrote its address (device 0).

        ``tests/world/test_grow.py`` pins this layout on the installed torch.
        """
        return f"{self.group(epoch, coordinate)}/0/{member}"

    def nccl_id(self, epoch: int, coordinate: int, pair: tuple[int, int] | None = None) -> str:
        """Where torch's ``ProcessGroupNCCL`` of that group put a communicator's unique id:
        its collective communicator's (``0``, the first it makes), or a point-to-point
        pair's (``low:high``, its members' ranks in the group).

        torch's own layout (``broadcastUniqueNCCLID``); tests/gpu/test_nccl_replicas.py
        checks that the clean-up leaves none of an older epoch.

        >>> ReplicaKeys().nccl_id(3, 1), ReplicaKeys().nccl_id(3, 1, (2, 0))
        ('scopedmesh-replicas/epoch/3/dp1/0', 'scopedmesh-replicas/epoch/3/dp1/0:2')
        """
        name = "0" if pair is None else f"{min(pair)}:{max(pair)}"
        return f"{self.group(epoch, coordinate)}/{name}"

    def epoch_keys(self, epoch: int, replicas: int, local: int) -> list[str]:
        """Every key ``epoch`` can leave, for ``replicas`` replicas of ``local`` slots (but
        for NCCL's point-to-point pairs: the epoch's clean-up deletes those)."""
        slots = [(r, c) for r in range(replicas) for c in range(local)]
        keys = [self.decision(epoch)]
        keys += [self.checked_in(epoch, r, c) for r, c in slots]
        keys += [self.ready(epoch, r, c) for r, c in slots]
        keys += [self.gloo_address(epoch, c, m) for c in range(local) for m in range(replicas)]
        keys += [self.nccl_id(epoch, c) for c in range(local)]
        return keys
