"""scopedmesh: N-D torch.distributed process-group meshes with a lifetime you can see.

``import scopedmesh`` stays free of torch until a torch-backed name is used, so
the layout algebra and the ``plan`` CLI run where torch is absent or slow to load.

>>> from scopedmesh import MeshLayout
>>> MeshLayout((2, 2, 2), names=("dp", "pp", "tp")).groups("tp")
((0, 1), (2, 3), (4, 5), (6, 7))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scopedmesh.errors import AxisError, CoordinateError, GroupFormationError, MeshClosedError
from scopedmesh.layout import MeshLayout
from scopedmesh.placement import node_aware_ranks

if TYPE_CHECKING:
    from scopedmesh.mesh import ProcessGroupMesh
    from scopedmesh.nodes import node_aware_mesh, world_nodes

__all__ = [
    "AxisError",
    "CoordinateError",
    "GroupFormationError",
    "MeshClosedError",
    "MeshLayout",
    "ProcessGroupMesh",
    "__version__",
    "node_aware_mesh",
    "node_aware_ranks",
    "world_nodes",
]

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> Any:
    if name == "ProcessGroupMesh":
        from scopedmesh.mesh import ProcessGroupMesh

        return ProcessGroupMesh
    if name in ("node_aware_mesh", "world_nodes"):
        from scopedmesh import nodes

        return getattr(nodes, name)
    raise AttributeError(f"module 'scopedmesh' has no attribute {name!r}")
