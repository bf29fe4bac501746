"""A mesh's scope: the groups it owns, its sub-meshes, and closing them without communicating.

:class:`Scope` is the lifetime half of :class:`~scopedmesh.mesh.process_group_mesh.ProcessGroupMesh`:
``with``, ``close()``, the ``closed`` flag and the ``ResourceWarning`` of a mesh
dropped while open. It declares the state every part of the mesh shares.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.errors import MeshClosedError
from scopedmesh.layout.mesh_layout import MeshLayout

__all__ = ["Entry", "GroupKey", "Scope"]

GroupKey = tuple[range | tuple[int, ...], str]
_S = TypeVar("_S", bound="Scope")


class Entry:
    """One group made by a scope; ``alive`` turns False when its scope destroys it."""

    __slots__ = ("alive", "group", "key", "options")

    def __init__(self, key: GroupKey, group: dist.ProcessGroup | None, options: object) -> None:
        self.key = key
        self.group = group
        self.options = options
        self.alive = True


class Scope:
    """The lifetime of a mesh or sub-mesh: enter once, close once, warn if dropped open."""

    _layout: MeshLayout
    _rank: int
    _coord: tuple[int, ...]
    _parent: Scope | None
    _registry: dict[GroupKey, Entry]  # shared by a mesh and all its sub-meshes
    # One re-entrant lock per root mesh, shared by its sub-meshes: group creation,
    # close() and sub-mesh bookkeeping run one thread at a time (ProcessGroupMesh: THREADS).
    _lock: threading.RLock
    _backend: str | None
    _timeout: timedelta | None
    _pg_options: Any
    _by_axis: dict[object, Entry]  # fast path: axis as given -> entry
    _live: Mapping[dist.ProcessGroup, object]
    _created: list[Entry]  # the groups this scope made, oldest first
    _children: list[Scope]  # open sub-meshes
    _closed: bool
    _entered: bool
    _slices: dict[tuple[int, ...], Any]  # sub-meshes made by mesh[...], by axes (typed by the mesh)

    def __enter__(self: _S) -> _S:
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
        with self._lock:
            self._close()

    def _close(self) -> None:
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
