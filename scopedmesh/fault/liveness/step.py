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
   cannot know whether a peer's vote did. The survivors then agree through the
   store (the watch's agreement), each carrying its count of committed steps;
   a member in doubt whose flag was 0 commits if any survivor committed the
   step (then every flag was 0), and fails it otherwise. The mesh is then
   re-formed along ``axis`` around the lost ranks and guarded.

A member whose block raised posts a *stop* through the watch and aborts the
mesh (a ``RuntimeError``, a collective's error, first waits up to
:data:`STOP_GRACE` for the watch to learn of a death behind it), so every member's collectives with it fail at once instead of waiting
for their timeout (on NCCL too): every member then agrees, re-forms the mesh
(with no rank lost, the same shape), and the exception is raised on the member
that raised it, after the others know. A ``RuntimeError`` (what a collective
raises when a peer fails) is the step's failure, kept on ``error`` and not
raised, unless it is this member's own twice over: it stopped the step first,
with nobody lost, in two attempts of the same step in a row (a bug, which
would otherwise be redone for ever). Any other exception is raised where it
happened, once the step's verdict is known everywhere.

>>> Step.__name__
'Step'
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Protocol

import torch
import torch.distributed as dist

from scopedmesh.fault.heal import reform
from scopedmesh.layout import Axis
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["STOP_GRACE", "Step", "StepWatch"]

_OK, _FAILED = 0, 1  # a member's flag in the vote
STOP_GRACE = 0.25  # seconds a collective's error waits for the watch to learn of a death


class StepWatch(Protocol):
    """What a :class:`Step` needs of its liveness watch."""

    rank: int
    committed: int

    def guard(self, mesh: ProcessGroupMesh) -> ProcessGroupMesh: ...

    def _agree_on_step(self, mesh: ProcessGroupMesh) -> tuple[frozenset[int], int]: ...

    _events: int
    _first_stopped: int | None

    def _post_stop(self, attempt: int) -> None: ...

    def _first_stop(self, attempt: int) -> int | None: ...


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
        attempt = watch._events  # the same on every member: each failed step agrees once
        if isinstance(exc, RuntimeError):  # a collective's error: is a death behind it?
            _await_abort(mesh, STOP_GRACE)
        if (exc is not None or self._vote_group is None) and not mesh.aborted:
            # Maybe its first cause, or a rank that cannot vote: tell every member, before
            # this rank's sockets close (so its stop is first), and never leave them waiting.
            watch._post_stop(attempt)
            why = (
                "could not form the step's vote" if exc is None else f"raised {type(exc).__name__}"
            )
            mesh.abort(f"when rank {watch.rank}'s step {why}")
        flag = _FAILED if exc is not None or not _synchronized() or mesh.aborted else _OK
        outcome = self._vote(flag)
        if outcome is not None and not mesh.aborted:  # decided alike on every member
            self.committed = outcome == _OK
            watch.committed += int(self.committed)
            return False  # an exception of this rank's step is raised, after the vote
        mine = watch.committed
        self.lost, highest = watch._agree_on_step(mesh)
        if highest > mine + 1 or (highest == mine + 1 and flag != _OK):
            raise RuntimeError(  # the vote's rule makes this impossible; never go on from it
                f"rank {watch.rank}: the members' counts of committed steps ({highest} against "
                f"{mine} here, whose flag was {flag}) break the step's vote"
            )
        self.committed = highest == mine + 1  # a peer committed: every flag was 0
        watch.committed = highest
        self.mesh = watch.guard(reform(mesh, self.lost, self._axis))
        self.healed = True
        if exc is None:
            return True
        if not isinstance(exc, RuntimeError):
            return False  # not a collective's failure: this rank's own, raised here
        # A collective's error is the step's failure. Raised only where it is this rank's
        # own twice over: it stopped this step first, with nobody lost, in two attempts in a
        # row (a peer's error that a stop or an abort explains does not repeat so).
        first = not self.lost and watch._first_stop(attempt) == watch.rank
        again = first and watch._first_stopped == mine
        watch._first_stopped = mine if first else None
        return not again

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


def _await_abort(mesh: ProcessGroupMesh, seconds: float) -> None:
    """Wait up to ``seconds`` for ``mesh`` to be aborted (the watch learning of a death)."""
    deadline = time.monotonic() + seconds
    while not mesh.aborted and time.monotonic() < deadline:
        time.sleep(0.005)


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
