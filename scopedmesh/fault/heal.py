"""Re-form a mesh around lost ranks: the survivors close the old mesh and open a smaller one.

No collective runs on WORLD (it holds the dead ranks): the new mesh's groups are
made by their members only, like every group a mesh makes. The survivors must
agree on the lost set. Either the caller passes it (from the launcher, a health
check, a collective's error), or :func:`agree_on_lost` settles it in torch's
distributed store: every survivor checks in, and the first verdict written after
the deadline is the one every survivor reads.

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
>>> mesh = ProcessGroupMesh(1, 1, names=("dp", "tp"))
>>> with reform(mesh, lost=[], axis="dp") as healed:
...     healed.shape, mesh.closed
((1, 1), True)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.checks import check_tag, check_timeout, sorted_ranks
from scopedmesh.c10d.store import heal_keys
from scopedmesh.errors import LostRankError, shown
from scopedmesh.layout import Axis
from scopedmesh.layout.ints import is_int
from scopedmesh.layout.survivors import shrink
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["LostRankError", "agree_on_lost", "reform"]  # LostRankError lives in errors

_POLL = 0.05  # seconds between two looks at the store while survivors check in


def reform(mesh: ProcessGroupMesh, lost: Iterable[int], axis: Axis) -> ProcessGroupMesh:
    """Close ``mesh`` (if still open) and return the mesh of its survivors along ``axis``.

    Every slice of ``axis`` holding a rank in ``lost`` is dropped (see
    :func:`scopedmesh.layout.survivors.shrink`); the new mesh keeps the names, backend,
    timeout and group options of ``mesh``. Closing is local and the new mesh
    makes no group until asked, so nothing here communicates. Every survivor
    must call it with the same ``lost`` and ``axis``; ranks that lose their
    place (they shared a dropped slice with a lost rank) get ``LostRankError``
    after ``mesh`` is closed: they sit out of the new mesh. The new mesh's
    groups never derive from WORLD's communicator, which holds the lost ranks
    (on NCCL they form by their own init over the store, see docs/GPU.md), unless
    they were formed before the death (:func:`~scopedmesh.mesh.standby.prepare_standby`):
    the standby groups of ``mesh`` pass to the new mesh, whose requests take them.
    """
    if not isinstance(mesh, ProcessGroupMesh):
        raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
    layout = shrink(mesh.layout, lost, axis)
    standby, mesh._table.standby = mesh._table.standby, None  # formed ahead: for the survivors
    # A survivor's close leaves the aborted NCCL communicators' teardown (0.4-0.5 s each on
    # an H200) to a thread; the new mesh's close waits for it (GroupTable.finish).
    mesh._table.hand_over = mesh.rank in layout
    mesh.close()
    if mesh.rank not in layout:
        if standby is not None:
            standby.close()
        raise LostRankError(
            f"rank {mesh.rank} shares a dropped slice of axis {mesh.layout.axis_name(axis)!r} "
            f"with a lost rank; the survivors' mesh is {list(layout.ranks)}"
        )
    try:
        healed = ProcessGroupMesh.from_layout(
            layout, backend=mesh.backend, timeout=mesh.timeout, pg_options=mesh.pg_options
        )
    except BaseException:  # nobody takes the hand-over: closed means destroyed, here
        with contextlib.suppress(TimeoutError):  # what raised matters more; they go on
            mesh._table.finish(own=True)
        if standby is not None:
            standby.close()
        raise
    healed._table.fresh_communicators = True  # WORLD holds the lost ranks: never split from it
    healed._table.inherit(mesh._table)
    healed._table.standby = standby  # its requests take these (scopedmesh.mesh.standby)
    return healed


def agree_on_lost(
    ranks: Sequence[int], rank: int, *, tag: str, timeout: timedelta | float
) -> frozenset[int]:
    """The ranks of ``ranks`` that did not check in by the deadline, the same on every survivor.

    Each survivor writes ``scopedmesh-heal/<tag>/alive/<rank>`` and watches the
    others' keys until all of ``ranks`` checked in or ``timeout`` passed. Then
    it proposes its view with ``compare_set`` on one verdict key: the first
    proposal wins and every survivor returns that one, so all agree even when
    their views differ (a survivor that checked in late); a survivor that sees a
    verdict before its own deadline takes it at once. A rank the verdict
    counts as lost gets ``LostRankError``. ``tag`` names the event (say, the
    step at which the collective failed); use a new tag for every heal. Choose
    ``timeout`` longer than the spread of the survivors' failure times (about
    the collective timeout: a peer of the dead rank fails at once, a rank whose
    collective merely waits on it fails at the timeout). Store requests only;
    the event leaves ``len(ranks) + 1`` small keys in the store.
    """
    seconds = check_timeout(timeout).total_seconds()
    members = sorted_ranks(ranks)
    if not is_int(rank):
        raise TypeError(f"rank must be an int rank, got {shown(rank)}")
    if rank not in members:
        raise ValueError(f"rank must be one of ranks {shown(members)}, got {shown(rank)}")
    check_tag(tag)
    if members[-1] >= (world := dist.get_world_size()):
        raise ValueError(f"ranks must be ranks of WORLD (0..{world - 1}), got {members[-1]}")
    store = _c10d.default_store()
    mine, verdict_key = heal_keys(tag, rank)
    store.set(mine, "1")
    deadline = time.monotonic() + seconds
    alive: set[int] = {rank}
    while True:
        alive |= {r for r in members if r not in alive and store.check([heal_keys(tag, r)[0]])}
        if len(alive) == len(members) or time.monotonic() >= deadline:
            break
        if store.check([verdict_key]):  # a survivor already decided: read its verdict
            break
        time.sleep(_POLL)
    view = ",".join(str(r) for r in members if r not in alive)
    verdict = store.compare_set(verdict_key, "", f"lost:{view}").decode()
    lost = frozenset(int(r) for r in verdict.removeprefix("lost:").split(",") if r)
    if rank in lost:
        raise LostRankError(
            f"rank {rank} checked in after the survivors' deadline; they declared it lost "
            f"(lost ranks {sorted(lost)}): it must not join the re-formed mesh"
        )
    return lost
