"""Workers for tests/world/test_nccl_abort.py: NCCL's abort and unsplit formation, dry-run on CPU.

The groups run on ``nccl_double`` (tests/world/_nccl_double.py), a registered
Python backend that records every ``abort()`` and NCCL group call, so the
library's NCCL logic runs where no GPU is. WORLD and the liveness watch are gloo's.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the double beside this module

from _nccl_double import BACKEND, Log, register, wait_for

from scopedmesh import ProcessGroupMesh
from scopedmesh.c10d import groups as _c10d
from scopedmesh.fault.liveness import LivenessWatch

VICTIM = 3


def _kill_from_outside(store: Any, victim: int) -> None:
    """SIGKILL ``victim`` once every rank has made its groups: from rank 0's thread."""
    wait_for(lambda: int(store.add("nccl/ready", 0)) >= 4, 60, "every rank's groups")
    os.kill(int(store.get(f"nccl/{victim}/pid")), signal.SIGKILL)


def aborted_from_the_watch(rank: int, world: int) -> dict[str, Any] | None:
    """A guarded 2 x 2 (dp, tp) mesh on the double, with a view, a sub-mesh, a DeviceMesh
    (and a group torch flattens for it) and a gloo group. Rank 3 is SIGKILLed by rank 0.
    Returns what the survivor's log saw and how its kept handles ended."""
    register()
    store = _c10d.default_store()
    store.set(f"nccl/{rank}/pid", str(os.getpid()))
    log = Log()
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = ProcessGroupMesh(
        2, 2, 1, names=("dp", "tp", "cp"), backend=BACKEND, pg_options=log, timeout=60
    )
    watch.guard(mesh)
    view = mesh.view(4, names=("all",))  # (a view spanning WORLD: its group is still the mesh's)
    sub = mesh.submesh("dp")
    groups = {
        "tp": mesh.get_group_along_axis("tp"),
        "view": view.get_group_along_axis("all"),
        "sub-mesh": sub.get_group_along_axis("dp"),
    }
    device_mesh = mesh.to_device_mesh("cpu")
    # Not over every rank: torch would hand WORLD to a flattened dim spanning the world.
    # On "cpu" torch would flatten onto gloo: the double is asked for, as "cuda" asks NCCL.
    flat = device_mesh["tp", "cp"]._flatten("tp_cp", backend_override=(BACKEND, log))
    groups["DeviceMesh flattened"] = flat.get_group()
    gloo = mesh.get_group_along_axis("tp", backend="gloo")
    names = dist.distributed_c10d._world.pg_names
    kept = {
        what: dist.all_reduce(torch.ones(1), group=group, async_op=True)
        for what, group in groups.items()
    }
    if rank == 0:
        threading.Thread(target=_kill_from_outside, args=(store, VICTIM), daemon=True).start()
    store.add("nccl/ready", 1)
    if rank == VICTIM:
        wait_for(lambda: False, 60, "the SIGKILL")  # killed while it waits
    wait_for(lambda: ("group_end", "") in [e[:2] for e in log.copy()], 30, "the abort")
    events = [e for e in log.copy() if e[0] in ("group_start", "abort", "group_end")]
    out: dict[str, Any] = {
        "events": [what for what, _, _ in events],
        "aborted": sorted(name for what, name, _ in events if what == "abort"),
        # one group call, on the thread the watch's abort started for it (GroupTable.abort)
        "abort_threads": sorted({log.thread_names[ident] for _, _, ident in events}),
        "held": sorted({names[g] for g in [*groups.values(), *_own(mesh)]}),
        "gloo_released": bool(getattr(gloo, "released", False)),
        "kept": {},
        "lost": sorted(watch.lost()),
    }
    for what, work in kept.items():
        try:
            work.wait()
            waited = "succeeded"
        except RuntimeError as error:
            waited = f"raised {type(error).__name__}"
        out["kept"][what] = [work.is_completed(), work.is_success(), waited]
    mesh.close()
    view.close()
    watch.close()
    return out


