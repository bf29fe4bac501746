"""ProcessGroupMesh: an N-D mesh that owns the process groups it makes, for a scope.

A mesh (or sub-mesh) holds what is its own: its layout, this rank's coordinate,
the defaults for its groups, and the caches of what it handed out. It is
composed of a :class:`~scopedmesh.mesh.scope.Scope` (its lifetime: the groups
it made, its children) and the :class:`~scopedmesh.mesh.group_table.GroupTable`
that a mesh and all its sub-meshes share (the registry, the lock, formation).
The ColossalAI static helpers come from :mod:`scopedmesh.layout.colossal`.

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
>>> with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
...     tp = mesh.get_group_along_axis("tp")
...     mesh.get_ranks_in_group(tp), mesh.coordinate(), mesh.is_first("tp")
([0], (0, 0), True)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch.distributed as dist

from scopedmesh.c10d.checks import check_backend, check_timeout
from scopedmesh.c10d.diagnosis import Liveness
from scopedmesh.c10d.names import group_description
from scopedmesh.errors import shown
from scopedmesh.layout import Axes, Axis, MeshLayout
from scopedmesh.layout import colossal as _seed
from scopedmesh.mesh.group_table import Entry, GroupTable
from scopedmesh.mesh.scope import Binding, Scope

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroupMesh", "plain_axes"]

_M = TypeVar("_M", bound="ProcessGroupMesh")


class ProcessGroupMesh:
    """An N-D mesh over global ranks that makes, caches and destroys its groups.

    Groups are made on first request by their members only; ``close()`` (or the
    end of a ``with`` block) destroys exactly the groups this scope made.
    :meth:`from_layout` builds a mesh from a :class:`~scopedmesh.layout.MeshLayout`.

    Args:
        *shape: the size of each axis (or one tuple); one may be ``-1``.
        names: a name for each axis.
        ranks: the global ranks the mesh lays out in C order (default: all).
        backend, timeout, pg_options: defaults for the groups the mesh makes;
            ``timeout`` is a ``timedelta`` or seconds. A backend this torch
            lacks (e.g. ``'nccl'`` on a CPU build) is a ``ValueError`` here.
        eager: make every single-axis group now. If that fails, the groups
            already made are destroyed before the error propagates.
        grace: how long (``timedelta`` or seconds; default 0.5 s) a member
            waits for its peers before it tells them, in the store, what it
            waits for; then a deadlock cycle or a dead peer raises
            :class:`GroupFormationError` at once instead of after ``timeout``
            (docs/hazards.md, "When a group does not form"). Shared by the
            mesh's sub-meshes and views.

    Lifetime rules: docs/lifetime.md (entering once, closing once and newest
    first, sub-meshes and views, groups destroyed behind the mesh's back, the
    ``ResourceWarning`` of a mesh dropped while open).

    THREADS (tested in ``tests/world/test_threads.py``). A mesh and its sub-meshes may
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

    _layout: MeshLayout
    _rank: int
    _coord: tuple[int, ...]
    _parent: ProcessGroupMesh | None  # keeps the parent alive while a sub-mesh is in use
    _backend: str | None
    _timeout: timedelta | None
    _pg_options: Any
    _scope: Scope  # this mesh's lifetime: the groups it made, its children
    _table: GroupTable  # shared by a mesh and all its sub-meshes (registry, lock, formation)
    _live: Mapping[dist.ProcessGroup, object]  # the table's live-group map, for the fast path
    _by_axis: dict[object, Entry]  # fast path: axis as given -> entry; emptied on close
    _slices: dict[tuple[int, ...], ProcessGroupMesh]  # made by mesh[...]; emptied on close
    # Sub-layouts and coordinates by the axes asked for: a sub-mesh costs O(1) when repeated.
    _planes: dict[tuple[Axis, ...], tuple[MeshLayout, tuple[int, ...]]]

    def __init__(
        self,
        *shape: int | Sequence[int],
        names: Sequence[str] | None = None,
        ranks: Sequence[int] | None = None,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        pg_options: Any = None,
        eager: bool = False,
        grace: timedelta | float | None = None,
    ) -> None:
        _require_world()
        if not shape:
            raise TypeError("ProcessGroupMesh needs a shape, e.g. ProcessGroupMesh(2, 4)")
        _check_eager(eager)
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], Sequence) else shape
        if not dims:
            raise ValueError("shape must have at least one axis, e.g. ProcessGroupMesh(2, 4)")
        world_size = dist.get_world_size()
        layout = MeshLayout(dims, names, range(world_size) if ranks is None else ranks)  # type: ignore[arg-type]
        if ranks is not None:
            _check_in_world(max(ranks[0], ranks[-1]) if isinstance(ranks, range) else max(ranks))
        self._open(layout, backend, timeout, pg_options, eager, grace)

    @classmethod
    def from_layout(
        cls: type[_M],
        layout: MeshLayout,
        *,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        pg_options: Any = None,
        eager: bool = False,
        grace: timedelta | float | None = None,
    ) -> _M:
        """A mesh over ``layout``: its shape, names and ranks (in its order), on this rank.

        The keyword arguments are the constructor's, checked the same way; the
        layout's ranks must lie in the world, and this rank among them. Costs
        what the constructor costs: a layout over the default ranks is not
        expanded. Useful for a layout computed elsewhere (a sub-layout, a shrunk
        or node-aware table):

        >>> import torch.distributed as dist
        >>> from scopedmesh.layout import MeshLayout
        >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> layout = MeshLayout((1, 1), names=("dp", "tp"))
        >>> with ProcessGroupMesh.from_layout(layout, timeout=30) as mesh:
        ...     mesh.layout == layout, mesh.timeout, mesh.get_group_along_axis("tp").size()
        (True, datetime.timedelta(seconds=30), 1)
        >>> dist.destroy_process_group()
        """
        _require_world()
        if not isinstance(layout, MeshLayout):
            raise TypeError(f"layout must be a MeshLayout, got {shown(layout)}")
        if not layout.ndim:
            raise ValueError(f"layout must have at least one axis, got {shown(layout)}")
        _check_eager(eager)
        every = layout.compact_group((0,) * layout.ndim, tuple(range(layout.ndim)))
        _check_in_world(every[-1])  # ascending: the largest rank, O(ndim) for a range
        mesh = object.__new__(cls)
        mesh._open(layout, backend, timeout, pg_options, eager, grace)
        return mesh

    def _open(
        self,
        layout: MeshLayout,
        backend: object,
        timeout: object,
        pg_options: Any,
        eager: bool,
        grace: object = None,
    ) -> None:
        """Set up a root mesh from checked arguments; with ``eager``, make its groups."""
        checked_grace = None if grace is None else check_timeout(grace, "grace")
        self._init(
            layout,
            parent=None,
            backend=check_backend(backend, "backend"),
            timeout=None if timeout is None else check_timeout(timeout),
            pg_options=pg_options,
        )
        self._table.grace = checked_grace
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
        table: GroupTable | None = None,
    ) -> None:
        """Set up a mesh, a sub-mesh (``parent``) or a view (``table``: the group table it
        shares); ``place`` is this rank and its coordinate, when known."""
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
        self._backend = backend
        self._timeout = timeout
        self._pg_options = pg_options
        self._by_axis = {}
        self._slices = {}
        self._planes = {}
        caches = (self._by_axis, self._slices)
        # Set last: __del__ reads _scope, and a mesh whose set-up failed was never open.
        if parent is not None:
            scope = parent._scope.nest(caches)
        else:
            scope = Scope(table if table is not None else GroupTable(), forget=caches)
        self._table = scope.table
        self._live = scope.table.live
        self._scope = scope

    # --------------------------------------------------------------- lifetime

    def __enter__(self: _M) -> _M:
        """Enter the scope (once); a closed mesh raises :class:`MeshClosedError`."""
        self._scope.enter(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._scope.exit(self, exc_type, exc)

    def close(self) -> None:
        """Destroy the groups this scope made, newest first; then later calls are no-ops.

        Open sub-meshes close first. Groups already destroyed (e.g. by a global
        ``dist.destroy_process_group()``) are skipped. No communication happens.
        If destroying a group fails, the others are still destroyed and the first
        error is raised at the end.
        """
        self._scope.close()

    destroy_mesh_process_groups = close  # the name ColossalAI uses

    @property
    def closed(self) -> bool:
        """Whether this scope has closed."""
        return self._scope.closed

    # ------------------------------------------------ abort (what a liveness watch uses)

    def abort(self, because: str) -> None:
        """Refuse the groups of this mesh's tree from now on; shut down its gloo groups.

        An abort is a state, not an action: collectives in flight on the
        mesh, its parent or its sub-meshes raise, and every later request
        raises ``MeshClosedError`` saying they were shut down ``because``. Close
        the mesh as usual. Local, from any thread (a ``LivenessWatch`` calls it).
        """
        if not isinstance(because, str) or not because:
            raise TypeError(f"because must be a non-empty str, got {shown(because)}")
        self._table.abort(because)

    @property
    def aborted(self) -> str:
        """Why this mesh's tree was aborted (ends "... was shut down"); ``""`` while it is not."""
        return self._table.aborted

    def settle(self) -> None:
        """Close the aborted gloo groups whose collective has ended (``ClosableGroup.settle``)."""
        closable = sys.modules.get("scopedmesh.c10d.closable")  # loaded by the first gloo group
        if closable is not None and not self.closed:
            for group in self._table.groups():  # no lock: a formation may hold it
                if isinstance(group, closable.ClosableGroup):
                    group.settle()

    @property
    def liveness(self) -> Liveness | None:
        """The liveness watch that says which peers of this mesh's formations are lost."""
        return self._table.liveness

    def set_liveness(self, liveness: Liveness | None, *threads: threading.Thread | None) -> None:
        """Formations ask ``liveness`` who is lost; ``threads`` have store clients of their own."""
        self._table.liveness = liveness
        for thread in filter(None, threads):  # (liveness, None) as before: no thread
            self._table.store_use.declare_own_clients(thread)

    def __del__(self) -> None:
        scope = getattr(self, "_scope", None)
        if scope is not None:
            scope.warn_if_dropped_open(self)

    def __repr__(self) -> str:
        state = "closed" if self._scope.closed else "aborted" if self._table.aborted else "open"
        kind = "sub-mesh" if self._scope.parent is not None else "mesh"
        names = f", names={self._layout.names}" if self._layout.names else ""
        return (
            f"<ProcessGroupMesh {kind} shape={self._layout.shape}{names} rank={self._rank} {state}>"
        )

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

    @property
    def backend(self) -> str | None:
        """The default backend of this mesh's groups (torch's name), or None: WORLD's."""
        return self._backend

    @property
    def timeout(self) -> timedelta | None:
        """The default timeout of this mesh's groups, or None: torch's default."""
        return self._timeout

    @property
    def grace(self) -> timedelta | None:
        """How long a member waits before it looks for a deadlock or a dead peer; None: 0.5 s."""
        return self._table.grace

    @property
    def pg_options(self) -> Any:
        """The default backend options of this mesh's groups, or None."""
        return self._pg_options

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
        """This rank's rank in its group along ``axis``: its position along the axes.

        (On a torch where groups cannot keep their members' order, members
        ascend by global rank instead; the two agree whenever ranks ascend
        along the axes, as they always do with the default ranks.)
        """
        return self._members(axis, None).index(self._rank)

    def is_first(self, axis: Axes) -> bool:
        """Whether this rank is rank 0 of its group along ``axis``."""
        return self.local_rank(axis) == 0

    def is_last(self, axis: Axes) -> bool:
        """Whether this rank is the last rank of its group along ``axis``."""
        return self._members(axis, None)[-1] == self._rank

    def _members(self, axis: Axes, indices: object) -> range | tuple[int, ...]:
        """The ranks of this rank's group along ``axis``, in group-rank order."""
        if self._table.ordered:
            return self._layout.ordered_group(self._coord, axis, indices)
        return self._layout.compact_group(self._coord, axis, indices)

    # ColossalAI's static helpers, kept under their names (see scopedmesh.layout.colossal).
    ravel = staticmethod(_seed.ravel)
    unravel = staticmethod(_seed.unravel)
    get_coords_along_axis = staticmethod(_seed.get_coords_along_axis)

    # ------------------------------------------------------------------ groups

    def get_group_along_axis(
        self,
        axis: Axes,
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
        pg_options: Any = None,
    ) -> dist.ProcessGroup | None:
        """This rank's group along ``axis`` (one or several axes), made on first use.

        ``indices_at_axis`` keeps only those positions of the axes (e.g. ``[0, -1]``
        for the first and last pipeline stages); ranks outside them get ``None``.
        Every member must request the group, in the same order as its peers.
        If a member does not arrive within the mesh's timeout, this raises
        :class:`GroupFormationError`; once every member asks again, it forms.
        """
        if indices_at_axis is None and backend is None and pg_options is None:
            try:
                entry = self._by_axis[axis]
            except (KeyError, TypeError):  # not cached yet, or an unhashable axes list
                pass
            else:
                kind = axis.__class__
                if (
                    entry.alive
                    and (kind is str or kind is int or plain_axes(axis))
                    and (entry.group is None or entry.group in self._live)
                ):
                    return entry.group
        return self._get_group(axis, indices_at_axis, backend, pg_options)

    def create_group_along_axis(
        self,
        axis: Axes,
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
        pg_options: Any = None,
    ) -> dist.ProcessGroup | None:
        """Same as :meth:`get_group_along_axis`: a group is never made twice."""
        return self._get_group(axis, indices_at_axis, backend, pg_options)

    def create_groups(self, *axes: Axis) -> None:
        """Make this rank's group along each of ``axes`` (default: every axis), in mesh order."""
        chosen = self._layout.axes_indices(axes) if axes else range(self._layout.ndim)
        for axis in sorted(chosen):
            self.get_group_along_axis(axis)

    def get_ranks_in_group(self, group: dist.ProcessGroup) -> list[int]:
        """The global ranks of ``group``, in group-rank order."""
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup, got {shown(group)}")
        return dist.get_process_group_ranks(group)

    def _get_group(
        self, axis: Axes, indices: object, backend: str | None, pg_options: Any
    ) -> dist.ProcessGroup | None:
        with self._table.lock:
            return self._get_group_locked(axis, indices, backend, pg_options)

    def _get_group_locked(
        self, axis: Axes, indices: object, backend: str | None, pg_options: Any
    ) -> dist.ProcessGroup | None:
        self._scope.check_open(self)
        self._table.check_not_aborted(self)
        ranks = self._members(axis, indices)
        backend_name = self._backend_name(check_backend(backend, "backend"))
        own = backend is None or backend_name == self._backend_name(None)  # options are per backend
        options = pg_options if pg_options is not None else self._pg_options if own else None
        key = (ranks, backend_name)
        if self._rank not in ranks:
            entry = Entry(key, None, options)
        else:
            found = self._table.get(key)
            if found is None:
                entry = self._table.form(
                    key,
                    options,
                    timeout=self._timeout,
                    what=self._describe(axis, indices),
                    description=self._description(axis, indices),
                )
            else:
                entry = found
            self._scope.hold(entry)
            if not self._table.is_live(entry):
                raise RuntimeError(
                    f"the group along {self._describe(axis, indices)} over ranks {list(ranks)} "
                    "was destroyed outside this mesh (by torch.distributed.destroy_process_group); "
                    "the mesh does not make it again behind its peers' backs. Close this mesh "
                    "and make a new one"
                )
            if pg_options is not None and entry.options is not options:
                raise ValueError(
                    f"pg_options differ from those of the existing group over ranks {list(ranks)} "
                    f"on {backend_name!r}; a mesh keeps one group per (ranks, backend)"
                )
        self._table.check_not_aborted(self)  # aborted while the group formed
        if indices is None and backend is None and pg_options is None:
            try:
                self._by_axis[axis] = entry
            except TypeError:  # unhashable axes: no fast path
                pass
        return entry.group

    def _describe(self, axis: Axes, indices: object) -> str:
        chosen = self._layout.axes_indices(axis)
        names = tuple(self._layout.axis_name(a) for a in chosen)
        what = f"axis {names[0]!r}" if len(names) == 1 else f"axes {names}"
        return what if indices is None else f"{what} at indices {indices}"

    def _description(self, axis: Axes, indices: object) -> str:
        layout = self._layout
        chosen = layout.axes_indices(axis)
        if indices is None:  # the same group whatever order the axes were asked in
            chosen = tuple(sorted(chosen))
        names = [layout.axis_name(a) if layout.names else f"axis{a}" for a in chosen]
        return group_description(names, indices)

    def _backend_name(self, backend: str | None) -> str:
        chosen = backend or self._backend or dist.get_backend()
        return str(dist.Backend(chosen))

    # ------------------------------------------------------------- sub-meshes

    def submesh(self, *axes: Axis) -> ProcessGroupMesh:
        """A nested scope over ``axes`` through this rank's coordinate.

        It shares this mesh's groups, owns the groups first made through it and
        destroys those when it closes; closing this mesh closes it first.
        """
        with self._table.lock:
            return self._submesh(axes)

    def _submesh(self, axes: tuple[Axis, ...]) -> ProcessGroupMesh:
        self._scope.check_open(self)
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
        return child

    def view(
        self, *shape: int | Sequence[int], names: Sequence[str] | None = None
    ) -> ProcessGroupMesh:
        """Another factorization of this mesh's ranks, sharing its communicators.

        The view lays the same ranks, in the same C order, out as ``shape`` (one
        ``-1`` allowed; see :meth:`MeshLayout.reshape`), with the same backend,
        timeout and options. Wherever a group of the view has the ranks and
        backend of a group of this mesh (or of another view of it), both get the
        same object: one communicator per rank set, never two.

        A view is a scope of its own, not a sub-mesh: enter and close it on its
        own (``with mesh.view(...) as expert:``). A group lives as long as the
        last open scope that uses it, so closing either side never destroys a
        group the other still uses, and closing this mesh does not close its
        views. As for every group, members request shared groups in the same
        order as their peers.
        """
        if not shape:
            raise TypeError("view() needs a shape, e.g. mesh.view(2, 4, names=('edp', 'ep'))")
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], Sequence) else shape
        with self._table.lock:
            self._scope.check_open(self)
            layout = self._layout.reshape(dims, names)  # type: ignore[arg-type]
            view = object.__new__(ProcessGroupMesh)
            view._init(
                layout,
                parent=None,
                backend=self._backend,
                timeout=self._timeout,
                pg_options=self._pg_options,
                place=(self._rank, layout.unravel(self._rank)),
                table=self._table,
            )
        return view

    def __getitem__(self, axes: Axis | tuple[Axis, ...]) -> ProcessGroupMesh:
        """``mesh["pp", "tp"]``: the open sub-mesh over those axes, made on first use.

        Unlike :meth:`submesh`, which opens a new scope on every call, slicing
        returns the same sub-mesh while it is open (as DeviceMesh slicing does),
        so slicing in a loop does not pile up scopes.
        """
        items = axes if isinstance(axes, tuple) else (axes,)
        key = self._layout.axes_indices(items) if items else ()
        with self._table.lock:
            child = self._slices.get(key)
            if child is None or child._scope.closed:
                child = self._slices[key] = self.submesh(*items)
        return child

    def to_device_mesh(
        self,
        device_type: str,
        axes: Sequence[Axis] | None = None,
        *,
        backend_override: Mapping[Axis, str] | None = None,
    ) -> DeviceMesh:
        """A torch ``DeviceMesh`` over this mesh's own groups, valid while the mesh is open.

        See :func:`scopedmesh.mesh.interop.to_device_mesh`, which calls this.
        ``backend_override`` maps axes (names or indices) to the backend of their
        group, as ``init_device_mesh``'s argument of that name does: e.g.
        ``{"pp": "fake"}`` for an axis that carries no collective (torch's ``fake``
        backend must be registered). Such a group is the mesh's too, one per
        ``(ranks, backend)``.
        """
        from scopedmesh.c10d.device_mesh import (
            build_device_mesh,  # few programs need it: not at import
        )

        self._scope.check_open(self)
        overrides = self._backend_overrides(backend_override)

        def group_along(axis: int) -> dist.ProcessGroup | None:
            backend = overrides.get(axis)
            return self.get_group_along_axis(axis, backend=backend)

        return build_device_mesh(
            self._layout,
            self._coord,
            device_type,
            axes,
            group_along,
            keeps_order=self._table.ordered,
            lifetime=Binding(self._scope, self),
        )

    def _backend_overrides(self, backend_override: object) -> dict[int, str]:
        """``backend_override`` checked, keyed by axis index."""
        if backend_override is None:
            return {}
        if not isinstance(backend_override, Mapping):
            raise TypeError(
                "backend_override must map axes to backend names, such as {'pp': 'fake'}, "
                f"got {shown(backend_override)}"
            )
        overrides: dict[int, str] = {}
        for axis, backend in backend_override.items():
            index = self._layout.axis_index(axis, argument="backend_override")
            name = check_backend(backend, f"backend_override[{axis!r}]")
            if name is not None:
                overrides[index] = name
        return overrides


def _require_world() -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "ProcessGroupMesh needs torch.distributed: call "
            "torch.distributed.init_process_group() first"
        )


def _check_eager(eager: object) -> None:
    if not isinstance(eager, bool):
        raise TypeError(f"eager must be a bool, got {shown(eager)}")


def _check_in_world(largest: int) -> None:
    world_size = dist.get_world_size()
    if largest >= world_size:
        raise ValueError(
            f"ranks must lie in the world of {world_size} ranks (0..{world_size - 1}), "
            f"got rank {largest}"
        )


def plain_axes(axis: object) -> bool:
    """Whether ``axis`` is an int, a str or a tuple of them: safe as a cache key.

    ``1.0 == 1`` and ``(0, True) == (0, 1)``: such keys must not reach the cache.

    >>> plain_axes(("dp", 1)), plain_axes((0, True)), plain_axes(1.0)
    (True, False, False)
    """
    cls = axis.__class__
    if cls is int or cls is str:
        return True
    return cls is tuple and all(a.__class__ is int or a.__class__ is str for a in axis)  # type: ignore[attr-defined]
