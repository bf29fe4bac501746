"""Liveness from open sockets: every rank learns of a death in milliseconds, and the mesh stops.

One module per job: :mod:`~scopedmesh.fault.liveness.ring` (the sockets: who
is alive), :mod:`~scopedmesh.fault.liveness.deaths` (the death record in the
store), :mod:`~scopedmesh.fault.liveness.guard` (which guarded meshes a death
aborts), :mod:`~scopedmesh.fault.liveness.agreement` (the lost set every
survivor agrees on) and :mod:`~scopedmesh.fault.liveness.watch` (the
:class:`LivenessWatch` that holds them: its thread, failures and lifetime).
"""

from scopedmesh.fault.liveness.watch import LivenessWatch

__all__ = ["LivenessWatch"]
