"""The guard: which guarded meshes a death hits; they are aborted, and settled every interval.

A guarded mesh holding a rank that died is aborted (:meth:`ProcessGroupMesh.abort
<scopedmesh.mesh.process_group_mesh.ProcessGroupMesh.abort>`): its gloo groups
shut down, so a rank blocked in a collective with healthy peers raises at once
instead of waiting for the collective's timeout. Every interval the guarded
meshes are settled (:meth:`ProcessGroupMesh.settle`): an aborted group whose
collective has ended closes its connections, so a peer does not wait on it.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable

import torch

from scopedmesh.c10d.diagnosis import Liveness
from scopedmesh.fault.protocol.verdict import stopped
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["Guard"]


class Guard:
    """The meshes one liveness watch guards, and when each dead rank's meshes were aborted.

    >>> guard = Guard()
    >>> guard.hit({3}), guard.aborted_at(3)
    (None, None)
    """

    def __init__(self) -> None:
        self.meshes: tuple[ProcessGroupMesh, ...] = ()
        self.aborted: dict[int, float] = {}  # rank -> time.time() guarded meshes were aborted
        self._warned = False  # whether add() has checked that groups are closable
        # id(mesh) -> (its members' key (line_key), how many agreements they had held when
        # guarded)
        self._since: dict[int, tuple[str, int]] = {}
        self._stops: set[tuple[int, str, int]] = set()  # every stop learned: a mesh guarded
        # later is aborted by one of its attempt too (its first step may not have begun)

    def add(
        self,
        mesh: ProcessGroupMesh,
        liveness: Liveness,
        threads: tuple[threading.Thread, ...],
        lost: Callable[[], frozenset[int]],
        since: tuple[str, int] = ("", 0),
    ) -> None:
        """Guard ``mesh`` for ``liveness`` (whose ``threads`` have store clients of their own);
        abort it at once if it holds a rank in ``lost()``.

        ``lost()`` is read once ``mesh`` is registered: a death learned before that
        is in it, one learned after hits the registered mesh (:meth:`hit`), so
        none falls between the two. ``since`` names the mesh's members
        (:func:`~scopedmesh.fault.protocol.agreement.members_key`) and how many
        agreements they had held: stops of earlier attempts never abort ``mesh``.
        """
        self._warn_if_not_closable()
        self.meshes = (*[m for m in self.meshes if not m.closed], mesh)
        self._since = {id(m): self._since.get(id(m), since) for m in self.meshes}
        self._since[id(mesh)] = since  # never a dropped mesh's, whose id it may reuse
        mesh.set_liveness(liveness, *threads)  # formations ask it; never use torch's client
        self.settle()
        dead = lost().intersection(mesh.layout.ranks)
        if dead:
            self._abort(mesh, dead)
        self.stop(self._stops)  # read after registering: none falls between the two

    def key_of(self, mesh: ProcessGroupMesh) -> str | None:
        """The members' key ``mesh`` was guarded with, or None where it is not guarded."""
        if not any(m is mesh for m in self.meshes):
            return None
        return self._since[id(mesh)][0]

    def open_keys(self) -> set[str]:
        """The keys of the guarded meshes not closed yet."""
        return {self._since[id(m)][0] for m in self.meshes if not m.closed}

    def hit(self, new: Iterable[int]) -> None:
        """Abort the open guarded meshes that hold a rank of ``new`` (newly learned deaths)."""
        new = set(new)
        for mesh in self.meshes:
            hit = new.intersection(mesh.layout.ranks)
            if hit and not mesh.closed:
                self._abort(mesh, hit)

    def stop(self, stops: Iterable[tuple[int, str, int]]) -> None:
        """Abort the open guarded meshes that hold a rank whose step raised, ``(rank,
        members, attempt)``: those over the same members guarded before that attempt's
        agreement, never one re-formed after it (a stop the thread reads late must not
        abort the survivors' new mesh), nor a mesh of other members."""
        stops = set(stops)
        self._stops |= stops
        for mesh in self.meshes:
            key, since = self._since.get(id(mesh), ("", 0))
            hit = sorted(stopped(stops, key, since).intersection(mesh.layout.ranks))
            if hit and not mesh.closed and not mesh.aborted:
                mesh.abort(f"when rank(s) {hit} stopped the step (an exception in it)")

    def abort_members(self, keys: set[str], why: str) -> None:
        """Abort the open guarded meshes whose members' keys are among ``keys``."""
        for mesh in self.meshes:
            key, _ = self._since.get(id(mesh), ("", 0))
            if key in keys and not mesh.closed:
                mesh.abort(f"when {why}")

    def aborted_at(self, rank: int) -> float | None:
        """``time.time()`` when the guarded meshes holding ``rank`` were aborted, or None."""
        return self.aborted.get(rank)

    def settle(self) -> None:
        """Close the aborted groups whose collective has ended (a held one stalls its peers)."""
        for mesh in self.meshes:
            mesh.settle()

    def unsettled(self) -> bool:
        """Whether a guarded mesh was aborted and is not closed yet (it needs settling)."""
        return any(mesh.aborted and not mesh.closed for mesh in self.meshes)

    def release(self, liveness: Liveness) -> None:
        """Let go of every mesh: their formations stop asking ``liveness``."""
        for mesh in self.meshes:
            if mesh.liveness is liveness:
                mesh.set_liveness(None)
        self.meshes = ()

    def _abort(self, mesh: ProcessGroupMesh, dead: Iterable[int]) -> None:
        dead = sorted(dead)
        mesh.abort(f"when the liveness watch learned that rank(s) {dead} died")
        now = time.time()
        for rank in dead:
            self.aborted.setdefault(rank, now)

    def _warn_if_not_closable(self) -> None:
        """Once per guard, on a torch that cannot make closable gloo groups: say what is lost."""
        if self._warned:
            return
        self._warned = True
        from scopedmesh.c10d import closable  # registers the backend, as a gloo group would

        if not closable.supported():
            warnings.warn(
                f"LivenessWatch.guard: torch {torch.__version__} cannot make closable gloo "
                "groups, so the watch cannot abort a collective in flight: when a rank dies, "
                "a rank blocked in a collective with healthy peers waits for that "
                "collective's timeout before it raises (deaths are still learned, agreed on "
                "and healed; give guarded meshes a short timeout)",
                RuntimeWarning,
                stacklevel=4,
            )
