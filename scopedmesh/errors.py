"""The exception types of scopedmesh.

Each subclasses a standard exception, so callers can catch what they know:

>>> issubclass(MeshClosedError, RuntimeError)
True
>>> issubclass(CoordinateError, ValueError) and issubclass(CoordinateError, IndexError)
True
"""

from __future__ import annotations

__all__ = [
    "AxisError",
    "CoordinateError",
    "GroupFormationError",
    "LostRankError",
    "MeshClosedError",
]


class MeshClosedError(RuntimeError):
    """A group method was called on a mesh (or sub-mesh) whose scope has closed."""


class GroupFormationError(RuntimeError):
    """A process group could not be formed: a member did not arrive in time.

    The message names the mesh axis, the ranks and the likely cause (a member
    that never asked for the group, or members asking in different orders).
    """


class AxisError(ValueError, IndexError):
    """An axis that the mesh does not have: an unknown name or an index out of range.

    Like numpy's ``AxisError`` it is both a ``ValueError`` and an ``IndexError``.
    """


class CoordinateError(ValueError, IndexError):
    """A coordinate outside the mesh's shape, or a rank the mesh does not hold.

    numpy's ``ravel_multi_index`` and ``unravel_index`` raise ``ValueError`` for
    these; this class is also an ``IndexError``, so ``except IndexError`` keeps
    working.
    """


class LostRankError(RuntimeError):
    """This rank was declared lost by the survivors' verdict: it must not join the new mesh."""
