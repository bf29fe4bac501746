"""Liveness from open sockets: every rank learns of a death in milliseconds, and the mesh stops.

One module per job: :mod:`~scopedmesh.mesh.liveness.ring` (the sockets: who
is alive), :mod:`~scopedmesh.mesh.liveness.deaths` (the death record in the
store), :mod:`~scopedmesh.mesh.liveness.guard` (which guarded meshes a death
aborts), :mod:`~scopedmesh.mesh.liveness.agreement` (the lost set every
survivor agrees on) and :mod:`~scopedmesh.mesh.liveness.watch` (the
:class:`LivenessWatch` that holds them: its thread, failures and lifetime).
"""

from scopedmesh.mesh.liveness.watch import LivenessWatch

__all__ = ["LivenessWatch"]
