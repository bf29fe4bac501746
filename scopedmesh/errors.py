"""The exception types of scopedmesh.

Each subclasses a standard exception, so callers can catch what they know:

>>> issubclass(MeshClosedError, RuntimeError)
True
>>> issubclass(CoordinateError, ValueError) and issubclass(CoordinateError, IndexError)
True
"""

from __future__ import annotations

import reprlib

__all__ = [
    "AxisError",
    "CoordinateError",
    "GroupFormationError",
    "JobFinishedError",
    "JobMismatchError",
    "LostRankError",
    "MeshClosedError",
    "NoLiveReplicaError",
    "StepError",
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


class StepError(RuntimeError):
    """A step failed because of an exception that left the job: on ``Replicas``, one inside
    a replicated step (or its state transfer) on a rank of this replica (the step failed
    on every member, and this replica left the job; raised on every rank of that replica,
    chained to the original exception where it was raised, while the other replicas see
    a failed step); on ``LivenessWatch.step``, a peer that left the job after an
    exception (its type and message in this error's, chained to this rank's own).
    """


class JobFinishedError(RuntimeError):
    """A replica started after its replicated job finished (``Replicas.finish()``): there
    is nothing to rejoin, and the process should exit."""


class JobMismatchError(ValueError):
    """A replica does not match the replicated job it starts in: its ``replicas`` or its
    number of ranks differs from the job's, or the state it receives does not fit its
    own tensors (a model or configuration that differs). A program error, not a fault:
    a restart of the replica will not help, and a launcher should not restart it."""


class NoLiveReplicaError(RuntimeError):
    """A replica started in a replicated job whose every member died: no replica holds
    the job's state, and none will admit it. Restart the job from a checkpoint."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 4
_SHOWN.maxtuple = _SHOWN.maxlist = _SHOWN.maxset = _SHOWN.maxfrozenset = 64
_SHOWN.maxdict = 16
_SHOWN.maxstring = _SHOWN.maxother = 200
_SHOWN.maxlong = 60


def shown(value: object) -> str:
    """``repr(value)`` for an error message, bounded: a bad argument never breaks the error.

    Deep, self-containing or huge values are cut short instead of recursing or
    filling the message.

    >>> shown((2, 4)), shown("tp")
    ('(2, 4)', "'tp'")
    >>> deep = [1]
    >>> for _ in range(10_000):
    ...     deep = [deep]
    >>> shown(deep)
    '[[[[...]]]]'
    """
    return _SHOWN.repr(value)


def clipped(text: str, limit: int = 200) -> str:
    """``text`` for an error message, cut to ``limit`` characters (for words a user typed).

    >>> clipped("dp tp"), clipped("x" * 300)[-3:], len(clipped("x" * 300))
    ('dp tp', 'xx…', 200)
    """
    return text if len(text) <= limit else text[: limit - 1] + "…"
