"""How ``Replicas`` tells a replica cut off from the network from a slow one (issue 39).

The decision logic of :mod:`scopedmesh.fault.links` and :func:`scopedmesh.fault.probes.cut_off`
on loopback sockets, no process group: a stopped process's kernel answers its
links (never lost); a killed one's resets them (closed); a connect that gets no
answer for :data:`UNREACHABLE_AFTER` is unreachable (a listener whose queue is
full drops the SYN, as a host cut off from the network does); a collective's
wait gives up as soon as the links name a lost member, and never waits on gloo with
a timeout. The link verdict's state machine
(:mod:`scopedmesh.fault.protocol.link`) is driven by simulated ACK streams
(delayed ACKs, round trips up to 100 ms, cuts). Two-host runs with real network
namespaces are in ``tests/hosts`` (the ``hosts`` lane), among them a path with a
20-100 ms round trip (``test_links_path.py``).
"""

from __future__ import annotations

import errno
import gc
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from scopedmesh.c10d.store import ReplicaKeys
from scopedmesh.fault.links import (
    CHECK_EVERY,
    CLOSED,
    UNREACHABLE,
    UNREACHABLE_AFTER,
    Links,
    WatchedGroup,
    reason_of,
    tcp_acks,
)
from scopedmesh.fault.probes import SlotProbes, cut_off, probe
from scopedmesh.fault.protocol.link import ALIVE, Acks, Link
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


def test_data_unacknowledged_with_no_ack_for_the_limit_is_unreachable_whatever_the_kernel_waits() -> (
    None
):
    """The verdict does not wait for the kernel's first retransmission (a whole
    retransmission timeout, seconds on a loaded machine): data in flight and no ACK at
    all for longer than UNREACHABLE_AFTER makes the slot unreachable; a byte in flight
    at every check whose ACKs still come (a delayed ACK, a long round trip) does not."""
    child, address = _listening_child()
    now, acks = [0.0], [Acks(unacked=0, silent_for=0.0)]
    links = Links(clock=lambda: now[0], acks=lambda sock: acks[0])
    try:
        links.retarget({SLOT: address})
        for _ in range(100):  # the connect completes (loopback)
            if links.check(SLOT) is None and links._links[SLOT].link.is_connected:
                break
            time.sleep(0.01)
        for step in range(1, 61):  # 3 s, a byte in flight at every check, ACKs 90 ms late
            now[0] = step * CHECK_EVERY
            acks[0] = Acks(unacked=1, silent_for=0.09)
            assert links.check(SLOT) is None, f"a peer that acknowledges lost at {now[0]:g} s"
        cut, verdict = now[0] - 0.09, None  # the last ACK came then; none from here
        while verdict is None:
            now[0] += CHECK_EVERY
            acks[0] = Acks(unacked=1, silent_for=now[0] - cut)
            verdict = links.check(SLOT)
        assert verdict == UNREACHABLE
        assert UNREACHABLE_AFTER < now[0] - cut <= UNREACHABLE_AFTER + CHECK_EVERY
        assert not links.linked(SLOT) and links.check(SLOT) == UNREACHABLE  # final
    finally:
        child.kill()
        child.wait(timeout=30)
        links.close()


