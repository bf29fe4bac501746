"""How long destroying one idle gloo group takes, and why (the CPU; no GPU needed).

    python -m benchmarks.gloo_destroy            # worlds of 2, 4 and 8 ranks

Each spawned world (gloo on loopback) forms a group over all its ranks, runs one
all_reduce on it, and times ``destroy_process_group`` of that idle group, five
times; rank 0 prints the milliseconds. A heal shuts down every group of an
aborted mesh, so this is its cost per group.

What it shows: gloo's TCP transport closes a pair by taking its socket out of
its event loop's epoll set and then waiting for the loop's next tick, and the
loop ticks when an event arrives or its ``epoll_wait`` times out (10 ms). An
idle group has no events, so its destroy waits for those timeouts: about 20 ms
whatever its size, with the CPU idle meanwhile.

The second line of each size shuts the group's connections first, as an abort
or a mesh's close does (:mod:`scopedmesh.c10d.gloo_sockets`): the time to shut
them (every peer learns then), and then to destroy the group.

The third (4 and 8 ranks) closes the three idle groups a rank holds in a
``(2, n/2)`` mesh (along each axis and over both): destroyed one after
another, each waiting for its loop's tick, and by the mesh's close, which
starts every group's destructor on a thread before it waits for any.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scopedmesh import ProcessGroupMesh
from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.gloo_sockets import Connections, open_descriptors

TRIALS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rank_main(rank: int, size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    plain, shut = [], []
    for trial in range(2 * TRIALS):
        before = open_descriptors()
        group = dist.new_group(list(range(size)))
        connections = Connections.find(before, size=size)
        dist.all_reduce(torch.ones(4), group=group)
        dist.barrier()
        found = len(connections)
        began = time.perf_counter()
        if trial % 2:
            connections.shut()
        shut_at = time.perf_counter()
        dist.destroy_process_group(group)
        del group
        ended = time.perf_counter()
        if trial % 2:
            shut.append((found, shut_at - began, ended - shut_at))
        else:
            plain.append(ended - began)
        dist.barrier()
    serial, together = closing_a_mesh(size) if size >= 4 else ([], [])
    if rank == 0:
        shown = ", ".join(f"{1000 * t:.1f}" for t in plain)
        print(f"{size} ranks: destroying an idle group took {shown} ms", flush=True)
        shown = ", ".join(f"{1000 * a:.1f} + {1000 * b:.1f}" for _, a, b in shut)
        found = sorted({n for n, _, _ in shut})
        print(f"{size} ranks: shutting its {found} connections, then destroying: {shown} ms")
        if serial:
            shown = ", ".join(f"{1000 * t:.1f}" for t in serial)
            print(f"{size} ranks: 3 idle groups of a mesh, one after another: {shown} ms")
            shown = ", ".join(f"{1000 * t:.1f}" for t in together)
            print(f"{size} ranks: the same, closed by the mesh (together): {shown} ms", flush=True)
    dist.destroy_process_group()


def closing_a_mesh(size: int) -> tuple[list[float], list[float]]:
    """Seconds to destroy this rank's three idle groups of a ``(2, size/2)`` mesh one after
    another (``groups.destroy`` each), then (a new mesh each trial) by ``mesh.close()``."""
    serial, together = [], []
    for trial in range(2 * TRIALS):
        mesh = ProcessGroupMesh(2, size // 2, names=("dp", "tp"))
        groups = [mesh.get_group_along_axis(a) for a in ("dp", "tp", ("dp", "tp"))]
        for group in groups:
            dist.all_reduce(torch.ones(4), group=group)
        dist.barrier()
        began = time.perf_counter()
        if trial % 2 == 0:
            for group in groups:
                _c10d.destroy(group)
            serial.append(time.perf_counter() - began)
        mesh.close()
        if trial % 2:
            together.append(time.perf_counter() - began)
        del groups
        dist.barrier()
    return serial, together


def main() -> int:
    for size in (2, 4, 8):
        mp.spawn(rank_main, args=(size, free_port()), nprocs=size)  # type: ignore[attr-defined,no-untyped-call]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
