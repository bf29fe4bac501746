"""What each rank runs in tests/world/test_diagnosis.py: groups that cannot form, and why.

Every scenario returns, per rank, what its request raised (type and message),
how long it took, who the rank is (pid, host), and what is left in the store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

import torch.distributed as dist
from _workers_common import summed, wait_gone

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.diagnosis import process_key
from scopedmesh.errors import GroupFormationError
from scopedmesh.fault.liveness import LivenessWatch
from scopedmesh.mesh import ProcessGroupMesh

LONG = 120.0  # a mesh timeout the diagnosis must beat by far
SWAPPED = 2.0  # swapped_with_barrier: rank 0 waits it out while rank 1 sits in a barrier


def ask(mesh: ProcessGroupMesh, axis: Any, indices: Any = None) -> dict[str, Any]:
    """Request a group; the outcome, the time it took, and (when formed) its member count."""
    started = time.monotonic()
    try:
        group = mesh.get_group_along_axis(axis, indices_at_axis=indices)  # ASK
    except GroupFormationError as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - started,
        }
    return {"sum": None if group is None else summed(group), "seconds": time.monotonic() - started}


def me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def leftovers() -> list[str]:
    """Keys of the store that scopedmesh left and should not have (after every rank is done).

    Generation counters and process records are kept by design (one per member and rank
    set, one per rank); anything else of scopedmesh's is residue.
    """
    store = _c10d.default_store()
    keys = store.list_keys() if hasattr(store, "list_keys") else []
    return sorted(
        key
        for key in keys
        if "scopedmesh" in key and "/generation/" not in key and "scopedmesh-process/" not in key
    )


def _publish_pid(rank: int) -> None:
    _c10d.default_store().set(f"test-diagnosis/pid/{rank}", str(os.getpid()))


def _survivors_meet(count: int) -> None:
    """A store-only barrier of ``count`` ranks (WORLD's would wait for the dead one)."""
    store = _c10d.default_store()
    store.add("test-diagnosis/survivors", 1)
    end = time.monotonic() + 60
    while int(store.add("test-diagnosis/survivors", 0)) < count and time.monotonic() < end:
        time.sleep(0.05)


def _recovers(rank: int, world_size: int) -> int:
    """After a failure, every rank asks for the whole world's group: it forms."""
    dist.barrier()
    with ProcessGroupMesh(world_size, names=("all",), timeout=LONG) as mesh:
        formed = ask(mesh, "all")
    return int(formed.get("sum") or 0)


def _finish(rank: int, world_size: int, out: dict[str, Any]) -> dict[str, Any]:
    out["recovered"] = _recovers(rank, world_size)
    dist.barrier()
    out["leftovers"] = leftovers()
    out["live"] = _c10d.live_group_count()
    dist.barrier()
    return {**out, **me()}


# ------------------------------------------------------------------ deadlocks

# Three ranks, the groups {0,1}, {1,2}, {0,2}, each rank asking first for the one
# its successor asks for last: every rank waits for the next one.
CYCLE3 = {0: ([0, 1], [0, 2]), 1: ([1, 2], [0, 1]), 2: ([0, 2], [1, 2])}


def cycle3(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with ProcessGroupMesh(3, names=("x",), timeout=LONG) as mesh:
        out["first"] = ask(mesh, "x", CYCLE3[rank][0])
        out["second_skipped"] = "type" in out["first"]
    return _finish(rank, world_size, out)


# Four ranks in a 2 x 2 mesh: ranks 0 and 3 ask for dp first, ranks 1 and 2 for tp
# first: 0 waits for 2 (dp [0, 2]), 2 for 3 (tp [2, 3]), 3 for 1 (dp [1, 3]), 1 for 0.
def cycle4(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    order = ("dp", "tp") if rank in (0, 3) else ("tp", "dp")
    with ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=LONG) as mesh:
        out["first"] = ask(mesh, order[0])
    return _finish(rank, world_size, out)


# ------------------------------------------------------------------ peers that do not ask


def swapped_with_barrier(
    rank: int, world_size: int, hidden: bool = False, warm: bool = True
) -> dict[str, Any]:
    """Two ranks: rank 0 asks for the group, then joins a barrier; rank 1 the other way round.

    With ``warm``, both formed a group before; without, neither ever formed one (each
    only made its mesh). Rank 1 is inside a collective, which no store can see: rank 0
    is told at its timeout that rank 1 is alive and outside any group request.
    ``hidden``: rank 1's record says another host, so rank 0 cannot tell whether it
    runs, and is told the likely causes instead.
    """
    out: dict[str, Any] = {}
    if warm:
        with ProcessGroupMesh(2, names=("all",), timeout=LONG) as first:
            out["before"] = ask(first, "all")
    with ProcessGroupMesh(2, names=("tp",), timeout=SWAPPED) as mesh:
        if hidden and rank == 1:  # a process record no peer can check: "another host"
            elsewhere = {"host": "another-host", "ns": "", "pid": 1, "start": ""}
            _c10d.default_store().set(process_key(rank), json.dumps(elsewhere))
        dist.barrier()
        if rank == 0:
            out["first"] = ask(mesh, "tp")
            dist.barrier()
        else:
            dist.barrier()
        out["again"] = ask(mesh, "tp")  # both ask now: it forms
    return _finish(rank, world_size, out)


def missing_peers(rank: int, world_size: int) -> dict[str, Any]:
    """Three ranks: rank 0 asks for {0,1,2}; rank 1 waits in {1,2}; rank 2 closed its mesh.

    Rank 1 waits longer than rank 0, so its announcement is still there at rank 0's timeout.
    """
    out: dict[str, Any] = {}
    mesh = ProcessGroupMesh(3, names=("x",), timeout=3.0 if rank == 0 else 8.0)
    with mesh:
        if rank == 0:
            out["first"] = ask(mesh, "x")
        elif rank == 1:
            out["first"] = ask(mesh, "x", [1, 2])
    if rank == 2:
        out["closed"] = mesh.closed
    return _finish(rank, world_size, out)


def slow_peer(rank: int, world_size: int, delay: float) -> dict[str, Any]:
    """The last rank asks ``delay`` seconds late: the group forms, with no false alarm."""
    out: dict[str, Any] = {}
    with ProcessGroupMesh(world_size, names=("x",), timeout=LONG) as mesh:
        if rank == world_size - 1:
            time.sleep(delay)
        out["first"] = ask(mesh, "x")
    return _finish(rank, world_size, out)


# ------------------------------------------------------------------ dead peers


def dead_peer(rank: int, world_size: int, how: str) -> dict[str, Any] | None:
    """The last rank forms a group with the others, then dies (``os._exit`` or SIGKILL).

    The others then ask for a group with it: they are told at once that it died.
    """
    out: dict[str, Any] = {}
    dead = world_size - 1
    with ProcessGroupMesh(world_size, names=("x",), timeout=LONG) as mesh:
        out["before"] = ask(mesh, "x")
    _publish_pid(rank)
    dist.barrier()
    if rank == dead:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    pid = int(_c10d.default_store().get(f"test-diagnosis/pid/{dead}"))
    wait_gone(pid)
    with ProcessGroupMesh(world_size, names=("x",), timeout=LONG) as mesh:
        out["first"] = ask(mesh, "x")
    out["dead_pid"] = pid
    _survivors_meet(world_size - 1)
    out["leftovers"] = leftovers()
    out["live"] = _c10d.live_group_count()
    return {**out, **me()}


def dead_peer_on_another_host(rank: int, world_size: int) -> dict[str, Any] | None:
    """The last rank says it runs on another host, then dies; every rank holds a liveness watch.

    No rank can see the dead one's process, so only the watch can tell: the
    others are told at once that it died, in the watch's words.
    """
    out: dict[str, Any] = {}
    dead = world_size - 1
    with LivenessWatch(interval=0.02, timeout=LONG) as watch:
        with watch.guard(ProcessGroupMesh(world_size, names=("x",), timeout=LONG)) as mesh:
            out["before"] = ask(mesh, "x")
        if rank == dead:  # a process record no peer can check: "another host"
            elsewhere = {"host": "another-host", "ns": "", "pid": 1, "start": ""}
            _c10d.default_store().set(process_key(rank), json.dumps(elsewhere))
        dist.barrier()
        if rank == dead:  # once the others wait for it in the formation (not before they
            time.sleep(0.3)  # guard their mesh: a watch that knew already aborts it there)
            os.kill(os.getpid(), signal.SIGKILL)
        with watch.guard(ProcessGroupMesh(world_size, names=("x",), timeout=LONG)) as mesh:
            out["first"] = ask(mesh, "x")
        out["lost"] = sorted(watch.lost())
    _survivors_meet(world_size - 1)
    out["leftovers"] = [key for key in leftovers() if not key.startswith("scopedmesh-watch/count/")]
    out["live"] = _c10d.live_group_count()
    return {**out, **me()}


def no_mesh_yet() -> None:
    """A rank launched as torchrun launches one (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in the environment it was started with), run with ``python -c``.

    Rank 0 makes a mesh and asks for the 2-rank group (timeout 1 s); rank 1
    makes no mesh at all and waits until rank 0 is done. Rank 0 prints its outcome as JSON.
    """
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    store = _c10d.default_store()
    if dist.get_rank() == 0:
        with ProcessGroupMesh(2, names=("tp",), timeout=1.0) as mesh:
            out = ask(mesh, "tp")
        store.set("no-mesh-yet/done", "1")
        print(json.dumps(out), flush=True)
    else:
        store.wait(["no-mesh-yet/done"], timedelta(seconds=60))
    dist.destroy_process_group()
