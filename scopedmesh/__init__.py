"""scopedmesh: N-D torch.distributed process-group meshes with a lifetime you can see.

``import scopedmesh`` stays free of torch until a torch-backed name is used, so
the layout algebra and the ``plan`` CLI run where torch is absent or slow to load.

>>> from scopedmesh import MeshLayout
>>> MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).groups("tp")
((0, 1), (2, 3), (4, 5), (6, 7))
"""

from __future__ import annotations

from importlib import import_module
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from scopedmesh.errors import (
    AxisError,
    CoordinateError,
    GroupFormationError,
    JobFinishedError,
    JobMismatchError,
    LostRankError,
    MeshClosedError,
    NoLiveReplicaError,
    StepError,
)
from scopedmesh.layout import MeshLayout

if TYPE_CHECKING:
    from scopedmesh.fault.heal import agree_on_lost, reform
    from scopedmesh.fault.liveness import LivenessWatch
    from scopedmesh.fault.protocol.membership import Decision
    from scopedmesh.fault.records import JobView, job_view
    from scopedmesh.fault.replicas import Replicas
    from scopedmesh.layout.placement import node_aware_ranks
    from scopedmesh.layout.survivors import shrink
    from scopedmesh.mesh import ProcessGroupMesh
    from scopedmesh.mesh.nodes import node_aware_mesh, world_nodes

__all__ = [
    "AxisError",
    "CoordinateError",
    "Decision",
    "GroupFormationError",
    "JobFinishedError",
    "JobMismatchError",
    "JobView",
    "LivenessWatch",
    "LostRankError",
    "MeshClosedError",
    "MeshLayout",
    "NoLiveReplicaError",
    "ProcessGroupMesh",
    "Replicas",
    "StepError",
    "__version__",
    "agree_on_lost",
    "job_view",
    "node_aware_mesh",
    "node_aware_ranks",
    "reform",
    "shrink",
    "world_nodes",
]

__version__ = "0.1.1.dev0"

# Loaded on first use: the torch-backed names, and pure helpers few programs need.
_LAZY = MappingProxyType(
    {
        "ProcessGroupMesh": "scopedmesh.mesh",
        "LivenessWatch": "scopedmesh.fault.liveness",
        "Replicas": "scopedmesh.fault.replicas",
        "Decision": "scopedmesh.fault.protocol.membership",
        "JobView": "scopedmesh.fault.records",
        "job_view": "scopedmesh.fault.records",
        "agree_on_lost": "scopedmesh.fault.heal",
        "reform": "scopedmesh.fault.heal",
        "node_aware_mesh": "scopedmesh.mesh.nodes",
        "world_nodes": "scopedmesh.mesh.nodes",
        "node_aware_ranks": "scopedmesh.layout.placement",
        "shrink": "scopedmesh.layout.survivors",
    }
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'scopedmesh' has no attribute {name!r}")
    return getattr(import_module(module), name)