def test_tcp_info_is_read_at_linuxs_offsets_on_a_real_socket_pair() -> None:
    """tcp_acks reads struct tcp_info at Linux's offsets: the state byte says
    ESTABLISHED, the retransmission timeout (u32 at byte 8) is at least TCP_RTO_MIN,
    nothing is in flight once acknowledged, and the time since the last ACK grows
    while the link is idle and falls back once a byte is acknowledged."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    peer, _ = server.accept()
    try:
        if not sys.platform.startswith("linux"):
            assert tcp_acks(client) is None  # the fallback: only errors decide
            return
        raw = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        assert raw[0] == 1  # tcpi_state: TCP_ESTABLISHED
        assert int.from_bytes(raw[8:12], sys.byteorder) >= 200_000  # tcpi_rto, µs
        client.sendall(b"x")
        assert peer.recv(1) == b"x"
        time.sleep(0.05)
        first = tcp_acks(client)
        assert first is not None and first.unacked == 0
        time.sleep(0.4)
        idle = tcp_acks(client)
        assert idle is not None and idle.unacked == 0
        assert 0.35 <= idle.silent_for - first.silent_for < 30  # ms on the wire, seconds here
        client.sendall(b"y")
        assert peer.recv(1) == b"y"
        deadline = time.monotonic() + 5
        fresh = tcp_acks(client)
        while fresh is not None and fresh.silent_for >= idle.silent_for:
            assert time.monotonic() < deadline, f"no ACK seen in TCP_INFO: {fresh}"
            time.sleep(0.01)
            fresh = tcp_acks(client)
        assert fresh is not None and fresh.silent_for < idle.silent_for
    finally:
        for sock in (client, peer, server):
            sock.close()


# ------------------------------------------------------------------ the link verdict, simulated


@dataclass(frozen=True)
class Path:
    """A simulated path: each byte reaches the peer after ``forward`` seconds (plus up to
    ``jitter``, order kept), whose kernel acknowledges it ``delayed_ack`` seconds later
    (one ACK for every byte arrived by then), and the ACK comes back after ``backward``
    (plus up to ``jitter``)."""

    forward: float
    backward: float
    jitter: float
    delayed_ack: float
    seed: int


@dataclass
class _Kernel:
    """The sender's kernel on a simulated path: what TCP_INFO would say at a time."""

    path: Path
    cut: float | None  # from then on every packet is dropped, both ways
    sent: int = 0
    acks: list[tuple[float, int]] = field(default_factory=lambda: [(0.0, 0)])  # (at, acked)
    last_arrival: float = 0.0  # at the peer, of the last byte (order is kept)
    last_ack_back: float = 0.0  # at the sender, of the last ACK
    timer: float | None = None  # when the peer's pending delayed ACK fires
    received: int = 0  # bytes the peer's kernel holds

    def __post_init__(self) -> None:
        self.rng = random.Random(self.path.seed)  # the handshake's ACK is acks[0]

    def _dropped(self, at: float) -> bool:
        return self.cut is not None and at > self.cut

    def _fire(self, before: float) -> None:
        """The peer's pending ACK, if it fired by ``before``: on its way back."""
        if self.timer is None or self.timer > before:
            return
        back = self.timer + self.path.backward + self.rng.uniform(0, self.path.jitter)
        back = max(back, self.last_ack_back)
        self.timer = None
        if not self._dropped(back):
            self.last_ack_back = back
            self.acks.append((back, self.received))

    def send(self, now: float) -> None:
        self.sent += 1
        arrival = now + self.path.forward + self.rng.uniform(0, self.path.jitter)
        arrival = max(arrival, self.last_arrival)
        self.last_arrival = arrival
        if self._dropped(arrival):
            return
        self._fire(arrival)  # an ACK that fired before this byte came does not cover it
        self.received += 1
        if self.timer is None:
            self.timer = arrival + self.path.delayed_ack

    def info(self, now: float) -> Acks:
        self._fire(now)
        arrived = [(at, acked) for at, acked in self.acks if at <= now]
        last, acked = max(arrived)
        silent = int((now - last) * 1000) / 1000  # TCP_INFO counts whole ms
        return Acks(unacked=self.sent - acked, silent_for=silent)


def simulate(
    path: Path, waits: list[tuple[float, int, float]], cut: float | None = None
) -> list[tuple[float, str]]:
    """Drive :class:`Link` as ``Links`` does: ``waits`` are (idle seconds before, checks,
    seconds between checks); each check reads the kernel's ACK state, then sends a
    byte. The verdict after each check, with its time."""
    kernel, link, now = _Kernel(path, cut), Link(opened=0.0), 0.0
    link.connected(0.0)
    verdicts = []
    for idle, checks, every in waits:
        now += idle
        for _ in range(checks):
            verdict = link.acks(now, kernel.info(now))
            if verdict == ALIVE:
                kernel.send(now)
                link.sent(now)
            verdicts.append((now, verdict))
            now += every
    return verdicts


