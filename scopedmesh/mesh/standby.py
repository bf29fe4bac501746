"""Standby groups: the survivors' communicators, formed before a death, off the critical path.

On NCCL a heal's cost is forming the survivors' communicators (``ncclCommInitRank``,
about 0.5 s of a 0.55 s heal on an H100, docs/GPU.md). A mesh whose likely failure
units are the slices of one axis (a dp row, a node) knows every mesh its survivors
can re-form into: :func:`prepare_standby` forms, while the job trains, the groups
each of those meshes will ask for, and hands them to the mesh. When a death comes,
``reform`` passes them on to the survivors' mesh, whose group requests take them
instead of forming (:meth:`Standby.take`): the heal forms nothing.

The cost is memory: each standby group is a communicator (about 35 MiB each on the
one-GPU rig, docs/GPU.md). A rank of a mesh with ``d`` slices along the axis holds
up to ``d - 1`` groups per axis asked for (one for each slice it is not in; groups
equal for several slices are formed once); :attr:`Standby.bytes` counts them on a
CUDA device. The switch: do not call :func:`prepare_standby` (the default), or
:meth:`Standby.close` to give the memory back; a heal without standby groups forms
its groups as before.

The order of formation is one global order every rank follows (slices, then
axes), each rank forming only its own groups in it, so no two ranks wait for each
other in opposite orders. Every member must call :func:`prepare_standby` with the
same arguments, as for any group request.

>>> Standby().groups
0
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d import nccl as _nccl
from scopedmesh.errors import shown
from scopedmesh.layout import MeshLayout
from scopedmesh.layout.survivors import shrink

if TYPE_CHECKING:
    from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["NCCL_NAMES", "Standby", "prepare_standby", "standby_keys"]

GroupKey = tuple[Sequence[int], str]  # (ranks in group-rank order, backend), as a table keys it
NCCL_NAMES = frozenset({"nccl", "nccl-legacy", "nccl2", "nccl-lazy"})  # torch's real NCCL


class Standby:
    """Groups formed ahead for the survivors' meshes, by ``(ranks, backend)``; held by a mesh.

    ``formed`` counts the groups formed, ``taken`` those a mesh took instead of
    forming one, ``bytes`` the device memory they took when formed (None off CUDA).
    """

    __slots__ = ("_groups", "bytes", "formed", "taken")

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}
        self.formed = 0
        self.taken = 0
        self.bytes: int | None = None

    @property
    def groups(self) -> int:
        """The standby groups held now."""
        return len(self._groups)

    @property
    def bytes_per_group(self) -> int | None:
        """Device memory per standby group formed (None off CUDA, or none formed)."""
        return None if self.bytes is None or not self.formed else self.bytes // self.formed

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2 and _normal(key) in self._groups

    def take(self, key: GroupKey) -> dist.ProcessGroup | None:
        """The live standby group for ``key``, now the caller's, or None."""
        group = self._groups.pop(_normal(key), None)
        if group is None or not _c10d.is_live(group):
            return None
        self.taken += 1
        return group

    def add(self, key: GroupKey, group: dist.ProcessGroup) -> None:
        self._groups[_normal(key)] = group

    def prune(self, ranks: Collection[int]) -> None:
        """Abort and destroy every standby group holding a rank outside ``ranks`` (lost ranks:
        such a group can never serve). Local; each group is tried."""
        doomed = [key for key in self._groups if not set(key[0]) <= set(ranks)]
        _release([self._groups.pop(key) for key in doomed])

    def close(self) -> None:
        """Abort and destroy every standby group: the memory goes back. Local."""
        groups, self._groups = list(self._groups.values()), {}
        _release(groups)


def _normal(key: Any) -> tuple[tuple[int, ...], str]:
    ranks, backend = key
    return tuple(ranks), str(backend)


def _release(groups: list[dist.ProcessGroup]) -> None:
    """Abort (NCCL: nothing waits for a lost peer), then destroy; failures do not stop it."""
    _nccl.abort_groups(groups)
    for group in groups:
        with contextlib.suppress(Exception):  # the next one must still go
            _c10d.destroy(group)


