"""The mesh layer: ``ProcessGroupMesh``, the scopes over it, nodes, healing, interop.

>>> from scopedmesh.mesh import ProcessGroupMesh
>>> ProcessGroupMesh.__name__
'ProcessGroupMesh'
"""

from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["ProcessGroupMesh"]
