"""The layout layer: pure rank algebra, standard library only (no torch).

``MeshLayout`` is the value; ``ints`` and the algebra modules are free functions
over tuples; ``placement``, ``survivors`` and ``colossal`` build or reshape
layouts. Everything here is exhaustively property-tested without a process group.

>>> from scopedmesh.layout import MeshLayout
>>> MeshLayout((2, 2), names=("dp", "tp")).groups("dp")
((0, 2), (1, 3))
"""

from scopedmesh.layout.mesh_layout import Axes, Axis, Index, MeshLayout, RavelMode, as_range

__all__ = ["Axes", "Axis", "Index", "MeshLayout", "RavelMode", "as_range"]
