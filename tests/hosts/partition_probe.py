"""Is the partition silent? Plain TCP across the cut, seen from both hosts.

Run by the harness: ``bash .ci/two_hosts <python> tests/hosts/partition_probe.py``
(``TWO_HOSTS_PARTITION=linkdown`` for the other method). Host A opens three
connections to host B before the cut:

* ``idle``: a plain connection nobody writes to (what the liveness watch's ring is);
* ``keepalive``: idle too, with TCP keepalive (1 s idle, 1 s interval, 3 probes);
* ``sending``: both ends write to it after the cut, with ``TCP_USER_TIMEOUT`` 3 s
  (what a store request or a gloo send is).

After the cut each host watches every connection for ``WINDOW`` seconds and tries a
new connection to the other host (what gloo's rendezvous and the store's reconnect
do); it prints one JSON line: what each socket reported and when, and the change in
the kernel's counters (RSTs sent and received, ICMP errors). A silent partition
shows no event on ``idle`` within the window, an error on ``keepalive`` and
``sending`` only from this host's own timers (``ETIMEDOUT``), no RST and no ICMP.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import sys
import time
from pathlib import Path

from _hosts import wait_file

WINDOW = 8.0  # seconds each host watches its connections after the cut
KINDS = ("idle", "keepalive", "sending")


def port() -> int:
    return int(os.environ["MASTER_PORT"])


def counters() -> dict[str, int]:
    """Tcp and Icmp counters of this network namespace (/proc/net/snmp, /proc/net/netstat)."""
    wanted = {
        "Tcp": ("OutRsts", "InErrs", "EstabResets", "AttemptFails"),
        "Icmp": ("InDestUnreachs", "OutDestUnreachs"),
        "TcpExt": ("TCPAbortOnTimeout", "TCPAbortOnData", "TCPAbortOnClose"),
    }
    found: dict[str, int] = {}
    for name in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(name).read_text().splitlines()
        for head, values in zip(lines[::2], lines[1::2]):
            kind, *fields = head.split()
            kind = kind.rstrip(":")
            for field, value in zip(fields, values.split()[1:]):
                if field in wanted.get(kind, ()):
                    found[f"{kind}.{field}"] = int(value)
    # TCP's RST counts as received: the kernel has no direct counter; EstabResets counts
    # connections reset by either side, InErrs/AttemptFails catch a reset during connect.
    return found


def configure(sock: socket.socket, kind: str) -> None:
    if kind == "keepalive":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    if kind == "sending":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 3000)


def try_connect(address: str) -> dict[str, object]:
    started = time.monotonic()
    try:
        with socket.create_connection((address, port()), timeout=5.0):
            outcome = "connected"
    except OSError as error:
        outcome = f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "seconds": round(time.monotonic() - started, 2)}


def watch(socks: dict[str, socket.socket], cut: float) -> dict[str, object]:
    """Until WINDOW after the cut: the first event on each socket, and when it came."""
    seen: dict[str, object] = {}
    for kind in KINDS:
        seen[kind] = "nothing"
    open_ = dict(socks)
    while open_ and time.monotonic() < cut + WINDOW:
        readable, _, _ = select.select(list(open_.values()), [], [], 0.05)
        for sock in readable:
            kind = next(k for k, s in open_.items() if s is sock)
            try:
                data = sock.recv(4096)
                event = "EOF (FIN)" if not data else f"data ({len(data)} bytes)"
            except OSError as error:
                name = errno.errorcode.get(error.errno or 0, str(error.errno))
                event = f"{type(error).__name__} {name}"
            seen[kind] = f"{event} after {time.monotonic() - cut:.2f} s"
            del open_[kind]
    return seen


def main() -> int:
    shared = Path(os.environ["TWO_HOSTS_DIR"])
    me, other = ("A", "B") if os.environ["HOST_INDEX"] == "0" else ("B", "A")
    mine = os.environ[f"HOSTS_ADDR_{me}"]
    theirs = os.environ[f"HOSTS_ADDR_{other}"]
    listener = socket.create_server((mine, port()), backlog=8)
    (shared / f"listening-{me}").touch()
    wait_file(shared / f"listening-{other}", 20)
    socks: dict[str, socket.socket] = {}
    if me == "A":
        for kind in KINDS:
            sock = socket.create_connection((theirs, port()), timeout=5)
            configure(sock, kind)
            sock.sendall(kind.encode().ljust(16))
            socks[kind] = sock
        wait_file(shared / "accepted-B", 20)
        before = counters()
        Path(os.environ["PARTITION_REQUEST"]).touch()
    else:
        for _ in KINDS:
            sock, _ = listener.accept()
            kind = sock.recv(16).decode().strip()
            configure(sock, kind)
            socks[kind] = sock
        before = counters()
        (shared / "accepted-B").touch()
    wait_file(Path(os.environ["PARTITION_DONE"]), 20)
    cut = time.monotonic()
    for _ in range(4):  # a few writes: what a store request or a gloo send does
        socks["sending"].send(b"x" * 1024)
    report: dict[str, object] = {"host": socket.gethostname()}
    report["connections"] = watch(socks, cut)
    report["new connection to the other host"] = try_connect(theirs)
    after = counters()
    report["counters changed"] = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    print(json.dumps(report))
    (shared / f"finished-{me}").touch()
    wait_file(shared / f"finished-{other}", 30)  # keep the listener until both are done
    listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
