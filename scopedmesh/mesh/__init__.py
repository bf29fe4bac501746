"""The mesh layer: ``ProcessGroupMesh`` (its scopes, the group table they share), nodes, interop.

>>> from scopedmesh.mesh import ProcessGroupMesh
>>> ProcessGroupMesh.__name__
'ProcessGroupMesh'
"""

from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["ProcessGroupMesh"]
