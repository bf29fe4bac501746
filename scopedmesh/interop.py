"""Moved to :mod:`scopedmesh.mesh.interop`; this module keeps ``import scopedmesh.interop`` working."""

from scopedmesh.mesh.interop import layout_of, to_device_mesh

__all__ = ["layout_of", "to_device_mesh"]