paths = st.builds(
    Path,
    forward=st.floats(0.0005, 0.04),
    backward=st.floats(0.0005, 0.04),
    jitter=st.floats(0.0, 0.01),  # one way at most 50 ms: round trips up to 100 ms
    delayed_ack=st.floats(0.0, 0.04),
    seed=st.integers(0, 2**16),
)
waits = st.lists(
    st.tuples(st.floats(0.0, 3.0), st.integers(1, 80), st.floats(0.005, 0.1)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300)
@given(paths, waits)
def test_a_peer_that_acknowledges_every_byte_is_never_unreachable(
    path: Path, schedule: list[tuple[float, int, float]]
) -> None:
    """Delayed ACKs up to 40 ms and round trips up to 100 ms keep a byte in flight at
    most checks, for as long as a wait lasts; the ACKs still come: never unreachable."""
    lost = [(round(t, 4), v) for t, v in simulate(path, schedule) if v != ALIVE]
    assert not lost, f"a peer that acknowledges every byte was declared {lost[0]}"


@settings(max_examples=150)
@given(paths, waits, st.floats(0.0, 1.0), st.floats(0.005, 0.1))
def test_a_cut_is_unreachable_within_a_second_and_a_half(
    path: Path, schedule: list[tuple[float, int, float]], offset: float, every: float
) -> None:
    """No packet passes after the cut (in a wait that began ``offset`` before it, after
    any earlier waits): unreachable within 1.5 s of the cut, never before it."""
    start = sum(idle + checks * step for idle, checks, step in schedule) + 0.5
    cut = start + offset
    checks = int((offset + 2.0) / every) + 1
    verdicts = simulate(path, [*schedule, (0.5, checks, every)], cut=cut)
    early = [(round(t, 4), v) for t, v in verdicts if t <= cut and v != ALIVE]
    assert not early, f"declared {early[0]} before the cut at {cut:.4f} s"
    found = [t for t, v in verdicts if v == UNREACHABLE]
    assert found, f"a cut at {cut:.4f} s never found: {verdicts[-3:]}"
    assert found[0] - cut <= 1.5, f"a cut at {cut:.4f} s found at {found[0]:.4f} s"


def test_a_new_byte_on_an_idle_link_is_judged_from_when_it_was_sent() -> None:
    """An idle link's last ACK is old: the byte a new wait sends has its own limit."""
    link = Link(opened=0.0)
    link.connected(0.0)
    assert link.acks(10.0, Acks(unacked=0, silent_for=10.0)) == ALIVE
    link.sent(10.0)
    assert link.acks(10.05, Acks(unacked=1, silent_for=10.05)) == ALIVE
    assert link.acks(10.79, Acks(unacked=1, silent_for=10.79)) == ALIVE
    assert link.acks(10.81, Acks(unacked=1, silent_for=10.81)) == UNREACHABLE
    assert link.acks(11.0, Acks(unacked=0, silent_for=0.0)) == UNREACHABLE  # final
    assert link.failed(errno.ECONNRESET) == UNREACHABLE and link.ended() == UNREACHABLE


def test_the_link_machine_refuses_bad_events_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="acks must be an Acks"):
        Link(opened=0.0).acks(1.0, (1, 0.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="before the link connected"):
        Link(opened=0.0).acks(1.0, Acks(unacked=1, silent_for=0.5))
    with pytest.raises(ValueError, match="now must be finite seconds"):
        Link(opened=0.0).pending(float("nan"))
    with pytest.raises(ValueError, match="limit must be positive"):
        Link(opened=0.0, limit=0)
    with pytest.raises(TypeError, match="unacked must be an int"):
        Acks(unacked=1.5, silent_for=0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="error_number must be an errno int"):
        Link(opened=0.0).failed("ETIMEDOUT")  # type: ignore[arg-type]
    assert Link(opened=0.0).acks(1.0, None) == ALIVE  # no TCP_INFO: errors alone decide


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


class _Store:
    """Where a slot's store lives, as a ``TCPStore`` client says (``host``, ``port``)."""

    host, port = "127.77.0.1", 29500


def test_a_store_request_on_the_steps_path_is_answered_bounded_or_told_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SlotProbes.ask: a request's answer or error comes back as is; one that never
    returns (a TCPStore request across a cut: its client's timeout does not end it) is a
    TimeoutError naming it while no member is unreachable, and LostRankError once a
    link found one unreachable and the store answers no probe either."""
    from scopedmesh.errors import LostRankError
    from scopedmesh.fault.protocol.membership import Decision

    probes = SlotProbes(_Store(), ReplicaKeys(), "127.0.0.1")
    current = Decision(3, ((0, "a"), (1, "b")), 0, 2)
    never = threading.Event()

    def ask(request: Any, timeout: float = 5.0) -> Any:
        return probes.ask(
            request, "the joins", timeout=timeout, replica=0, token="a", current=current
        )

    try:
        assert ask(lambda: 7) == 7
        with pytest.raises(KeyError, match="joins"):
            ask(lambda: {}["joins"])
        began = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"waited 0.3 s for the job's store to answer the joins"
        ):
            ask(never.wait, timeout=0.3)
        assert 0.3 <= time.monotonic() - began < 3.0
        asked: list[str] = []
        monkeypatch.setattr(
            "scopedmesh.fault.probes.probe", lambda address: asked.append(address)
        )  # no answer (None), as from a store across a cut
        probes._links.lost[(1, 0, "b")] = UNREACHABLE
        with pytest.raises(LostRankError, match=r"replica 0 \(incarnation a\) is cut off"):
            ask(never.wait, timeout=60.0)
        assert asked == ["127.77.0.1:29500"] and probes.cut_off
    finally:
        never.set()
        probes.close()


class _Work:
    """A fake operation's work, as gloo's: it ends ``after`` seconds after it is made
    (never: None), failing with ``error`` then. A collective's completes by itself and
    has a future; a point-to-point one's has none and completes only inside a wait,
    which blocks until it ends, and a second wait waits for another message. Any wait
    with a timeout is refused (on gloo, one that runs out closes the pair), and so is
    a collective's wait before it completed (it would block the caller)."""

    def __init__(self, after: float | None, error: Exception | None, point_to_point: bool) -> None:
        self.ends = None if after is None else time.monotonic() + after
        self.error, self.point_to_point, self.waits = error, point_to_point, 0
        self.waited = threading.Event()  # a point-to-point wait returned
        self.release = threading.Event()  # ends a point-to-point wait that never would
        self.future: torch.futures.Future[None] = torch.futures.Future()
        if after is not None and not point_to_point:
            threading.Timer(after, self.future.set_result, (None,)).start()

    def _ended(self) -> bool:
        return self.ends is not None and time.monotonic() >= self.ends

    def is_completed(self) -> bool:
        return self.waited.is_set() if self.point_to_point else self._ended()

    def get_future(self) -> torch.futures.Future[None]:
        if self.point_to_point:
            raise RuntimeError("Work::getFuture not implemented")
        return self.future

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if timeout is not None:
            raise AssertionError("a wait with a timeout: on gloo it closes the pair")
        if self.point_to_point:
            if self.waited.is_set():
                raise AssertionError("a second wait waits for another message (gloo's timeout)")
            while not self._ended():
                if self.release.wait(0.005):
                    raise RuntimeError("Timed out waiting for recv")  # gloo's timeout
            self.waited.set()
        elif not self._ended():
            raise AssertionError("a wait before the work completed would block")
        if self.error is not None:
            raise self.error
        return True


class _Group:
    def __init__(self, after: float | None, error: Exception | None = None) -> None:
        self.after, self.error = after, error
        self.works: list[_Work] = []

    def allreduce(self, tensors: list[Any]) -> _Work:
        self.works.append(_Work(self.after, self.error, point_to_point=False))
        return self.works[-1]

    def recv(self, tensors: list[Any], peer: int, tag: int) -> _Work:
        self.works.append(_Work(self.after, self.error, point_to_point=True))
        return self.works[-1]

    def size(self) -> int:
        return 3


def _counting(lost_at: int | None) -> tuple[list[int], Any]:
    calls = [0]

    def check() -> str | None:
        calls[0] += 1
        return "replica 2 coordinate 0 is unreachable" if calls[0] == lost_at else None

    return calls, check


@pytest.mark.parametrize("operation", ["allreduce", "recv"])
def test_a_wait_checks_the_links_and_fails_once_they_name_a_lost_member(operation: str) -> None:
    calls, check = _counting(lost_at=3)
    inner = _Group(after=None)
    group = WatchedGroup(inner, check)
    assert group.size() == 3  # anything else is the group's own
    start = time.monotonic()
    work = group.allreduce([]) if operation == "allreduce" else group.recv([], 1, 0)
    with pytest.raises(CollectiveFailed, match="replica 2 coordinate 0 is unreachable"):
        work.wait()
    assert calls == [3] and time.monotonic() - start >= 3 * CHECK_EVERY
    with pytest.raises(CollectiveFailed, match="let go of"):
        group.allreduce([])
    inner.works[0].release.set()


@pytest.mark.parametrize("operation", ["allreduce", "recv"])
def test_a_late_operation_is_waited_for_without_a_timeout_and_is_its_own_answer(
    operation: str,
) -> None:
    """A peer 0.3 s late: the wait checks the links meanwhile and never waits on the
    work with a timeout (which closes gloo's pair); a point-to-point operation, which
    gloo completes only inside a wait, is waited for on a helper thread."""
    calls, check = _counting(lost_at=None)
    inner = _Group(after=0.3)
    group = WatchedGroup(inner, check)
    start = time.monotonic()
    work = group.allreduce([]) if operation == "allreduce" else group.recv([], 1, 0)
    assert work.wait() is True
    assert time.monotonic() - start >= 0.3 and work.is_completed()
    assert calls[0] >= 2 and inner.works[0].waits == 1  # checked while late; one wait
    assert work.wait() is True and inner.works[0].waits == (1 if operation == "recv" else 2)
    failing = WatchedGroup(_Group(after=0.1, error=RuntimeError("Connection closed")), check)
    late = failing.allreduce([]) if operation == "allreduce" else failing.recv([], 1, 0)
    with pytest.raises(RuntimeError, match="Connection closed"):
        late.wait()


def test_a_wait_with_a_timeout_names_what_it_waited_for_and_lets_the_group_go() -> None:
    calls, check = _counting(lost_at=None)
    inner = _Group(after=None)
    group = WatchedGroup(inner, check)
    with pytest.raises(CollectiveFailed, match=r"waited 0.2 s for recv from member 1"):
        group.recv([], 1, 0).wait(timedelta(seconds=0.2))
    assert calls[0] >= 1
    with pytest.raises(CollectiveFailed, match="let go of"):
        group.allreduce([])
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta"):
        WatchedGroup(_Group(after=0.0), check).allreduce([]).wait(5)
    inner.works[0].release.set()  # the helper thread's wait ends (at gloo's timeout)


def test_a_dropped_group_goes_at_once_its_works_hold_no_reference_to_it() -> None:
    """A member that drops its group (a step cut short) closes its connections at once,
    and its peers' operations fail: nothing it handed out may keep it in a cycle that
    only the garbage collector would break."""
    _, check = _counting(lost_at=None)
    inner = _Group(after=0.0)
    gone = weakref.ref(inner)
    group = WatchedGroup(inner, check)
    del inner
    collecting = gc.isenabled()
    gc.disable()
    try:
        assert group.allreduce([]).wait() is True
        pending = group.allreduce([])  # handed out: it keeps the group, as a torch work does
        del group
        assert gone() is not None
        del pending
        assert gone() is None
    finally:
        if collecting:
            gc.enable()


def test_point_to_point_operations_are_waited_for_as_posted_and_none_waits_behind_another() -> None:
    """The group's waiter waits on each receive from the moment it is posted, in order;
    a caller that waits on a later one first (the earlier one's peer has yet to send)
    gets it after at most one check interval, on a thread of its own."""
    _, check = _counting(lost_at=None)
    inner = _Group(after=None)
    group = WatchedGroup(inner, check)
    first = group.recv([], 1, 0)  # never ends until released: the waiter waits on it
    inner.after = 0.05
    second = group.recv([], 2, 0)
    start = time.monotonic()
    assert second.wait() is True
    assert time.monotonic() - start < 10 * CHECK_EVERY  # not behind the first
    assert not first.is_completed()
    inner.works[0].release.set()  # gloo's timeout, say: the first fails, as itself
    with pytest.raises(RuntimeError, match="Timed out waiting for recv"):
        first.wait()
    assert [w.waits for w in inner.works] == [1, 1]  # one gloo wait each, never timed
