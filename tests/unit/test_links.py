"""How ``Replicas`` tells a replica cut off from the network from a slow one (issue 39).

The decision logic of :mod:`scopedmesh.fault.links` and :func:`scopedmesh.fault.probes.cut_off`
on loopback sockets, no process group: a stopped process's kernel answers its
links (never lost); a killed one's resets them (closed); a connect that gets no
answer for :data:`UNREACHABLE_AFTER` is unreachable (a listener whose queue is
full drops the SYN, as a host cut off from the network does); a collective's
wait gives up as soon as the links name a lost member. Two-host runs with real
network namespaces are in ``tests/hosts`` (the ``hosts`` lane).
"""

from __future__ import annotations

import errno
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch.distributed as dist

from scopedmesh.c10d.store import ReplicaKeys
from scopedmesh.fault.links import (
    CLOSED,
    UNREACHABLE,
    UNREACHABLE_AFTER,
    Links,
    WatchedGroup,
    reason_of,
)
from scopedmesh.fault.probes import SlotProbes, cut_off, probe
from scopedmesh.fault.state_transfer import CollectiveFailed

SLOT = (2, 0, "abc")


def _listening_child() -> tuple[subprocess.Popen[str], str]:
    """A child process that listens on loopback and never accepts; its address."""
    code = (
        "import socket, time\n"
        "s = socket.create_server(('127.0.0.1', 0))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    port = int(child.stdout.readline())
    return child, f"127.0.0.1:{port}"


def test_errors_say_unreachable_for_silence_and_closed_for_the_rest() -> None:
    for number in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
        assert reason_of(number) == UNREACHABLE
    for number in (errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE):
        assert reason_of(number) == CLOSED
    assert reason_of(0) is None


def test_a_stopped_process_is_never_lost_and_a_killed_one_is_closed() -> None:
    """SIGSTOP: the kernel acknowledges the link's bytes for the process, for longer than
    a host cut off would take to be declared unreachable. SIGKILL: the link resets."""
    child, address = _listening_child()
    links = Links()
    try:
        child.send_signal(signal.SIGSTOP)
        links.retarget({SLOT: address})
        verdicts = []
        deadline = time.monotonic() + 1.5 * UNREACHABLE_AFTER + 0.3
        while time.monotonic() < deadline:
            verdicts.append(links.check(SLOT))
            time.sleep(0.05)
        assert verdicts == [None] * len(verdicts) and len(verdicts) > 10
        child.kill()
        child.wait(timeout=30)
        for _ in range(200):  # the reset comes with the next byte's answer
            if links.check(SLOT) is not None:
                break
            time.sleep(0.01)
        assert links.check(SLOT) == CLOSED
        assert links.check_all() == {SLOT: CLOSED}  # final: kept, the link closed
        assert not links.linked(SLOT)
    finally:
        child.kill()
        child.wait(timeout=30)
        links.close()


def test_a_connect_that_no_one_answers_is_unreachable_after_the_limit() -> None:
    """A listener whose accept queue is full drops the SYN, as a host cut off does."""
    now = [0.0]
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = f"127.0.0.1:{server.getsockname()[1]}"
    first = socket.create_connection(("127.0.0.1", server.getsockname()[1]))  # fills the queue
    links = Links(clock=lambda: now[0])
    try:
        links.retarget({SLOT: address})
        checks = []
        for t in (0.0, 0.1, UNREACHABLE_AFTER / 2, UNREACHABLE_AFTER):
            now[0] = t
            checks.append(links.check(SLOT))
        assert checks == [None, None, None, None]
        now[0] = UNREACHABLE_AFTER + 0.01
        assert links.check(SLOT) == UNREACHABLE
        links.retarget({SLOT: address})  # a verdict is final: no new link to that incarnation
        assert not links.linked(SLOT) and links.check(SLOT) == UNREACHABLE
    finally:
        links.close()
        first.close()
        server.close()


def test_a_byte_unacknowledged_for_the_limit_is_unreachable_whatever_the_kernel_waits() -> None:
    """The verdict does not wait for the kernel's first retransmission (a whole
    retransmission timeout, seconds on a loaded machine): a byte in flight for longer
    than UNREACHABLE_AFTER makes the slot unreachable; an acknowledgement resets it."""
    child, address = _listening_child()
    now, in_flight = [0.0], [0]
    links = Links(clock=lambda: now[0], unacknowledged=lambda sock: in_flight[0])
    try:
        links.retarget({SLOT: address})
        for _ in range(100):  # the connect completes (loopback)
            if links.check(SLOT) is None and links._links[SLOT].connected:
                break
            time.sleep(0.01)
        in_flight[0] = 1  # the byte sent at 0 (the last check) is never acknowledged
        verdicts = []
        for t in (0.1, 0.5, UNREACHABLE_AFTER):
            now[0] = t
            verdicts.append(links.check(SLOT))
        assert verdicts == [None, None, None]  # in flight since 0: not over the limit yet
        in_flight[0] = 0  # acknowledged after all: slow, not lost
        now[0] = UNREACHABLE_AFTER + 0.05
        assert links.check(SLOT) is None  # and a new byte in flight from here
        in_flight[0] = 1
        now[0] = 2 * UNREACHABLE_AFTER + 0.05
        assert links.check(SLOT) is None
        now[0] = 2 * UNREACHABLE_AFTER + 0.06
        assert links.check(SLOT) == UNREACHABLE
    finally:
        child.kill()
        child.wait(timeout=30)
        links.close()


def test_a_slot_without_an_address_is_closed_and_old_links_are_let_go() -> None:
    child, address = _listening_child()
    links = Links()
    try:
        links.retarget({SLOT: address, (3, 0, "d"): None})
        assert links.check((3, 0, "d")) == CLOSED and links.linked(SLOT)
        links.retarget({})
        assert not links.linked(SLOT) and links.check(SLOT) is None  # not linked: no verdict
    finally:
        child.kill()
        child.wait(timeout=30)
        links.close()


def test_draining_a_slots_listener_closes_probes_and_keeps_links() -> None:
    probes = SlotProbes(dist.HashStore(), ReplicaKeys(), "127.0.0.1")  # type: ignore[attr-defined]
    links = Links()
    try:
        links.retarget({SLOT: probes.address})
        assert probe(probes.address) is False  # a probe: connect, then close
        for _ in range(5):
            probes.drain()
            assert links.check(SLOT) is None
            time.sleep(0.02)
        assert len(probes._accepted) == 1  # the link; the probe's end of file closed it
        probes.close()
        for _ in range(200):
            if links.check(SLOT) is not None:
                break
            time.sleep(0.01)
        assert links.check(SLOT) == CLOSED  # a closed slot's links end: it is dead
    finally:
        probes.close()
        links.close()


def test_a_slot_of_an_incarnation_known_dead_is_dead_without_a_probe() -> None:
    """Another coordinate's link found replica 2 unreachable: this slot's heal or
    admission counts that incarnation dead at once, without a connect to a host that
    may be cut off (it would wait a second)."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    probes = SlotProbes(store, ReplicaKeys(), "127.0.0.1")
    live = socket.create_server(("127.0.0.1", 0))  # would answer a probe: alive
    try:
        store.set(ReplicaKeys().address(2, 0, "t"), f"127.0.0.1:{live.getsockname()[1]}")
        assert probes.gone(2, 0, "t") is False
        probes._dead.add((2, 1, "t"))  # what coordinate 1's link said
        assert probes.gone(2, 0, "t") is True and probes.dead(2, 0, "t") is True
        store.set(ReplicaKeys().address(2, 0, "new"), f"127.0.0.1:{live.getsockname()[1]}")
        assert probes.gone(2, 0, "new") is False  # a new incarnation is judged anew
    finally:
        probes.close()
        live.close()


def test_the_cut_off_side_is_the_one_that_reaches_neither_its_peers_nor_the_store() -> None:
    store = "127.77.0.1:29500"
    assert cut_off(2, "t", [], store, None) is None  # nobody unreachable: an ordinary heal
    assert cut_off(2, "t", [0, 1], store, False) is None  # the store answers: heal through it
    assert cut_off(2, "t", [0, 1], store, True) is None  # the store refused: its requests fail
    message = cut_off(2, "t9", [0, 1], store, None)
    assert message is not None
    for part in ("replica 2 (incarnation t9) is cut off", "replicas [0, 1]", store, "restart"):
        assert part in message


class _Work:
    """A fake collective's work: done after ``polls`` waits, or never (None)."""

    def __init__(self, polls: int | None, error: Exception | None = None) -> None:
        self.polls, self.error, self.waits = polls, error, 0

    def is_completed(self) -> bool:
        return self.polls is not None and self.waits >= self.polls

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.is_completed():
            if self.error is not None:
                raise self.error
            return True
        raise RuntimeError("Operation timed out!")


class _Group:
    def __init__(self, work: _Work) -> None:
        self.work = work

    def allreduce(self, tensors: list[Any]) -> _Work:
        return self.work

    def size(self) -> int:
        return 3


def _counting(lost_at: int | None) -> tuple[list[int], Any]:
    calls = [0]

    def check() -> str | None:
        calls[0] += 1
        return "replica 2 coordinate 0 is unreachable" if calls[0] == lost_at else None

    return calls, check


def test_a_wait_checks_the_links_and_fails_once_they_name_a_lost_member() -> None:
    calls, check = _counting(lost_at=3)
    group = WatchedGroup(_Group(_Work(polls=None)), check)
    assert group.size() == 3  # anything else is the group's own
    with pytest.raises(CollectiveFailed, match="replica 2 coordinate 0 is unreachable"):
        group.allreduce([]).wait()
    assert calls == [3]
    with pytest.raises(CollectiveFailed, match="let go of"):
        group.allreduce([])


def test_a_wait_that_ends_by_itself_is_its_collectives_answer() -> None:
    calls, check = _counting(lost_at=None)
    group = WatchedGroup(_Group(_Work(polls=4)), check)
    assert group.allreduce([]).wait() is True
    assert calls == [3]  # one check after each wait that did not end it
    failing = WatchedGroup(_Group(_Work(polls=2, error=RuntimeError("Connection closed"))), check)
    with pytest.raises(RuntimeError, match="Connection closed"):
        failing.allreduce([]).wait()
    assert calls == [4]
