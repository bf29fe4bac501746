"""What forming groups asks of torch's distributed store, and what that means at scale.

    python -m benchmarks.store              # counts, this machine's TCPStore throughput, projection
    python -m benchmarks.store --counts     # the counts only

1. **Counts.** A world of 8 gloo ranks, each rank's default store wrapped in a
   :class:`CountingStore`, forms groups of 2, 4 and 8 members three ways:
   scopedmesh (``get_group_along_axis``: a new mesh's first group, and a later group of
   a mesh that has formed one already), torch's own
   ``new_group(ranks, use_local_synchronization=True)`` (each rank its own
   group) and ``init_device_mesh`` (every group of both dimensions, on every
   rank). Requests are split into scopedmesh's own (generation counters, the
   formation barrier, deleting what formation wrote) and the backend's (gloo's
   rendezvous: each member publishes its address and reads every peer's).
2. **Throughput.** A real ``TCPStore`` server on 127.0.0.1 and client processes
   replaying the formation mix (add, set, wait, get, delete) as fast as they can.
3. **Projection.** Store requests and store-host time of a dp x pp x tp launch
   (tp = pp = 8) at 2^10 .. 2^16 ranks, every rank forming its three groups,
   from the per-member counts fitted in 1 and the throughput measured in 2.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

WORLD = 8
SIZES = (2, 4, 8)
# Keys scopedmesh's formation writes itself (see scopedmesh.c10d.groups: _next_generation,
# _all_formed; scopedmesh.c10d.diagnosis: the process record, and on the slow path the
# announcement and a deadlock's agreement); everything else under a group's prefix is the
# backend's rendezvous.
OWN_MARKERS = (
    "/generation/",
    "/formed",
    "/all-formed",
    "scopedmesh-process/",
    "scopedmesh-forming/",
    "scopedmesh-deadlock/",
)


class CountingStore(dist.Store):
    """A store that forwards to ``inner`` and counts each request by kind, owner and bytes."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.requests: Counter[tuple[str, str]] = Counter()  # (owner, kind) -> count
        self.bytes = 0

    def _count(self, kind: str, keys: list[str], payload: int = 0) -> None:
        own = any(marker in key for key in keys for marker in OWN_MARKERS)
        self.requests["own" if own else "backend", kind] += 1
        self.bytes += sum(len(key) for key in keys) + payload

    def set(self, key: str, value: Any) -> None:
        self._count("set", [key], len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count("get", [key], len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._count("add", [key], 8)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set", [key], len(expected) + len(desired))
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait", list(keys))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._count("check", list(keys))
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        # Only scopedmesh deletes (the keys its formation and gloo's rendezvous wrote).
        self.requests["own", "delete_key"] += 1
        self.bytes += len(key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys", [])
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def totals(self) -> dict[str, int]:
        own = sum(n for (owner, _), n in self.requests.items() if owner == "own")
        backend = sum(n for (owner, _), n in self.requests.items() if owner == "backend")
        return {"own": own, "backend": backend, "all": own + backend, "bytes": self.bytes}


def _counting_world() -> CountingStore:
    """Count WORLD's store: torch's ``new_group``, ``init_device_mesh`` and scopedmesh all read
    it from the default group's entry of ``_world.pg_map``, so the counter goes there.

    (A Python store cannot sit under torch's C++ ``PrefixStore`` for ``delete_key``, which
    only scopedmesh calls, on the store it is handed: this one, directly.)
    """
    default_pg = c10d._get_default_group()
    backend, real = c10d._world.pg_map[default_pg]
    store = CountingStore(real)
    c10d._world.pg_map[default_pg] = (backend, store)
    return store


def _counted(store: CountingStore, step: Callable[[], object]) -> dict[str, int]:
    """This rank's store requests while ``step()`` runs (WORLD's barriers use no store)."""
    dist.barrier()
    before, before_bytes = Counter(store.requests), store.bytes
    step()
    dist.barrier()  # every member is through formation before the next way
    delta = store.requests - before
    own = sum(n for (owner, _), n in delta.items() if owner == "own")
    backend = sum(n for (owner, _), n in delta.items() if owner == "backend")
    return {
        "own": own,
        "backend": backend,
        "all": own + backend,
        "bytes": store.bytes - before_bytes,
    }


def _scopedmesh(rows: int, size: int) -> None:
    from scopedmesh import ProcessGroupMesh

    with ProcessGroupMesh(rows, size, timeout=60) as mesh:
        mesh.get_group_along_axis(1)


def _scopedmesh_later(store: CountingStore, rows: int, size: int) -> dict[str, int]:
    """A mesh's later group: the mesh has formed a group already (its process record is in)."""
    from scopedmesh import ProcessGroupMesh

    with ProcessGroupMesh(rows, size, timeout=60) as mesh:
        mesh.get_group_along_axis((0, 1))  # every rank: the mesh's first group, not counted
        return _counted(store, partial(mesh.get_group_along_axis, 1))


def _new_group(rank: int, size: int, made: list[dist.ProcessGroup]) -> None:
    first = rank - rank % size
    made.append(dist.new_group(list(range(first, first + size)), use_local_synchronization=True))


def count_world(rank: int, world_size: int) -> dict[str, dict[int, dict[str, int]]]:
    """Per way and group size: this rank's store requests to form its group(s)."""
    from torch.distributed.device_mesh import init_device_mesh

    store = _counting_world()
    out: dict[str, dict[int, dict[str, int]]] = {}
    for size in SIZES:
        rows = world_size // size
        out.setdefault("scopedmesh", {})[size] = _counted(store, partial(_scopedmesh, rows, size))
        if rows > 1:  # with one row the later group is the first one, cached
            out.setdefault("scopedmesh_later", {})[size] = _scopedmesh_later(store, rows, size)
        made: list[dist.ProcessGroup] = []
        out.setdefault("new_group", {})[size] = _counted(
            store, partial(_new_group, rank, size, made)
        )
        # Destroyed only after WORLD's barrier: a member that destroys its group while a peer
        # is still connecting breaks the peer's formation (DESIGN.md, hazard 8).
        for group in made:
            dist.destroy_process_group(group)
        out.setdefault("device_mesh", {})[size] = _counted(
            store, partial(init_device_mesh, "cpu", (rows, size))
        )
    return out


def counts() -> dict[str, dict[int, dict[str, int]]]:
    """Per way and group size: requests per member (mean) and on the store host (sum)."""
    from scopedmesh.testing import run_world

    results = run_world(count_world, WORLD, timeout=600.0)
    table: dict[str, dict[int, dict[str, int]]] = {}
    for way in ("scopedmesh", "scopedmesh_later", "new_group", "device_mesh"):
        table[way] = {}
        for size in SIZES:
            if size not in results[0][way]:
                continue
            per_rank = [r[way][size] for r in results]
            table[way][size] = {
                key: sum(p[key] for p in per_rank) for key in ("own", "backend", "all", "bytes")
            }
    return table


# ------------------------------------------------------------------ throughput

MIX = ("add", "set", "wait", "get", "get", "wait", "delete_key")  # one member's formation, roughly


def _client(port: int, seconds: float, index: int, done: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    key = f"bench/{index}"
    store.set(key, b"x" * 64)
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for kind in MIX:
            if kind == "add":
                store.add(f"{key}/n", 1)
            elif kind == "set":
                store.set(key, b"x" * 64)
            elif kind == "wait":
                store.wait([key])
            elif kind == "get":
                store.get(key)
            else:
                store.delete_key(f"{key}/gone")
            count += 1
    done.put(count)


def throughput(clients: int = 8, seconds: float = 3.0) -> float:
    """Requests per second one TCPStore server on loopback answers for ``clients`` processes."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    procs = [
        context.Process(target=_client, args=(server.port, seconds, i, done))
        for i in range(clients)
    ]
    for proc in procs:
        proc.start()
    total = sum(done.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    return total / seconds


# ------------------------------------------------------------------ projection


def per_member(table: dict[str, dict[int, dict[str, int]]], way: str) -> tuple[float, float]:
    """Fit requests per member of a group of n members as a + b * n (least squares)."""
    xs = list(SIZES)
    ys = [table[way][n]["all"] / WORLD for n in xs]  # every rank is a member of one group
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - b * mean_x, b


def project(a: float, b: float, rate: float) -> list[tuple[int, int, float]]:
    """(world, store requests, seconds on one store host) for dp x pp x tp, tp = pp = 8."""
    rows = []
    for exponent in (10, 12, 14, 16):
        world = 1 << exponent
        sizes = (world // 64, 8, 8)
        requests = int(world * sum(a + b * n for n in sizes))
        rows.append((world, requests, requests / rate))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store")
    parser.add_argument("--counts", action="store_true", help="the counts only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = counts()
    print("store requests to form one group per rank, world of 8 (own + backend = all; bytes)")
    print("| way | group size | scopedmesh's own | backend (gloo) | all | bytes |")
    print("|---|---|---|---|---|---|")
    for way, rows in table.items():
        for size, t in rows.items():
            print(f"| {way} | {size} | {t['own']} | {t['backend']} | {t['all']} | {t['bytes']} |")
    if args.counts:
        return
    rate = throughput(clients=min(8, 2 * (os.cpu_count() or 1)))
    print(f"\nTCPStore on loopback, formation mix: {rate:,.0f} requests/s")
    for way in ("scopedmesh", "new_group"):  # init_device_mesh makes every group on every rank
        a, b = per_member(table, way)
        print(f"\n{way}: requests per member of an n-member group ~ {a:.1f} + {b:.2f} n")
        print("| world | store requests | store-host time |")
        print("|---|---|---|")
        for world, requests, seconds in project(a, b, rate):
            print(f"| 2^{world.bit_length() - 1} | {requests:,} | {seconds:,.1f} s |")


if __name__ == "__main__":
    main()
