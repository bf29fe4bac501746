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

if TYPE_CHECKING:
    from scopedmesh.mesh import ProcessGroupMesh

__all__ = [
    "AxisError",
    "CoordinateError",
    "GroupFormationError",
    "MeshClosedError",
    "MeshLayout",
    "ProcessGroupMesh",
    "__version__",
]

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> Any:
    if name == "ProcessGroupMesh":
        from scopedmesh.mesh import ProcessGroupMesh

        return ProcessGroupMesh
    raise AttributeError(f"module 'scopedmesh' has no attribute {name!r}")
