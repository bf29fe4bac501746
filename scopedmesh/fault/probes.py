"""Whether a slot of a replicated job is alive: its own listener, and probes of others'.

Death is a refused probe: a slot's listener is an open port while its process
lives, and a connect to a dead process's port is refused by its kernel at once.
No heartbeat and no thread: a member probes a slot only while it waits for it
(at most every :data:`PROBE_EVERY` seconds), and drains its own listener's queue
as it waits. Each slot publishes its listener's address in the job's store
(``ReplicaKeys.address``) before it announces itself.

A host cut off from the network refuses nothing: the members of an epoch hold
links to each other's listeners (:mod:`~scopedmesh.fault.links`), which tell an
unreachable host within about a second, and a slot that finds its peers and
the job's store unreachable knows it is the one cut off (:meth:`SlotProbes.check_reach`).

>>> probe("127.0.0.1:1")  # nothing listens on port 1 here: refused, so gone
True
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.errors import LostRankError
from scopedmesh.fault.links import (
    CHECK_EVERY,
    UNREACHABLE,
    UNREACHABLE_AFTER,
    Links,
    Slot,
    WatchedGroup,
)
from scopedmesh.fault.protocol.membership import Decision

__all__ = ["PROBE_EVERY", "PROBE_WAIT", "SlotProbes", "cut_off", "probe", "route_address"]

PROBE_EVERY = 0.1  # seconds between two probes of one slot that has not answered yet
PROBE_WAIT = 1.0  # seconds a probe's connect may take before it counts as "no answer yet"

T = TypeVar("T")


def route_address(target: str) -> str:
    """This host's address on the route to ``target`` (no traffic is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect((target, 9))
            address: str = udp.getsockname()[0]
            return address
    except OSError:
        return "127.0.0.1"


