"""The fault layer, above the mesh: the liveness watch, heal, replicas that grow back.

:mod:`~scopedmesh.fault.liveness` (who is alive, and the abort of guarded
meshes), :mod:`~scopedmesh.fault.heal` (re-forming a mesh around lost ranks),
:mod:`~scopedmesh.fault.replicas` (replicas that grow back), with
:mod:`~scopedmesh.fault.protocol.membership` and :mod:`~scopedmesh.fault.state_transfer`
beneath it. The mesh knows only that it can be aborted.

>>> from scopedmesh.fault import LivenessWatch, Replicas
>>> LivenessWatch.__module__, Replicas.__module__
('scopedmesh.fault.liveness.watch', 'scopedmesh.fault.replicas')
"""

from scopedmesh.fault.liveness import LivenessWatch
from scopedmesh.fault.replicas import Replicas

__all__ = ["LivenessWatch", "Replicas"]
