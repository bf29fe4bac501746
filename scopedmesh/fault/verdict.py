"""A replicated step's collectives and its verdict's parts, apart from membership.

:class:`~scopedmesh.fault.replicas.Replicas` runs each step as: the catch-up of
fresh joiners (if the epoch has any), the average of the gradients along the
epoch's dp group, then the verdict, a MAX of a few integers along dp and then
along the replica's own group (:class:`Flags`). Everything here is what those
collectives need: the average, the MAX's options, the device the replica's own
group takes tensors on, and the checks of what the loop hands in (the
constructor's arguments, a step's tensors).

>>> flags = Flags.of(ok=False, joins=3, error_at=None, unmovable_at=1)
>>> flags.values.tolist(), flags.failed, flags.joins, flags.error_at, flags.unmovable_at
([1, 3, 0, 2, 0], True, 3, None, 1)
>>> group_device("cpu:gloo,cuda:nccl")
device(type='cpu')
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.errors import JobMismatchError, StepError, shown
from scopedmesh.fault.state_transfer import Stateful, run
from scopedmesh.layout.ints import is_int

__all__ = [
    "Flags",
    "average",
    "check_args",
    "check_tensors",
    "group_device",
    "max_options",
    "verdict_error",
]

_CPU_BACKENDS = ("gloo", "mpi", "ucc", "fake", "threaded")


def group_device(backend: str) -> torch.device:
    """The device a group of ``backend`` (``dist.get_backend``'s answer) takes tensors on:
    the CPU wherever a backend of it takes CPU tensors, else this process's CUDA device
    (an NCCL-only group).

    >>> group_device("gloo"), group_device("cpu:gloo,cuda:nccl")
    (device(type='cpu'), device(type='cpu'))
    """
    name = str(backend).lower()
    if "cpu:" in name or any(b in name for b in _CPU_BACKENDS) or "nccl" not in name:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"an NCCL-only group needs CUDA (backend {backend!r}), none is visible")
    return torch.device("cuda", torch.cuda.current_device())


def check_args(
    store: object, replica: object, replicas: object, state: object, poll: object
) -> dict[str, Stateful]:
    """``Replicas``' arguments checked before any side effect: ``state`` as a dict.

    >>> check_args(None, 0, 1, {}, 0.01)
    Traceback (most recent call last):
    TypeError: store must be a torch.distributed.Store (the job's TCPStore, hosted by the launcher), got None
    """
    if not isinstance(store, dist.Store):  # type: ignore[attr-defined]  # public; not in torch's stub exports
        raise TypeError(
            f"store must be a torch.distributed.Store (the job's TCPStore, hosted by the "
            f"launcher), got {shown(store)}"
        )
    if not isinstance(poll, int | float) or isinstance(poll, bool):
        raise TypeError(f"poll must be a number of seconds, got {shown(poll)}")
    if not (math.isfinite(poll) and poll > 0):
        raise ValueError(f"poll must be a positive, finite number of seconds, got {shown(poll)}")
    if not is_int(replicas) or isinstance(replicas, bool):
        raise TypeError(f"replicas must be an int, got {shown(replicas)}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {shown(replicas)}")
    if not is_int(replica) or isinstance(replica, bool):
        raise TypeError(f"replica must be an int, got {shown(replica)}")
    if not 0 <= replica < replicas:
        raise ValueError(f"replica must be in 0..{replicas - 1}, got {shown(replica)}")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to stateful objects, got {shown(state)}")
    for name, obj in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state's names must be str, got {shown(name)}")
        if not callable(getattr(obj, "state_dict", None)) or not callable(
            getattr(obj, "load_state_dict", None)
        ):
            raise TypeError(
                f"state[{name!r}] must have state_dict() and load_state_dict(), got {shown(obj)}"
            )
    return dict(state)


def check_tensors(tensors: object) -> list[torch.Tensor]:
    """``tensors`` as a list, or a ``TypeError`` naming what is not a tensor.

    >>> check_tensors("ab")
    Traceback (most recent call last):
    TypeError: tensors must be a sequence of torch.Tensor, got 'ab'
    """
    if isinstance(tensors, str | bytes | torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be a sequence of torch.Tensor, got {shown(tensors)}")
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {shown(tensor)}")
    return list(tensors)


def max_options() -> Any:
    """gloo's all-reduce options for a MAX."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch's stub: RedOpType
    return options


def average(pg: Any, tensors: Sequence[torch.Tensor], size: int, contributors: int) -> None:
    """The sum over the group's ``size`` members divided by its ``contributors``: one
    all-reduce per dtype, one at a time (a failed one leaves no queued work behind:
    gloo's group waits for its queue before it closes its connections)."""
    if size == 1:
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        run(functools.partial(pg.allreduce, [flat]))
        flat.div_(contributors)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


@dataclass
class Flags:
    """A step's verdict as five integers, MAXed along dp and the replica's group:
    ``failed`` (a dp collective failed somewhere), ``joins`` (the joins counter),
    ``error`` (1 + the highest coordinate of this replica where an exception other
    than a failed collective was raised; 0: none), ``unmovable`` (1 + the
    coordinate whose source could not pack its state), ``mismatch`` (1 + the
    coordinate of this replica whose registered state did not fit the state it
    received: a :class:`~scopedmesh.errors.JobMismatchError`, which every rank of
    the replica raises, since a restart will not help). The rank that raised has
    dropped its dp group, so ``error`` and ``mismatch`` never travel along dp:
    only its own replica learns them (and leaves); the others see a failed step.
    ``unmovable`` travels everywhere (the group is intact): every member stops."""

    values: torch.Tensor

    @staticmethod
    def of(
        ok: bool,
        joins: int,
        error_at: int | None,
        unmovable_at: int | None = None,
        mismatch_at: int | None = None,
    ) -> Flags:
        error = 0 if error_at is None else error_at + 1
        unmovable = 0 if unmovable_at is None else unmovable_at + 1
        mismatch = 0 if mismatch_at is None else mismatch_at + 1
        values = [0 if ok else 1, joins, error, unmovable, mismatch]
        return Flags(torch.tensor(values, dtype=torch.int64))

    @property
    def failed(self) -> bool:
        return bool(int(self.values[0]))

    @property
    def joins(self) -> int:
        return int(self.values[1])

    @property
    def error_at(self) -> int | None:
        """The coordinate of this replica whose step raised, if one did."""
        error = int(self.values[2])
        return None if error == 0 else error - 1

    @property
    def unmovable_at(self) -> int | None:
        """The coordinate whose source could not pack its state, if one could not."""
        unmovable = int(self.values[3])
        return None if unmovable == 0 else unmovable - 1

    @property
    def mismatch_at(self) -> int | None:
        """The coordinate of this replica whose state did not fit the source's, if one."""
        mismatch = int(self.values[4])
        return None if mismatch == 0 else mismatch - 1


def verdict_error(
    flags: Flags, origin: BaseException | None, replica: int, source: int, where: str
) -> Exception | None:
    """What every rank of ``replica`` raises after a verdict (``flags``) in ``where``, or
    None: a source that could not pack its state stops every member (:class:`StepError`);
    a state that does not fit this replica's tensors is a program error
    (:class:`JobMismatchError`: a restart will not help); any other exception raised
    on a rank of it makes it leave (:class:`StepError`: restart it to rejoin).
    ``origin`` is what this rank raised, if it raised.

    >>> print(verdict_error(Flags.of(False, 0, 1, None, 1), None, 2, 0, "a step"))
    replica 2 coordinate 1's registered state does not fit the state it received in a step (its own JobMismatchError names the tensor and both shapes); this replica left the job, and a restart will not help
    >>> verdict_error(Flags.of(True, 0, None), None, 2, 0, "a step") is None
    True
    """
    unmovable, at, mismatch = flags.unmovable_at, flags.error_at, flags.mismatch_at
    if unmovable is None and at is None:
        return None
    if unmovable is None and mismatch is not None:  # a program error: no restart
        if isinstance(origin, JobMismatchError):
            return JobMismatchError(
                f"replica {replica} coordinate {mismatch}, in {where}: {origin}; this "
                f"replica left the job (the others go on without it)"
            )
        return JobMismatchError(
            f"replica {replica} coordinate {mismatch}'s registered state does not fit "
            f"the state it received in {where} (its own JobMismatchError names the tensor "
            f"and both shapes); this replica left the job, and a restart will not help"
        )
    raised = "" if origin is None else f": {type(origin).__name__}: {origin}"
    if unmovable is not None:
        return StepError(
            f"replica {source} coordinate {unmovable} (the source) could not pack its "
            f"registered state in {where}{raised}; no replica can take the job's state from "
            f"it, so every member stops: fix the state and restart from a checkpoint"
        )
    return StepError(
        f"replica {replica} coordinate {at} raised in {where}"
        f"{raised or ' (its own StepError names the exception)'}; the step failed on "
        f"every member, and this replica left the job (restart it to rejoin)"
    )
