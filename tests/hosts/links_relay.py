"""A path between two network namespaces with a delay, and a cut on demand.

``ip netns exec <ns_a> python links_relay.py <ns_b> <device> <low> <high>`` attaches
to the TUN device ``<device>`` of both namespaces (made beforehand, ``ip tuntap add
dev <device> mode tun``; the second through ``setns``), then moves every IP packet
from one to the other after holding it ``low``-``high`` seconds (each packet's own
delay, uniform; the order of each direction kept). This kernel has no ``netem``:
the packets, and so the ACKs, are the real kernels' own; a TCP proxy would answer
ACKs itself. SIGUSR1 cuts the path (every packet dropped, those held too, nothing
sent back: a silent cut), SIGUSR2 heals it. It prints ``ready`` once attached and
runs until SIGTERM (or ``limit`` seconds, a bound for a forgotten relay).
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000


def attach(device: str) -> int:
    """A descriptor on TUN ``device`` of this process's network namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def enter(namespace: str) -> None:
    """Move this (single-threaded) process into network namespace ``namespace``."""
    with open(f"/run/netns/{namespace}") as handle:
        setns = getattr(os, "setns", None)  # Python 3.12+
        if setns is not None:
            setns(handle.fileno(), CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")


def main(ns_b: str, device: str, low: float, high: float, limit: float = 120.0) -> None:
    a = attach(device)
    enter(ns_b)
    b = attach(device)
    cut = [False]
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        a: collections.deque(),
        b: collections.deque(),
    }
    other = {a: b, b: a}

    def on_cut(signum: int, frame: object) -> None:
        cut[0] = signum == signal.SIGUSR1
        if cut[0]:
            for queue in queues.values():
                queue.clear()

    signal.signal(signal.SIGUSR1, on_cut)
    signal.signal(signal.SIGUSR2, on_cut)
    rng = random.Random(os.getpid())
    print("ready", flush=True)
    end = time.monotonic() + limit
    while time.monotonic() < end:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        wait = max(0.0, min(due) - now) if due else 0.1
        try:
            readable, _, _ = select.select([a, b], [], [], wait)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if cut[0]:
                    continue
                queue = queues[other[fd]]  # packets on their way to the other side
                last = queue[-1][0] if queue else now
                queue.append((max(last, now + rng.uniform(low, high)), packet))
        now = time.monotonic()
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                _, packet = queue.popleft()
                try:
                    os.write(fd, packet)
                except OSError:
                    pass  # the device went down: the run is ending


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