def prepare_standby(
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    axes: Sequence[int | str] | None = None,
    warm: Callable[[dist.ProcessGroup], None] | None = None,
) -> Standby:
    """Form the groups the survivors of ``mesh`` will ask for after losing any slice of ``axis``.

    ``axes``: the axes whose groups the survivors' mesh will ask for (default:
    each of its axes, one at a time). ``warm(group)`` runs once on each new
    group, so that its communicator connects now (default: on torch's NCCL, a
    one-element ``all_reduce`` on the current CUDA device; else nothing). The
    groups go to ``mesh`` (replacing a standby it holds: groups still right are
    kept, the others released) and pass to the mesh ``reform`` returns. A slice
    holding this rank is skipped (this rank would not survive it). Returns the
    :class:`Standby` (its counts; ``close()`` releases the groups).

    Every member of ``mesh`` calls it with the same arguments. A formation fails as a
    mesh's does (the mesh aborted meanwhile: :class:`~scopedmesh.errors.MeshClosedError`;
    a member missing: :class:`~scopedmesh.errors.GroupFormationError`); nothing formed
    by the call is kept then, and the standby the mesh held stays.
    """
    from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

    if not isinstance(mesh, ProcessGroupMesh):
        raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
    layout = mesh.layout
    index = layout.axis_index(axis)
    chosen = range(len(layout.shape)) if axes is None else [layout.axis_index(a) for a in axes]
    backend = str(dist.Backend(mesh.backend or dist.get_backend()))
    table = mesh._table
    old = table.standby if isinstance(table.standby, Standby) else None  # the only kind
    pool = Standby()
    if warm is None and backend in NCCL_NAMES:
        warm = _warm_nccl
    keys = standby_keys(layout, mesh.rank, index, chosen, ordered=table.ordered, backend=backend)
    on_cuda = backend in NCCL_NAMES  # its groups live on the current CUDA device
    free = _free_bytes() if on_cuda else None
    with table.lock:
        mesh._scope.check_open(mesh)
        table.check_not_aborted(mesh)
        reused = [key for key in keys if old is not None and key in old]  # the same on all
        try:
            for key in keys:
                if key not in reused:
                    pool.add(key, _form(mesh, key, index, warm))
                    pool.formed += 1
        except BaseException:  # an abort (a death meanwhile), a timeout: keep nothing half-made
            pool.close()
            raise
        for key in reused:
            group = old._groups.pop(key, None) if old is not None else None
            if group is not None and _c10d.is_live(group):  # handed on, not taken by a request
                pool.add(key, group)
        if old is not None:
            old.close()  # the groups no slice of this mesh needs (they hold a lost rank)
        table.standby = pool
    after = _free_bytes() if on_cuda else None
    if free is not None and after is not None:
        pool.bytes = max(0, free - after)
    return pool


def _form(
    mesh: ProcessGroupMesh,
    key: tuple[tuple[int, ...], str],
    index: int,
    warm: Callable[[dist.ProcessGroup], None] | None,
) -> dist.ProcessGroup:
    """Form (and warm) one standby group as the mesh forms its own: watched by its liveness
    watch, stopped by its abort, never split from WORLD's communicator."""
    table = mesh._table
    group = _c10d.new_member_group(
        key[0],
        backend=key[1],
        timeout=mesh.timeout,
        pg_options=mesh.pg_options,
        description=f"scopedmesh-standby:{mesh.layout.axis_name(index)}",
        what=f"a standby group over ranks {list(key[0])}",
        grace=table.grace,
        liveness=table.liveness,
        store_use=table.store_use,
        aborted=table._why_aborted,
        on_abort=table.on_abort,
        unsplit=True,  # never from WORLD's communicator: it holds the ranks to lose
    )
    if group is None:  # this rank is a member of each key: None is the library's bug
        raise RuntimeError(f"rank {mesh.rank} got no standby group over {list(key[0])}")
    if warm is not None:
        try:
            warm(group)
        except BaseException:
            _release([group])
            raise
    return group


def standby_keys(
    layout: MeshLayout,
    rank: int,
    axis: int,
    axes: Sequence[int],
    *,
    ordered: bool,
    backend: str,
) -> list[tuple[tuple[int, ...], str]]:
    """The groups ``rank`` forms ahead, in the one global order: for each slice of ``axis``
    not holding ``rank``, the survivors' group through ``rank`` along each of ``axes`` (in
    group-rank order if ``ordered``, else ascending), each group once.

    >>> from scopedmesh import MeshLayout
    >>> standby_keys(MeshLayout((3, 2)), 0, 0, [0, 1], ordered=True, backend="nccl")
    [((0, 4), 'nccl'), ((0, 1), 'nccl'), ((0, 2), 'nccl')]
    """
    keys: list[tuple[tuple[int, ...], str]] = []
    for position in range(layout.shape[axis]):
        unit = [r for r in layout.ranks if layout.unravel(r)[axis] == position]
        if rank in unit:
            continue
        survivors = shrink(layout, unit, axis)
        coord = survivors.unravel(rank)
        for along in axes:
            members = (
                survivors.ordered_group(coord, along)
                if ordered
                else survivors.compact_group(coord, along)
            )
            key = (tuple(members), backend)
            if key not in keys:
                keys.append(key)
    return keys


def _warm_nccl(group: dist.ProcessGroup) -> None:
    """Connect ``group``'s NCCL communicator now: one one-element all_reduce, synchronised."""
    device = torch.device("cuda", torch.cuda.current_device())
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    torch.cuda.synchronize(device)


def _free_bytes() -> int | None:
    """Free memory on the current CUDA device (None without one); initialises CUDA."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return int(free)
