"""The lifetime of a mesh or sub-mesh: entered once, closed once, warned about if dropped open.

A :class:`Scope` is the per-scope half of a tree whose shared half is a
:class:`~scopedmesh.mesh.group_table.GroupTable` (trio's ``CancelScope`` per
scope, beside the ``CancelStatus`` the tree shares). It holds what is its own:
the entries it holds (oldest first), its open child scopes, its parent, and
the ``entered``/``closed`` flags. Closing it closes its children first, then
lets go of its entries, newest first; an entry no open scope holds any more
goes back to the table, which destroys its group. Nothing communicates.

A scope holds every entry it forms, and every entry it reuses unless one of
its ancestors holds it already (an ancestor outlives its children). So a group
lives exactly as long as the last scope that uses it: a view's scope keeps a
group it shares with another view alive after that view closes.

It knows nothing of axes: the object it serves (a ``ProcessGroupMesh``) is
passed as ``owner`` where a message names it, and gives the dictionaries that
cache what the scope handed out (``forget``), emptied when it closes.

A torch ``DeviceMesh`` made for a scope sees it through a :class:`Binding`:
the scope's groups that torch made itself (for ``_flatten``) are *adopted*
and destroyed with the scope's own, and a closed scope's DeviceMesh raises
:class:`MeshClosedError` when it is used.

>>> from scopedmesh.mesh.group_table import GroupTable
>>> root = Scope(GroupTable())
>>> child = root.nest()
>>> root.close()
>>> child.closed, root.children
(True, [])
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch.distributed as dist

from scopedmesh.errors import MeshClosedError
from scopedmesh.mesh.group_table import Entry, GroupTable

__all__ = ["Binding", "Scope"]


class Scope:
    """The lifetime of one mesh or sub-mesh over a shared :class:`GroupTable`."""

    __slots__ = (
        "adopted",
        "bound",
        "children",
        "closed",
        "entered",
        "forget",
        "held",
        "parent",
        "table",
    )

    def __init__(
        self,
        table: GroupTable,
        parent: Scope | None = None,
        forget: tuple[dict[Any, Any], ...] = (),
    ) -> None:
        self.table = table
        self.parent = parent
        self.forget = forget  # the owner's caches of what it handed out through this scope
        self.held: dict[Entry, None] = {}  # the entries this scope holds, oldest first
        self.children: list[Scope] = []  # open child scopes, oldest first
        self.adopted: list[dist.ProcessGroup] = []  # groups torch made for this scope, oldest first
        self.bound = False  # whether a torch DeviceMesh was made over this scope
        self.closed = False
        self.entered = False

    def nest(self, forget: tuple[dict[Any, Any], ...] = ()) -> Scope:
        """A child scope over the same table, closed before this one (caller holds the lock)."""
        child = Scope(self.table, self, forget)
        self.children.append(child)
        return child

    def hold(self, entry: Entry) -> None:
        """Hold ``entry`` (formed or reused here) until this scope closes, unless an
        ancestor (or this scope) holds it already. The caller holds the table's lock."""
        scope: Scope | None = self
        while scope is not None:
            if entry in scope.held:
                return
            scope = scope.parent
        self.held[entry] = None
        entry.holds += 1

    def adopt(self, group: dist.ProcessGroup) -> None:
        """Destroy ``group``, which torch made for this scope, when the scope closes."""
        with self.table.lock:
            if self.closed:  # made after the close: nobody else will destroy it
                self.table.destroy([group])
            else:
                self.adopted.append(group)
                self.table.adopt(group)  # an abort shuts it down with the table's own

    def check_open(self, owner: object) -> None:
        """Raise :class:`MeshClosedError` naming ``owner`` once the scope has closed."""
        if self.closed:
            raise MeshClosedError(
                f"{owner!r} is closed; its groups were destroyed. Make a new mesh to get groups again"
            )

    def enter(self, owner: object) -> None:
        """Enter the scope (once); a closed scope raises :class:`MeshClosedError`."""
        self.check_open(owner)
        if self.entered:
            raise RuntimeError("this mesh's scope is already entered; a mesh is entered once")
        self.entered = True

    def exit(self, owner: object, exc_type: type[BaseException] | None, exc: object) -> None:
        """Close at the end of a ``with`` block, never replacing the exception that ended it."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:
            warnings.warn(
                f"closing {owner!r} after {exc_type.__name__ if exc_type else 'an error'} "
                f"also failed: {error!r}",
                RuntimeWarning,
                stacklevel=3,
            )

    def close(self) -> None:
        """Close the children, destroy the groups torch made for this scope, then release
        this scope's entries, newest first; once.

        If releasing fails, the rest are still released and the first error is
        raised at the end.
        """
        with self.table.lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        errors: list[Exception] = []
        try:
            for child in reversed(list(self.children)):  # each detaches itself
                try:
                    child._close()
                except Exception as error:
                    errors.append(error)
            errors += self.table.destroy(reversed(self.adopted))
            unheld = []
            for entry in reversed(self.held):
                entry.holds -= 1
                if entry.holds == 0:
                    unheld.append(entry)
            errors += self.table.release(unheld)
            if self.parent is None and self.table.standby is not None:  # the root: nobody else
                standby, self.table.standby = self.table.standby, None  # (reform took it first)
                standby.close()
            if self.parent is None:  # the mesh it replaced: its communicators' teardown is over
                try:
                    self.table.finish()
                except TimeoutError as error:
                    errors.append(error)
            if self.bound:
                from scopedmesh.c10d.device_mesh import forget_closed_meshes  # loaded already

                forget_closed_meshes()
        finally:
            self.held.clear()
            self.adopted.clear()
            self.children.clear()
            for cache in self.forget:
                cache.clear()
            if self.parent is not None and self in self.parent.children:
                self.parent.children.remove(self)
        if errors:
            raise errors[0]

    def warn_if_dropped_open(self, owner: object) -> None:
        """From ``owner.__del__``: a root scope dropped while open warns (``ResourceWarning``).

        It destroys nothing: ``__del__`` runs at a different moment on every rank.
        """
        if self.closed or self.parent is not None:
            return
        try:
            warnings.warn(
                f"unclosed {owner!r}: its process groups were never destroyed; use "
                "'with ProcessGroupMesh(...)' or call close()",
                ResourceWarning,
                source=owner,
                stacklevel=3,
            )
        except Exception:  # interpreter shutdown: nothing left to tell
            pass


class Binding:
    """A scope as a torch ``DeviceMesh`` made over it sees it (see
    :class:`scopedmesh.c10d.device_mesh.Lifetime`): open or closed, and where
    the groups torch makes for it go. It holds its owner weakly, so a DeviceMesh
    kept in torch's caches does not keep a mesh alive.
    """

    __slots__ = ("_owner", "_scope")

    def __init__(self, scope: Scope, owner: object) -> None:
        self._scope = scope
        self._owner = weakref.ref(owner)
        scope.bound = True

    @property
    def closed(self) -> bool:
        """Whether the scope has closed."""
        return self._scope.closed

    def check_open(self) -> None:
        """Raise :class:`MeshClosedError`, naming the mesh, once the scope has closed or
        its group table was aborted (a liveness watch learned of a death)."""
        aborted = self._scope.table.aborted
        if aborted and not self._scope.closed:
            owner = self._owner()
            raise MeshClosedError(
                f"this DeviceMesh belongs to {'a mesh' if owner is None else repr(owner)}, "
                f"whose groups were shut down {aborted}; re-form the survivors' mesh and "
                "make new DeviceMeshes, DTensors and FSDP2 modules from it"
            )
        if self._scope.closed:
            owner = self._owner()
            raise MeshClosedError(
                f"this DeviceMesh belongs to {'a mesh' if owner is None else repr(owner)}, "
                "which is closed: its groups were destroyed with it. A DeviceMesh, DTensor or "
                "FSDP2 module made in a closed block cannot be used any more; make new ones "
                "from an open mesh"
            )

    def adopt(self, group: dist.ProcessGroup) -> None:
        """Destroy ``group``, which torch made through the DeviceMesh, with the scope."""
        self._scope.adopt(group)
