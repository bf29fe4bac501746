"""ProcessGroupMesh: an N-D mesh that owns the process groups it makes, for a scope.

The class puts together its scope (:mod:`scopedmesh.mesh.scope`), its group cache
(:mod:`scopedmesh.mesh.group_table`) and the ColossalAI static helpers
(:mod:`scopedmesh.layout.colossal`); this module holds construction, layout facts and
sub-meshes.

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
>>> with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
...     tp = mesh.get_group_along_axis("tp")
...     mesh.get_ranks_in_group(tp), mesh.coordinate(), mesh.is_first("tp")
([0], (0, 0), True)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, overload

import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.checks import check_backend, check_timeout
from scopedmesh.layout.mesh_layout import Axes, Axis, MeshLayout
from scopedmesh.layout import colossal as _seed
from scopedmesh.mesh.group_table import GroupCache, plain_axes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroupMesh"]


class ProcessGroupMesh(GroupCache):
    """An N-D mesh over global ranks that makes, caches and destroys its groups.

    Groups are made on first request by their members only; ``close()`` (or the
    end of a ``with`` block) destroys exactly the groups this scope made.

    Args:
        *shape: the size of each axis (or one tuple); one may be ``-1``.
        names: a name for each axis.
        ranks: the global ranks the mesh lays out in C order (default: all).
        backend, timeout, pg_options: defaults for the groups the mesh makes;
            ``timeout`` is a ``timedelta`` or seconds. A backend this torch
            lacks (e.g. ``'nccl'`` on a CPU build) is a ``ValueError`` here.
        eager: make every single-axis group now. If that fails, the groups
            already made are destroyed before the error propagates.

    Lifetime rules (tested in ``tests/test_reliability.py``):

    - Entering a closed mesh raises :class:`MeshClosedError`; entering a mesh
      that is already entered raises ``RuntimeError`` and leaves it open.
    - Closing a mesh closes its open sub-meshes first; a sub-mesh whose parent
      closed is closed: group methods raise ``MeshClosedError``, layout queries
      still answer, and leaving its ``with`` block is a no-op.
    - A group destroyed behind the mesh's back (``dist.destroy_process_group``,
      with or without an argument) is skipped by ``close()``; asking the mesh
      for it again raises ``RuntimeError`` rather than return a dead group.
    - A mesh garbage-collected while open warns (``ResourceWarning``) and
      destroys nothing; its groups stay live until destroyed by hand.

    THREADS (tested in ``tests/test_threads.py``). A mesh and its sub-meshes may
    be used from several threads: group requests, ``submesh``, slicing and
    ``close()`` take one per-mesh lock, so threads that ask for the same group
    get the same object, made once. The lock holds while a group forms, so a
    thread asking for another group waits for it. Across ranks the collective
    rule still holds: members must make their groups in the same order, so let
    one thread make the groups a mesh needs (or ``eager=True``), or give each
    thread groups no other thread makes. Meshes in different threads are
    independent when they make groups over different ranks at the same time;
    two threads making groups over the same ranks at once may pair mismatched
    incarnations across ranks.
    """

    # The group methods, defined in scopedmesh.mesh.group_table, named here too so that the
    # class's own namespace lists its whole API (for help() and introspection).
    get_group_along_axis = GroupCache.get_group_along_axis
    create_group_along_axis = GroupCache.create_group_along_axis
    create_groups = GroupCache.create_groups
    get_ranks_in_group = GroupCache.get_ranks_in_group

    # Sub-layouts and coordinates by the axes asked for: a sub-mesh costs O(1) when repeated.
    _planes: dict[tuple[Axis, ...], tuple[MeshLayout, tuple[int, ...]]]
    _slices: dict[tuple[int, ...], ProcessGroupMesh]  # made by mesh[...], by axes

    def __init__(
        self,
        *shape: int | Sequence[int],
        names: Sequence[str] | None = None,
        ranks: Sequence[int] | None = None,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        pg_options: Any = None,
        eager: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupMesh needs torch.distributed: call "
                "torch.distributed.init_process_group() first"
            )
        if not shape:
            raise TypeError("ProcessGroupMesh needs a shape, e.g. ProcessGroupMesh(2, 4)")
        if not isinstance(eager, bool):
            raise TypeError(f"eager must be a bool, got {eager!r}")
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], Sequence) else shape
        if not dims:
            raise ValueError("shape must have at least one axis, e.g. ProcessGroupMesh(2, 4)")
        world_size = dist.get_world_size()
        layout = MeshLayout(dims, names, range(world_size) if ranks is None else ranks)  # type: ignore[arg-type]
        if ranks is not None:
            largest = max(ranks[0], ranks[-1]) if isinstance(ranks, range) else max(ranks)
            if largest >= world_size:
                raise ValueError(
                    f"ranks must lie in the world of {world_size} ranks (0..{world_size - 1}), "
                    f"got rank {largest}"
                )
        self._init(
            layout,
            parent=None,
            backend=check_backend(backend, "backend"),
            timeout=check_timeout(timeout),
            pg_options=pg_options,
        )
        if eager:
            try:
                self.create_groups()
            except BaseException:
                self.close()  # a mesh whose constructor failed leaves no group behind
                raise

    def _init(
        self,
        layout: MeshLayout,
        *,
        parent: ProcessGroupMesh | None,
        backend: str | None,
        timeout: timedelta | None,
        pg_options: Any,
        place: tuple[int, tuple[int, ...]] | None = None,
    ) -> None:
        """Set up a scope; ``place`` is this rank and its coordinate, when known."""
        if place is None:
            rank = dist.get_rank()
            if rank not in layout:
                raise ValueError(
                    f"this process (global rank {rank}) is not in the mesh's ranks; build the "
                    "mesh only on the ranks it lists"
                )
            place = (rank, layout.unravel(rank))
        self._layout = layout
        self._rank, self._coord = place
        self._parent = parent
        # The group cache is shared by a mesh and all its sub-meshes: one group per key.
        self._registry = {} if parent is None else parent._registry
        self._lock = threading.RLock() if parent is None else parent._lock
        self._backend = backend
        self._timeout = timeout
        self._pg_options = pg_options
        self._by_axis = {}  # fast path: axis as given -> entry
        self._live = _c10d.live_groups()
        self._planes = {}
        self._created = []
        self._children = []
        self._closed = False
        self._entered = False
        self._slices = {}

    # ---------------------------------------------------------- layout facts

    @property
    def layout(self) -> MeshLayout:
        """The pure rank layout of this mesh."""
        return self._layout

    @property
    def shape(self) -> tuple[int, ...]:
        """The size of each axis."""
        return self._layout.shape

    @property
    def names(self) -> tuple[str, ...] | None:
        """The axis names, or ``None``."""
        return self._layout.names

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @overload
    def size(self, dim: None = None) -> tuple[int, ...]: ...
    @overload
    def size(self, dim: Axis) -> int: ...
    def size(self, dim: Axis | None = None) -> int | tuple[int, ...]:
        """The size of axis ``dim``, or the whole shape."""
        if dim is None:
            return self._layout.shape
        return self._layout.shape[self._layout.axis_index(dim, argument="dim")]

    @overload
    def coordinate(self, dim: None = None) -> tuple[int, ...]: ...
    @overload
    def coordinate(self, dim: Axis) -> int: ...
    def coordinate(self, dim: Axis | None = None) -> int | tuple[int, ...]:
        """This rank's coordinate, or its position along axis ``dim``."""
        if dim is None:
            return self._coord
        return self._coord[self._layout.axis_index(dim, argument="dim")]

    def local_rank(self, axis: Axes) -> int:
        """This rank's rank in its group along ``axis`` (members ascend by global rank)."""
        return self._layout.group(self._coord, axis).index(self._rank)

    def is_first(self, axis: Axes) -> bool:
        """Whether this rank is rank 0 of its group along ``axis``."""
        return self.local_rank(axis) == 0

    def is_last(self, axis: Axes) -> bool:
        """Whether this rank is the last rank of its group along ``axis``."""
        return self._layout.group(self._coord, axis)[-1] == self._rank

    # ColossalAI's static helpers, kept under their names (see scopedmesh.layout.colossal).
    ravel = staticmethod(_seed.ravel)
    unravel = staticmethod(_seed.unravel)
    get_coords_along_axis = staticmethod(_seed.get_coords_along_axis)

    # ------------------------------------------------------------- sub-meshes

    def submesh(self, *axes: Axis) -> ProcessGroupMesh:
        """A nested scope over ``axes`` through this rank's coordinate.

        It shares this mesh's groups, owns the groups first made through it and
        destroys those when it closes; closing this mesh closes it first.
        """
        with self._lock:
            return self._submesh(axes)

    def _submesh(self, axes: tuple[Axis, ...]) -> ProcessGroupMesh:
        self._check_open()
        if not axes:
            raise TypeError("submesh() needs at least one axis")
        plane = self._planes.get(axes) if plain_axes(axes) else None
        if plane is None:
            chosen = self._layout.axes_indices(axes)
            plane = (self._layout.sub(self._coord, axes), tuple(self._coord[a] for a in chosen))
            if plain_axes(axes):
                self._planes[axes] = plane
        layout, coord = plane
        child = object.__new__(ProcessGroupMesh)
        child._init(
            layout,
            parent=self,
            backend=self._backend,
            timeout=self._timeout,
            pg_options=self._pg_options,
            place=(self._rank, coord),
        )
        self._children.append(child)
        return child

    def __getitem__(self, axes: Axis | tuple[Axis, ...]) -> ProcessGroupMesh:
        """``mesh["pp", "tp"]``: the open sub-mesh over those axes, made on first use.

        Unlike :meth:`submesh`, which opens a new scope on every call, slicing
        returns the same sub-mesh while it is open (as DeviceMesh slicing does),
        so slicing in a loop does not pile up scopes.
        """
        items = axes if isinstance(axes, tuple) else (axes,)
        key = self._layout.axes_indices(items) if items else ()
        with self._lock:
            child = self._slices.get(key)
            if child is None or child._closed:
                child = self._slices[key] = self.submesh(*items)
        return child

    def to_device_mesh(self, device_type: str, axes: Sequence[Axis] | None = None) -> DeviceMesh:
        """A torch ``DeviceMesh`` over this mesh's own groups, valid while the mesh is open.

        See :func:`scopedmesh.mesh.interop.to_device_mesh`, which calls this.
        """
        from scopedmesh.c10d.device_mesh import (
            build_device_mesh,  # few programs need it: not at import
        )

        return build_device_mesh(
            self._layout, self._coord, device_type, axes, self.get_group_along_axis
        )