def probe(address: str) -> bool | None:
    """Whether the process listening at ``host:port`` is gone (True), alive (False), or
    unknown (None: no answer within :data:`PROBE_WAIT`). A dead process's port refuses."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_WAIT):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return None


def cut_off(
    replica: int, token: str, unreachable: list[int], store: str, answer: bool | None
) -> str | None:
    """Why this replica is the one cut off from the job, or None if it is not.

    A replica whose links found members ``unreachable`` may be on either side of
    a cut. The job's store (at ``store``) decides who goes on, on its side of
    the cut: if it answered a probe (``answer`` False: it accepted; True: it
    refused, so it is gone, and its requests fail by themselves) this replica
    heals through it as after any failed step. If it answered nothing either
    (``answer`` None), every request to it would wait for the cut to heal: this
    replica is cut off, and the store's side goes on without it.

    >>> cut_off(2, "f00", [0, 1], "127.77.0.1:29500", False) is None
    True
    >>> print(cut_off(2, "f00", [0, 1], "127.77.0.1:29500", None))  # doctest: +ELLIPSIS
    replica 2 (incarnation f00) is cut off from the job: replicas [0, 1] are unreachable ... restart this replica to rejoin as a new incarnation
    """
    if not unreachable or answer is not None:
        return None
    return (
        f"replica {replica} (incarnation {token}) is cut off from the job: replicas "
        f"{unreachable} are unreachable (their hosts acknowledged nothing for "
        f"{UNREACHABLE_AFTER:g} s) and so is the job's store at {store} (no answer within "
        f"{PROBE_WAIT:g} s). The replicas on the store's side go on without this one "
        f"(the store decides the job's membership, so this side never forms a job of its "
        f"own); once the network is back, restart this replica to rejoin as a new incarnation"
    )


class SlotProbes:
    """This slot's listener (on the route to ``target``, the store's host), and what it
    learned of the other slots' incarnations: dead once refused or unreachable, for good."""

    def __init__(self, store: Any, keys: ReplicaKeys, target: str) -> None:
        self._store, self._keys = store, keys
        self._listener = socket.create_server((route_address(target), 0), backlog=1024)
        self._listener.setblocking(False)
        self._accepted: list[socket.socket] = []  # probes (end of file at once) and links
        self._links = Links()
        self._probed: dict[tuple[int, int], float] = {}
        self._dead: set[Slot] = set()  # (replica, coordinate, token)
        self._addresses: dict[Slot, str | None] = {}
        self.cut_off = False  # this slot found itself cut off from the job (check_reach)

    @property
    def address(self) -> str:
        """Where this slot listens, ``host:port``."""
        return "{}:{}".format(*self._listener.getsockname()[:2])

    def drain(self) -> None:
        """Accept what is queued on this slot's listener, close the probes (their end of
        file comes at once) and read the links' bytes (never blocks)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while True:
                conn, _ = self._listener.accept()
                conn.setblocking(False)
                self._accepted.append(conn)
        kept = []
        for conn in self._accepted:
            try:
                while conn.recv(4096):
                    pass
                conn.close()  # end of file: a probe, or a link let go of
            except BlockingIOError:
                kept.append(conn)
            except OSError:
                conn.close()
        self._accepted = kept

    def dead(self, replica: int, coordinate: int, token: str | None) -> bool:
        """Whether incarnation ``token`` of slot (``replica``, ``coordinate``) is known dead
        (None: not a member, so dead); probed at most every :data:`PROBE_EVERY` seconds."""
        if token is None or (replica, coordinate, token) in self._dead:
            return True
        now = time.monotonic()
        if now - self._probed.get((replica, coordinate), 0.0) < PROBE_EVERY:
            return False
        self._probed[(replica, coordinate)] = now
        return self.gone(replica, coordinate, token)

    def gone(self, replica: int, coordinate: int, token: str) -> bool:
        """Probe incarnation ``token`` of a slot: True once its link failed or its port
        refused (kept), or another slot of the incarnation is known dead, or its address is gone (published before it announced; deleted by
        its successor or the clean-up, once it is no member). A linked slot is judged by
        its link alone: a connect to a host cut off would wait :data:`PROBE_WAIT`."""
        key = (replica, coordinate, token)
        if key in self._dead:
            return True
        if any(r == replica and t == token for r, _, t in self._dead):
            self._dead.add(key)  # another slot of that incarnation is: the replica is gone
            return True
        if self._links.linked(key) or key in self._links.lost:
            if self._links.check(key) is None:
                return False
            self._dead.add(key)
            return True
        if self._addresses.get(key) is None:
            self._addresses[key] = read(self._store, self._keys.address(*key))
        address = self._addresses[key]
        if address is None or probe(address) is True:
            self._dead.add(key)
            return True
        return False

    def watch(self, pg: Any, decision: Decision, replica: int, coordinate: int) -> WatchedGroup:
        """``pg``, ``decision``'s dp group along ``coordinate``, whose waits check links to
        the group's other slots; this slot holds links to those (and to no other) now."""
        addresses: dict[Slot, str | None] = {}
        for r, token in decision.members:
            slot = (r, coordinate, token)
            if r != replica:
                if self._addresses.get(slot) is None:
                    self._addresses[slot] = read(self._store, self._keys.address(*slot))
                addresses[slot] = self._addresses[slot]
        self._links.retarget(addresses)
        peers = list(addresses)

        def check() -> str | None:
            lost = {s: self._links.check(s) for s in peers}
            named = [
                f"replica {r} coordinate {c} is {why}" for (r, c, _), why in lost.items() if why
            ]
            self._dead.update(s for s, why in lost.items() if why)
            if not named:
                return None
            return (
                f"{'; '.join(named)} (unreachable: its host acknowledged nothing for "
                f"{UNREACHABLE_AFTER:g} s; closed: its process ended)"
            )

        return WatchedGroup(pg, check)

    def check_reach(self, replica: int, token: str, current: Decision) -> None:
        """Before a heal's first store request: :class:`~scopedmesh.errors.LostRankError`
        if a link found a member of ``current`` unreachable and the job's store answers no
        probe either (:func:`cut_off`); a store without an address is not probed."""
        unreachable = sorted(
            {
                r
                for (r, _, t), why in self._links.lost.items()
                if why == UNREACHABLE and current.token(r) == t
            }
        )
        host, port = getattr(self._store, "host", None), getattr(self._store, "port", None)
        if not unreachable or not isinstance(host, str) or not isinstance(port, int):
            return
        address = f"{host}:{port}"
        message = cut_off(replica, token, unreachable, address, probe(address))
        if message is not None:
            self.cut_off = True
            raise LostRankError(message)

    def ask(
        self,
        request: Callable[[], T],
        what: str,
        *,
        timeout: float,
        replica: int,
        token: str,
        current: Decision,
    ) -> T:
        """``request`` (to the job's store), on a helper thread, while this slot checks
        its links every :data:`~scopedmesh.fault.links.CHECK_EVERY` seconds.

        Across a cut a store request never returns: a ``TCPStore`` client's requests
        have no timeout of their own. So a wait that finds this slot cut off
        (:meth:`check_reach`) raises :class:`~scopedmesh.errors.LostRankError` and
        leaves the request to its thread; past ``timeout`` seconds, ``TimeoutError``
        says what was asked (``what``).
        """
        answer: list[Any] = []
        done = threading.Event()

        def send() -> None:
            try:
                answer.append(request())
            except BaseException as error:  # raised on the caller's thread
                answer.append(error)
            done.set()

        threading.Thread(target=send, name="scopedmesh-replicas-store", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not done.wait(CHECK_EVERY):
            self._links.check_all()
            self.check_reach(replica, token, current)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"replica {replica}: waited {timeout:g} s for the job's store to answer "
                    f"{what} (this slot did not find itself cut off: the store is slow, "
                    f"stopped or unreachable)"
                )
        if isinstance(answer[0], BaseException):
            raise answer[0]
        result: T = answer[0]
        return result

    def close(self) -> None:
        """Close the listener and the links: this slot's probes are refused from now on."""
        self._listener.close()
        self._links.close()
        for conn in self._accepted:
            conn.close()
        self._accepted = []
