"""Independence of overlapping meshes (tests/world/test_reliability.py, section 6)."""

from __future__ import annotations

import random
from typing import Any

import torch.distributed as dist
from _workers_common import live, summed

from scopedmesh.c10d import groups as _c10d
from scopedmesh.mesh import ProcessGroupMesh

# What each mesh may request: (axis, indices_at_axis).
_REQUESTS: dict[str, list[tuple[Any, Any]]] = {
    "A": [
        ("dp", None),
        ("tp", None),
        (("dp", "tp"), None),
        ("tp", [0]),
        (("dp", "tp"), [[0, 1], [1]]),
    ],
    "B": [("x", None), ("y", None), (("x", "y"), None), ("y", [-1])],
}


def _open(name: str) -> ProcessGroupMesh:
    if name == "A":  # rows [0, 1], [2, 3]
        return ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=30.0)
    # The same ranks in another order: every B group has the ranks of an A group.
    return ProcessGroupMesh(2, 2, names=("x", "y"), ranks=[3, 1, 2, 0], timeout=30.0)


def schedule(seed: int, steps: int) -> list[tuple[str, str, int]]:
    """A random interleaving of open/request/sub-mesh/close for meshes A and B."""
    rng = random.Random(seed)
    is_open = {"A": False, "B": False}
    ops: list[tuple[str, str, int]] = []
    for _ in range(steps):
        name = rng.choice("AB")
        if not is_open[name]:
            ops.append(("open", name, 0))
            is_open[name] = True
            continue
        kind = rng.choices(["request", "sub", "close"], [5, 2, 2])[0]
        ops.append((kind, name, rng.randrange(len(_REQUESTS[name]))))
        if kind == "close":
            is_open[name] = False
    ops += [("close", n, 0) for n in "AB" if is_open[n]]
    return ops


def independence(
    rank: int, world_size: int, schedules: int, steps: int, seed: int
) -> dict[str, Any]:
    """Two meshes over the same ranks, opened and closed in random interleavings."""
    baseline = live()
    lost: list[str] = []
    made = checks = ops_run = 0
    for number in range(schedules):
        meshes: dict[str, ProcessGroupMesh] = {}
        held: dict[str, dict[int, Any]] = {"A": {}, "B": {}}
        for step, (kind, name, which) in enumerate(schedule(seed * 100_003 + number, steps)):
            ops_run += 1
            where = f"schedule {number} step {step} {kind} {name}"
            if kind == "open":
                meshes[name] = _open(name)
                held[name] = {}
            elif kind == "request":
                axis, indices = _REQUESTS[name][which]
                before = live()
                group = meshes[name].get_group_along_axis(axis, indices_at_axis=indices)
                made += live() - before
                held[name].setdefault(which, group)
                if held[name][which] is not group:
                    lost.append(f"{where}: a second request returned another group")
            elif kind == "sub":
                axis = _REQUESTS[name][which][0]
                first = axis if isinstance(axis, str) else axis[0]
                with meshes[name].submesh(first) as sub:
                    group = sub.get_group_along_axis(first)
                    if group is not None:
                        checks += 1
                        if summed(group) != len(sub.get_ranks_in_group(group)):
                            lost.append(f"{where}: the sub-mesh group failed")
            else:
                mesh = meshes.pop(name)
                mesh.close()
                for group in held[name].values():
                    if group is not None and _c10d.is_live(group):
                        lost.append(f"{where}: a closed mesh's group is still live")
                held[name] = {}
            # The other mesh never loses a group: still registered, still working.
            for other in meshes:
                for key, group in held[other].items():
                    if group is None:
                        continue
                    if not _c10d.is_live(group):
                        lost.append(f"{where}: mesh {other} lost group {key}")
                        continue
                    if kind in ("close", "sub", "open"):
                        checks += 1
                        if summed(group) != len(dist.get_process_group_ranks(group)):
                            lost.append(f"{where}: mesh {other} group {key} failed a collective")
        if live() != baseline:
            lost.append(f"schedule {number}: {live() - baseline} groups left after both closed")
    return {
        "rank": rank,
        "schedules": schedules,
        "ops": ops_run,
        "groups_made": made,
        "collective_checks": checks,
        "lost": lost,
        "final_live": live() - baseline,
    }
