"""Whether a slot of a replicated job is alive: its own listener, and probes of others'.

Death is a refused probe: a slot's listener is an open port while its process
lives, and a connect to a dead process's port is refused by its kernel at once.
No heartbeat and no thread: a member probes a slot only while it waits for it
(at most every :data:`PROBE_EVERY` seconds), and drains its own listener's queue
as it waits. Each slot publishes its listener's address in the job's store
(``ReplicaKeys.address``) before it announces itself.

>>> probe("127.0.0.1:1")  # nothing listens on port 1 here: refused, so gone
True
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

from scopedmesh.c10d.store import ReplicaKeys, read

__all__ = ["PROBE_EVERY", "PROBE_WAIT", "SlotProbes", "probe", "route_address"]

PROBE_EVERY = 0.1  # seconds between two probes of one slot that has not answered yet
PROBE_WAIT = 1.0  # seconds a probe's connect may take before it counts as "no answer yet"


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


class SlotProbes:
    """This slot's listener (on the route to ``target``, the store's host), and what it
    learned of the other slots' incarnations: dead once refused, for good."""

    def __init__(self, store: Any, keys: ReplicaKeys, target: str) -> None:
        self._store, self._keys = store, keys
        self._listener = socket.create_server((route_address(target), 0), backlog=1024)
        self._listener.setblocking(False)
        self._probed: dict[tuple[int, int], float] = {}
        self._dead: set[tuple[int, int, str]] = set()  # (replica, coordinate, token)
        self._addresses: dict[tuple[int, int, str], str | None] = {}

    @property
    def address(self) -> str:
        """Where this slot listens, ``host:port``."""
        return "{}:{}".format(*self._listener.getsockname()[:2])

    def drain(self) -> None:
        """Accept and close the probes queued on this slot's listener (never blocks)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while True:
                conn, _ = self._listener.accept()
                conn.close()

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
        """Probe incarnation ``token`` of a slot: True once its port refused (kept), or its
        address is gone (published before it announced; deleted by its successor or the
        clean-up, once it is no member)."""
        key = (replica, coordinate, token)
        if key in self._dead:
            return True
        if self._addresses.get(key) is None:
            self._addresses[key] = read(self._store, self._keys.address(*key))
        address = self._addresses[key]
        if address is None or probe(address) is True:
            self._dead.add(key)
            return True
        return False

    def close(self) -> None:
        """Close the listener: this slot's probes are refused from now on."""
        self._listener.close()
