"""The link verdict on a slow path between two namespaces (run by ``test_links_path.py``).

``ip netns exec <ns_a> python links_path.py <host:port> <peer pid> <relay pid>``: holds
a :class:`~scopedmesh.fault.links.Links` link to the peer's listener across the relay
(``links_relay.py``, 10-50 ms each way) and checks it every ``CHECK_EVERY``, as a
wait does: for 3 s; while the peer's process is stopped (SIGSTOP) for 1.5 s; after
1 s idle; then through a cut (SIGUSR1 to the relay) until a verdict. Prints one JSON
line: the verdicts per phase, the round trip TCP_INFO measured, the longest run of
checks that each found a byte in flight (what the old rule evicted for), the
acknowledgement state read at the verdict, and the seconds from the cut to it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time
from typing import Any

from scopedmesh.fault.links import CHECK_EVERY, Links, tcp_acks
from scopedmesh.fault.protocol.link import Acks

SLOT = (1, 0, "peer")


def main(address: str, peer: int, relay: int) -> dict[str, Any]:
    seen: list[tuple[float, Acks | None, int]] = []  # (time, acks, tcpi_rtt in µs)

    def recorded(sock: socket.socket) -> Acks | None:
        acks = tcp_acks(sock)
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        seen.append((time.monotonic(), acks, struct.unpack_from("=I", raw, 8 + 15 * 4)[0]))
        return acks

    links = Links(acks=recorded)
    links.retarget({SLOT: address})
    report: dict[str, Any] = {}

    def checks(phase: str, seconds: float) -> None:
        start, verdicts = time.monotonic(), []
        while time.monotonic() - start < seconds:
            verdicts.append(links.check(SLOT))
            time.sleep(CHECK_EVERY)
        report[phase] = sorted({str(v) for v in verdicts})

    checks("connect", 0.5)
    first = len(seen)
    checks("path", 3.0)
    os.kill(peer, signal.SIGSTOP)
    try:
        checks("straggler", 1.5)
    finally:
        os.kill(peer, signal.SIGCONT)
    checks("after", 0.5)
    busy = seen[first:]
    time.sleep(1.0)  # idle: nothing sent, the last ACK grows old
    checks("idle", 1.0)
    run, longest, start = 0.0, 0.0, None  # checks in a row that each found a byte in flight
    for at, acks, _ in busy:
        if acks is not None and acks.unacked > 0:
            start = at if start is None else start
            run = at - start
        else:
            start, run = None, 0.0
        longest = max(longest, run)
    report["in_flight_run"] = round(longest, 3)
    flying = [acks is not None and acks.unacked > 0 for _, acks, _ in busy]
    report["in_flight_share"] = round(sum(flying) / max(1, len(flying)), 3)
    rtts = sorted(rtt for _, _, rtt in busy if rtt)
    report["rtt_ms"] = [round(rtts[0] / 1000, 1), round(rtts[len(rtts) // 2] / 1000, 1)]
    cut = time.monotonic()
    os.kill(relay, signal.SIGUSR1)
    verdict = None
    while verdict is None and time.monotonic() - cut < 5.0:
        verdict = links.check(SLOT)
        if verdict is None:
            time.sleep(CHECK_EVERY)
    report["cut"] = [str(verdict), round(time.monotonic() - cut, 3)]
    last = seen[-1][1]
    report["cut_acks"] = None if last is None else [last.unacked, last.silent_for]
    links.close()
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))), flush=True)
