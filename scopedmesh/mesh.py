"""ProcessGroupMesh: an N-D mesh that owns the process groups it makes, for a scope.

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
>>> with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
...     tp = mesh.get_group_along_axis("tp")
...     mesh.get_ranks_in_group(tp), mesh.coordinate(), mesh.is_first("tp")
([0], (0, 0), True)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import torch.distributed as dist

from scopedmesh import _c10d
from scopedmesh.errors import GroupFormationError, MeshClosedError
from scopedmesh.layout import Axes, Axis, MeshLayout, RavelMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroupMesh"]

GroupKey = tuple[range | tuple[int, ...], str]


class _Entry:
    """One group made by a scope; ``alive`` turns False when its scope destroys it."""

    __slots__ = ("alive", "group", "key", "options")

    def __init__(self, key: GroupKey, group: dist.ProcessGroup | None, options: object) -> None:
        self.key = key
        self.group = group
        self.options = options
        self.alive = True


class ProcessGroupMesh:
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
    """

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
            backend=_check_backend(backend, "backend"),
            timeout=_check_timeout(timeout),
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
        self._registry: dict[GroupKey, _Entry] = {} if parent is None else parent._registry
        self._backend = backend
        self._timeout = timeout
        self._pg_options = pg_options
        self._by_axis: dict[object, _Entry] = {}  # fast path: axis as given -> entry
        self._live: Mapping[dist.ProcessGroup, object] = _c10d.live_groups()
        # Sub-layouts and coordinates by the axes asked for: a sub-mesh costs O(1) when repeated.
        self._planes: dict[tuple[Axis, ...], tuple[MeshLayout, tuple[int, ...]]] = {}
        self._created: list[_Entry] = []
        self._children: list[ProcessGroupMesh] = []
        self._closed = False
        self._entered = False
        self._slices: dict[tuple[int, ...], ProcessGroupMesh] = {}  # made by mesh[...], by axes

    # ---------------------------------------------------------------- scope

    def __enter__(self) -> ProcessGroupMesh:
        """Enter the scope (once); a closed mesh raises :class:`MeshClosedError`."""
        self._check_open()
        if self._entered:
            raise RuntimeError("this mesh's scope is already entered; a mesh is entered once")
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:  # never replace the exception that ended the block
            warnings.warn(
                f"closing {self!r} after {exc_type.__name__ if exc_type else 'an error'} "
                f"also failed: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        """Destroy the groups this scope made, newest first; then later calls are no-ops.

        Open sub-meshes close first. Groups already destroyed (e.g. by a global
        ``dist.destroy_process_group()``) are skipped. No communication happens.
        If destroying a group fails, the others are still destroyed and the first
        error is raised at the end.
        """
        if self._closed:
            return
        self._closed = True
        errors: list[Exception] = []
        try:
            for child in reversed(list(self._children)):
                try:
                    child.close()
                except Exception as error:
                    errors.append(error)
            for entry in reversed(self._created):
                entry.alive = False
                if self._registry.get(entry.key) is entry:
                    del self._registry[entry.key]
                if entry.group is not None:
                    try:
                        _c10d.destroy(entry.group)
                    except Exception as error:  # keep going: the other groups must still go
                        errors.append(error)
        finally:
            self._created.clear()
            self._by_axis.clear()
            self._children.clear()
            self._slices.clear()
            if self._parent is not None and self in self._parent._children:
                self._parent._children.remove(self)
        if errors:
            raise errors[0]

    def destroy_mesh_process_groups(self) -> None:
        """Same as :meth:`close` (the name ColossalAI uses)."""
        self.close()

    @property
    def closed(self) -> bool:
        """Whether this scope has closed."""
        return self._closed

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_parent", None) is not None:
            return
        try:
            warnings.warn(
                f"unclosed {self!r}: its process groups were never destroyed; use "
                "'with ProcessGroupMesh(...)' or call close()",
                ResourceWarning,
                source=self,
                stacklevel=2,
            )
        except Exception:  # interpreter shutdown: nothing left to tell
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        kind = "sub-mesh" if self._parent is not None else "mesh"
        names = f", names={self._layout.names}" if self._layout.names else ""
        return (
            f"<ProcessGroupMesh {kind} shape={self._layout.shape}{names} rank={self._rank} {state}>"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise MeshClosedError(
                f"{self!r} is closed; its groups were destroyed. Make a new mesh to get groups again"
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

    @staticmethod
    def ravel(coord: Sequence[int], shape: Sequence[int], mode: RavelMode = "raise") -> int:
        """The rank at ``coord`` in a default C-order mesh of ``shape``."""
        return MeshLayout(shape).ravel(coord, mode)

    @staticmethod
    def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """The coordinate of ``rank`` in a default C-order mesh of ``shape``."""
        return MeshLayout(shape).unravel(rank)

    @staticmethod
    def get_coords_along_axis(
        base_coord: Sequence[int], axis: int | Sequence[int], indices_at_axis: Sequence[Any]
    ) -> list[tuple[int, ...]]:
        """ColossalAI's helper: ``base_coord`` with ``axis`` set to each index, in C order.

        >>> ProcessGroupMesh.get_coords_along_axis((0, 1, 0), 2, [0, 1])
        [(0, 1, 0), (0, 1, 1)]
        """
        coord = _int_list(base_coord, "base_coord")
        if isinstance(axis, int) and not isinstance(axis, bool):
            axes, lists = [axis], [indices_at_axis]
        else:
            axes, lists = _int_list(axis, "axis"), list(indices_at_axis)
        if len(lists) != len(axes):
            raise ValueError(
                f"indices_at_axis must hold one list of indices per axis ({len(axes)}), "
                f"got {indices_at_axis!r}"
            )
        for a in axes:
            if not -len(coord) <= a < len(coord):
                raise IndexError(f"axis {a} is out of range for base_coord {tuple(coord)}")
        result = []
        for values in itertools.product(*(_int_list(ix, "indices_at_axis") for ix in lists)):
            for a, v in zip(axes, values):
                coord[a] = v
            result.append(tuple(coord))
        return result

    # ---------------------------------------------------------------- groups

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
                    and (kind is str or kind is int or _plain_axes(axis))
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
            raise TypeError(f"group must be a ProcessGroup, got {group!r}")
        return dist.get_process_group_ranks(group)

    def _get_group(
        self,
        axis: Axes,
        indices: object,
        backend: str | None,
        pg_options: Any,
    ) -> dist.ProcessGroup | None:
        self._check_open()
        ranks = self._layout.compact_group(self._coord, axis, indices)
        backend_name = self._backend_name(_check_backend(backend, "backend"))
        options = self._pg_options if pg_options is None else pg_options
        if self._rank not in ranks:
            entry = _Entry((ranks, backend_name), None, options)
        else:
            entry = self._registry.get((ranks, backend_name)) or self._make(
                ranks, backend_name, options, self._describe(axis, indices)
            )
            if entry.group is not None and entry.group not in self._live:
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
        if indices is None and backend is None and pg_options is None:
            try:
                self._by_axis[axis] = entry
            except TypeError:  # unhashable axes: no fast path
                pass
        return entry.group

    def _make(
        self, ranks: range | tuple[int, ...], backend: str, options: Any, what: str
    ) -> _Entry:
        try:
            group = _c10d.new_member_group(
                ranks,
                backend=backend,
                timeout=self._timeout,
                pg_options=options,
                description=f"scopedmesh:{what}",
            )
        except RuntimeError as error:
            waited = f" within {self._timeout}" if self._timeout is not None else ""
            raise GroupFormationError(
                f"could not form the {backend} process group along {what} over ranks "
                f"{list(ranks)}{waited}. Likely cause: a member never requested this group, or "
                "members requested overlapping groups in different orders (every member must "
                f"request the same groups in the same order). torch said: {error}"
            ) from error
        entry = _Entry((ranks, backend), group, options)
        self._registry[entry.key] = entry
        self._created.append(entry)
        return entry

    def _describe(self, axis: Axes, indices: object) -> str:
        chosen = self._layout.axes_indices(axis)
        names = tuple(self._layout.axis_name(a) for a in chosen)
        what = f"axis {names[0]!r}" if len(names) == 1 else f"axes {names}"
        return what if indices is None else f"{what} at indices {indices}"

    def _backend_name(self, backend: str | None) -> str:
        chosen = backend or self._backend or dist.get_backend()
        return str(dist.Backend(chosen))

    # ------------------------------------------------------------- sub-meshes

    def submesh(self, *axes: Axis) -> ProcessGroupMesh:
        """A nested scope over ``axes`` through this rank's coordinate.

        It shares this mesh's groups, owns the groups first made through it and
        destroys those when it closes; closing this mesh closes it first.
        """
        self._check_open()
        if not axes:
            raise TypeError("submesh() needs at least one axis")
        plane = self._planes.get(axes) if _plain_axes(axes) else None
        if plane is None:
            chosen = self._layout.axes_indices(axes)
            plane = (self._layout.sub(self._coord, axes), tuple(self._coord[a] for a in chosen))
            if _plain_axes(axes):
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
        child = self._slices.get(key)
        if child is None or child._closed:
            child = self._slices[key] = self.submesh(*items)
        return child

    def to_device_mesh(self, device_type: str, axes: Sequence[Axis] | None = None) -> DeviceMesh:
        """A torch ``DeviceMesh`` over this mesh's own groups, valid while the mesh is open."""
        from scopedmesh.interop import to_device_mesh

        return to_device_mesh(self, device_type, axes)


def _plain_axes(axis: object) -> bool:
    """Whether ``axis`` is an int, a str or a tuple of them: safe as a cache key.

    ``1.0 == 1`` and ``(0, True) == (0, 1)``: such keys must not reach the cache.
    """
    cls = axis.__class__
    if cls is int or cls is str:
        return True
    return cls is tuple and all(a.__class__ is int or a.__class__ is str for a in axis)  # type: ignore[attr-defined]


def _check_backend(backend: object, argument: str) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            f"{argument} must be a backend name such as 'gloo' or 'nccl', got {backend!r}"
        )
    try:
        name = str(dist.Backend(backend))
    except ValueError:
        raise ValueError(
            f"{argument} {backend!r} is not a torch.distributed backend; "
            "use e.g. 'gloo', 'nccl' or 'fake'"
        ) from None
    # dist.Backend() takes any name; an unknown or unbuilt one fails later, inside torch.
    missing = [
        p for p in (q.split(":")[-1] for q in name.split(",")) if not dist.is_backend_available(p)
    ]
    if missing:
        raise ValueError(
            f"{argument} {backend!r} is not available in this torch build ({missing[0]!r} is "
            "unknown or not compiled in); use e.g. 'gloo', or 'nccl' on a CUDA build"
        )
    problem = _c10d.unusable_backend(name)
    if problem is not None:  # e.g. NCCL in a CUDA build on a host without a GPU
        raise ValueError(f"{argument} {backend!r} cannot form a group on this host: {problem}")
    return name


_MAX_TIMEOUT = timedelta(microseconds=2**63 - 1)  # about 292,000 years


def _check_timeout(timeout: object) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        result = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        try:
            result = timedelta(seconds=timeout)
        except (OverflowError, ValueError):  # inf, nan, or more days than timedelta holds
            raise ValueError(
                f"timeout must be a finite number of seconds, got {timeout!r}"
            ) from None
    else:
        raise TypeError(f"timeout must be a timedelta or a number of seconds, got {timeout!r}")
    if result is not None and result <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if result is not None and result > _MAX_TIMEOUT:
        raise ValueError(
            f"timeout must be at most {_MAX_TIMEOUT} (torch counts it in int64 microseconds), "
            f"got {timeout!r}"
        )
    return result


def _int_list(value: object, argument: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{argument} must be a sequence of ints, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{argument} must contain only ints, got {value!r}")
    return list(value)
