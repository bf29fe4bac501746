"""The liveness watch's socket rules, without a world: keepalive options and why a link failed."""

from __future__ import annotations

import errno
import socket

import pytest

from scopedmesh.fault.liveness.deaths import CLOSED, UNREACHABLE
from scopedmesh.fault.liveness.deaths import parse_deaths as _deaths
from scopedmesh.fault.liveness.ring import UNREACHABLE_AFTER
from scopedmesh.fault.liveness.ring import keep_alive as _keep_alive
from scopedmesh.fault.liveness.ring import reason_of as _reason


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (TimeoutError(errno.ETIMEDOUT, "Connection timed out"), UNREACHABLE),  # keepalive failed
        (TimeoutError("timed out"), UNREACHABLE),  # connect got no answer
        (OSError(errno.EHOSTUNREACH, "No route to host"), UNREACHABLE),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), UNREACHABLE),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), CLOSED),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), CLOSED),
        (OSError("no errno"), CLOSED),
    ],
)
def test_a_failed_link_is_unreachable_only_when_the_host_was_silent(
    error: OSError, reason: str
) -> None:
    assert _reason(error) == reason


def test_ring_sockets_probe_the_peer_host_within_the_stated_time() -> None:
    with socket.socket() as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        _keep_alive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            every = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            assert idle + every * probes == UNREACHABLE_AFTER


def test_the_stores_list_of_deaths_reads_back_with_reasons() -> None:
    assert _deaths("") == {}
    assert _deaths(f"3:{CLOSED},5:{UNREACHABLE},") == {3: CLOSED, 5: UNREACHABLE}
