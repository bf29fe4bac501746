"""One verdict per step: a training step on a guarded mesh counts on every member or on none.

:meth:`LivenessWatch.step <scopedmesh.fault.liveness.watch.LivenessWatch.step>`
gives a :class:`Step`, a context manager around one step's collectives, as
torchft's ``should_commit`` is for its replicas::

    while i < steps:
        with watch.step(mesh, "dp") as step:
            grad = train_step(step.mesh, weights, i)
        mesh = step.mesh                     # re-formed if the step failed
        if step.committed:
            weights -= lr * grad; i += 1     # else: redo step i on the re-formed mesh

How the verdict is reached, at the block's end, on each member:

1. **Its own view.** The step failed here if the block raised, or if the
   mesh was aborted at any moment since the block began (a death the watch
   learned). On CUDA the device is synchronised first, so a collective that
   an abort cut short, which on NCCL looks done, is seen as the abort it was.
2. **The vote.** One ``all_reduce`` (MAX) of that flag over a gloo group of
   all the mesh's ranks. Completed, with no abort since: the step committed
   (all flags 0) or failed (one was not) on every member, alike.
3. **Doubt.** A member whose vote did not complete (a death cut it short)
   cannot know whether a peer's vote did. It asks every member to answer: each
   member's watch checks in for its rank with its count of committed steps,
   from the watch's own thread, so nobody waits for a peer's compute (an
   answer fences that attempt there: its vote no longer commits). The
   survivors agree through the store; a member in doubt whose flag was 0
   commits if any survivor committed the step (then every flag was 0), and
   fails it otherwise. A failed step's mesh is then re-formed along ``axis``
   around the lost ranks and guarded, on every member.
4. **Committed in doubt.** A member in doubt that commits keeps its mesh, as
   the members whose vote completed do (they learn of the death only after
   their step): its next step on that mesh fails at once, and is re-formed, as
   theirs does. So every member re-forms a mesh after the same step, and the
   meshes of one watch request their groups in the same order on every member.

A member whose block raised posts a *stop* through the watch and aborts the
mesh (a ``RuntimeError``, a collective's error, first waits up to
:data:`STOP_GRACE` for the watch to learn of a death behind it), so every
member's collectives with it fail at once instead of waiting for their
timeout (on NCCL too): every member then agrees, re-forms the mesh (with no
rank lost, the same shape), and the exception is raised on the member that
raised it, after the others know. A ``RuntimeError`` (what a collective
raises when a peer fails) is the step's failure, kept on ``error`` and not
raised, unless the step raised it here in two attempts in a row with nobody
lost and this rank stopped the step first (a bug, which would otherwise be
redone for ever). A member the agreement lost that *left* (its watch closed
after an exception) fails the step everywhere with a ``StepError`` naming its
exception. The rules are :mod:`scopedmesh.fault.protocol.verdict`'s.

>>> Step.__name__
'Step'
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import torch
import torch.distributed as dist

from scopedmesh.errors import StepError
from scopedmesh.fault.protocol.verdict import NONE, OTHER, RUNTIME, STOP_GRACE, Verdict
from scopedmesh.layout import Axis
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["STOP_GRACE", "Step", "StepWatch"]


class StepWatch(Protocol):
    """What a :class:`Step` needs of its liveness watch."""

    rank: int

    def _reformed(
        self, mesh: ProcessGroupMesh, lost: frozenset[int], axis: Axis
    ) -> ProcessGroupMesh: ...

    def _defer_reform(self, mesh: ProcessGroupMesh, lost: frozenset[int]) -> None: ...

    def _deferred_reform(self, mesh: ProcessGroupMesh) -> frozenset[int] | None: ...

    def _verdict(
        self,
        mesh: ProcessGroupMesh,
        raised: str,
        can_vote: bool,
        vote: Callable[[int], int | None],
    ) -> Verdict: ...


class Step:
    """One step on a guarded mesh and its verdict; made by ``LivenessWatch.step``.

    After the block: ``committed`` (the same on every member that goes on),
    ``mesh`` (the mesh to train on next), ``lost`` (the ranks the step lost,
    agreed on; empty when it committed or failed without a death), ``healed``
    (whether ``mesh`` was re-formed) and ``error`` (what the block raised on
    this rank, kept where the step's failure took its place).
    """

    def __init__(self, watch: StepWatch, mesh: ProcessGroupMesh, axis: Axis) -> None:
        self._watch, self.mesh, self._axis = watch, mesh, axis
        self.committed: bool | None = None  # None until the block ends
        self.error: BaseException | None = None  # what the block raised here, if anything
        self.lost: frozenset[int] = frozenset()
        self.healed = False
        self._vote_group: dist.ProcessGroup | None = None

    def __enter__(self) -> Step:
        if self.committed is not None:
            raise RuntimeError("a Step runs once; ask the watch for a new one (watch.step)")
        try:  # formed before the step's collectives, in the same order on every member
            self._vote_group = self.mesh.get_group_along_axis(
                tuple(range(len(self.mesh.shape))), backend=_vote_backend(self.mesh)
            )
        except RuntimeError:  # aborted already (MeshClosedError), or a peer died forming it
            self._vote_group = None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        mesh, watch = self.mesh, self._watch
        self.error = exc
        if exc is not None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not a step's failure
        raised = NONE if exc is None else RUNTIME if isinstance(exc, RuntimeError) else OTHER
        deferred = watch._deferred_reform(mesh)
        if deferred is not None:  # it committed the last step in doubt: this one fails
            self.committed, self.lost = False, deferred
            self.mesh = watch._reformed(mesh, deferred, self._axis)
            self.healed = True
            return raised != OTHER  # this rank's own error is raised, as after a vote
        if raised == NONE and not _synchronized() and not mesh.aborted:
            mesh.abort(f"when rank {watch.rank}'s device failed to synchronise")
        verdict = watch._verdict(mesh, raised, self._vote_group is not None, self._vote)
        self.committed = verdict.committed
        if not verdict.agreed:
            return False  # decided by the vote; an exception of this rank's step is raised
        if verdict.error is not None:  # the job fails: a peer left it after an exception
            raise StepError(f"rank {watch.rank}'s step failed: {verdict.error}") from exc
        if not verdict.reforms:  # in doubt, and a peer committed: re-formed after the next step
            watch._defer_reform(mesh, verdict.lost)
            return True
        self.lost = verdict.lost
        self.mesh = watch._reformed(mesh, self.lost, self._axis)
        self.healed = True
        if verdict.raise_own:
            return False  # this rank's own error: raised here, once every member knows
        return True

    def _vote(self, flag: int) -> int | None:
        """The MAX of every member's flag, or None where the vote did not complete here."""
        if self._vote_group is None:
            return None
        vote = torch.tensor([flag], dtype=torch.int64)
        try:
            work = dist.all_reduce(
                vote, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True
            )
            # Left as soon as the mesh is aborted: a vote blocked on a dead peer would end
            # only as the failure spreads from group to group, one watch interval a hop.
            pause = 0.00005
            while work is not None and not work.is_completed():
                if self.mesh.aborted:
                    return None
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
            if work is not None:
                work.wait()
        except RuntimeError:  # cut short by an abort, a peer's death or a peer's stop
            return None
        return int(vote.item())

    def __repr__(self) -> str:
        verdict = {None: "running", True: "committed", False: "failed"}[self.committed]
        return f"<Step on {self.mesh!r}: {verdict}>"


def _vote_backend(mesh: ProcessGroupMesh) -> str | None:
    """The backend of the vote's group: the mesh's own where it has gloo, else gloo."""
    chosen = mesh.backend or dist.get_backend()
    return None if "gloo" in str(chosen) else "gloo"


def _synchronized() -> bool:
    """Wait for this process's CUDA work, so that an abort that cut a kernel short is known
    before the mesh's state is read; False where that wait raised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return True
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return False
    return True