def healed_from_standby(rank: int, world: int, group_call: bool) -> dict[str, Any] | None:
    """A guarded mesh of 4 along dp on the double; each rank prepares the standby groups
    for the loss of any one rank (3 groups of 3 each), then rank 3 is SIGKILLed. The
    survivors heal (``watch.heal``) and ask for their dp group. Returns the counts:
    communicators made before and during the heal, what the abort touched, whether
    the healed group is the standby one. ``group_call`` False: the double has no NCCL
    group call (torch 2.14+'s ``nccl2``), so the abort goes group by group."""
    from scopedmesh.mesh.standby import prepare_standby

    register()
    store = _c10d.default_store()
    store.set(f"nccl/{rank}/pid", str(os.getpid()))
    log = Log()
    log.group_call = group_call
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(world, names=("dp",), backend=BACKEND, pg_options=log))
    mesh.get_group_along_axis("dp")
    made = lambda: sum(1 for what, _, _ in log.copy() if what == "made")  # noqa: E731
    standby = prepare_standby(mesh, "dp")
    names = dist.distributed_c10d._world.pg_names
    survivors = tuple(r for r in range(world) if r != VICTIM)
    ready = standby._groups.get((survivors, BACKEND))
    prepared = {"made": made(), "groups": standby.groups, "formed": standby.formed}
    if rank == 0:
        threading.Thread(target=_kill_from_outside, args=(store, VICTIM), daemon=True).start()
    store.add("nccl/ready", 1)
    if rank == VICTIM:
        wait_for(lambda: False, 60, "the SIGKILL")  # killed while it waits
    wait_for(lambda: mesh.aborted != "", 30, "the abort")
    standby_names = {names[g] for g in standby._groups.values()}
    before_heal = made()
    healed = watch.heal(mesh, "dp", tag="standby")
    group = healed.get_group_along_axis("dp")
    out: dict[str, Any] = {
        "prepared": prepared,
        "made_in_heal": made() - before_heal,
        "healed_ranks": healed.get_ranks_in_group(group) if group is not None else None,
        "is_standby": group is ready and ready is not None,
        "taken": standby.taken,
        "left": standby.groups,
        "standby_aborted": sorted(
            name for what, name, _ in log.copy() if what == "abort" and name in standby_names
        ),
        "group_calls": sum(1 for what, _, _ in log.copy() if what == "group_start"),
    }
    # Ready for the next death, off the critical path: the groups for losing any one of the
    # 3 survivors (2 of 2 on each); the 2 left from before (each holds rank 3) are released.
    left = sorted(names[g] for g in standby._groups.values())
    before = made()
    again = prepare_standby(healed, "dp")
    out["again"] = [made() - before, again.formed, again.groups, standby.groups]
    aborted = [name for what, name, _ in log.copy() if what == "abort" and name in standby_names]
    out["released"] = sorted(aborted) == left and len(left) == 2
    healed.close()  # the standby groups go with it
    out["left_after_close"] = again.groups
    watch.close()
    return out


def heal_during_a_slow_abort(rank: int, world: int) -> dict[str, Any] | None:
    """A guarded mesh of 4 along dp on the double, whose aborts tear down until told (as
    NCCL's takes 0.5 s); rank 3 is SIGKILLed. The survivors heal (``watch.heal``) with
    every abort still tearing down, then let the teardown end and close the healed mesh.
    Returns whether the heal returned meanwhile and the order of each old group's abort
    and destroy."""
    register()
    store = _c10d.default_store()
    store.set(f"nccl/{rank}/pid", str(os.getpid()))
    log = Log()
    log.teardown.clear()
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(world, names=("dp",), backend=BACKEND, pg_options=log))
    old = dist.distributed_c10d._world.pg_names[mesh.get_group_along_axis("dp")]
    if rank == 0:
        threading.Thread(target=_kill_from_outside, args=(store, VICTIM), daemon=True).start()
    store.add("nccl/ready", 1)
    if rank == VICTIM:
        wait_for(lambda: False, 60, "the SIGKILL")  # killed while it waits
    wait_for(lambda: ("abort", old) in [e[:2] for e in log.copy()], 30, "the abort")
    healed = watch.heal(mesh, "dp", tag="slow-abort")  # with the old group's abort unfinished
    during = [what for what, name, _ in log.copy() if name == old and what != "made"]
    log.teardown.set()
    healed.close()  # waits for the old group's teardown and destroy (GroupTable.finish)
    out = {
        "healed": sorted(healed.layout.ranks),
        "during_heal": during,
        "after_close": [w for w, name, _ in log.copy() if name == old and w != "made"],
        "old_left": old in dist.distributed_c10d._world.pg_names.values(),
    }
    watch.close()
    return out


def _own(mesh: ProcessGroupMesh) -> list[dist.ProcessGroup]:
    """The non-gloo groups of the mesh's table (asked for directly: the table refuses now)."""
    groups = [entry.group for entry in mesh._table._entries.values()]
    return [g for g in groups if g is not None and dist.get_backend(g) == BACKEND]


def formation_arguments(rank: int, world: int) -> dict[str, Any]:
    """With WORLD bound to a device, what torch's helper sees when a mesh forms a group,
    before and after a heal: WORLD's bound device (split from WORLD when set) and the
    ``device_id`` it is given. The helper is wrapped to record, then forms the group
    unbound (this CPU has no device to bind)."""
    from torch.distributed import distributed_c10d as c10d

    from scopedmesh import reform

    world_pg = c10d._get_default_group()
    real = c10d._new_process_group_helper
    seen: list[list[str | None]] = []

    @functools.wraps(real)  # the library reads the helper's parameters through __wrapped__
    def recorder(*args: Any, **kwargs: Any) -> Any:
        bound = c10d._get_default_group().bound_device_id
        seen.append([None if bound is None else str(bound), str(kwargs.get("device_id"))])
        saved, world_pg.bound_device_id = world_pg.bound_device_id, None
        try:
            return real(*args, **{**kwargs, "device_id": None})
        finally:
            world_pg.bound_device_id = saved

    c10d._new_process_group_helper = recorder
    world_pg.bound_device_id = torch.device("cuda", 0)  # as init_process_group(device_id=...)
    try:
        mesh = ProcessGroupMesh(1, world, names=("dp", "tp"), timeout=60)
        mesh.get_group_along_axis("tp")
        before = list(seen)
        healed = reform(mesh, [], "dp")
        healed.get_group_along_axis("tp")
        with healed.submesh("dp") as sub:  # the same table: unsplit too
            sub.get_group_along_axis("dp")
        after = seen[len(before) :]
        healed.close()
        return {"before": before, "after": after, "bound_after": str(world_pg.bound_device_id)}
    finally:
        world_pg.bound_device_id = None
        c10d._new_process_group_helper = real
