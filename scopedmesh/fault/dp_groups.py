"""An epoch's cross-replica (dp) group, on gloo or NCCL: formed by its own init over the
epoch's store, waited on so that a dead or departed peer never holds a member.

:class:`~scopedmesh.fault.replicas.Replicas` forms one dp group per epoch and
coordinate, outside every WORLD, under the epoch's prefix in the job's store
(``ReplicaKeys.group``). Never split from another communicator: the last
epoch's may hold a dead rank, and a split from it fails (``ncclRemoteError``,
docs/GPU.md), so each epoch's group connects afresh over its own keys.

- **gloo** (the default): ``ProcessGroupGloo`` over the prefix, as before. A
  peer that dies or drops the group closes its connections, and every
  operation waiting on it raises at once.
- **nccl**: ``ProcessGroupNCCL`` over the prefix (``eager_connect_single_device``
  on a helper thread, bounded by ``form_timeout``), wrapped in a
  :class:`DeviceGroup`. On NCCL a dead peer fails nothing: the kernel waits
  for it. So every wait polls the operation's completion, and once it has
  taken :data:`CHECK_AFTER` seconds checks, every :data:`CHECK_EVERY`
  seconds, whether a peer of the epoch is dead (its listener refuses, as the
  heal's probe) or left the epoch after a failure (its check-in key); then it
  aborts the communicator and raises
  :class:`~scopedmesh.fault.state_transfer.CollectiveFailed`, as gloo would.
  A step whose collectives end within :data:`CHECK_AFTER` costs no probe and
  no store request. Tensors on the group's CUDA device (gradients,
  parameters, optimizer state) go to NCCL as they are; a CPU tensor (the
  verdict's flags, the state header, an optimizer's CPU ``step``) is staged
  through a device copy.

>>> check_backend("gloo"), check_backend("GLOO")
('gloo', 'gloo')
>>> check_backend("mpi")
Traceback (most recent call last):
...
ValueError: backend must be 'gloo' or 'nccl' (the cross-replica groups' backend), got 'mpi'
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.c10d.nccl import error_handling_problem
from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.errors import shown
from scopedmesh.fault.probes import PROBE_EVERY, SlotProbes
from scopedmesh.fault.protocol.membership import Decision
from scopedmesh.fault.state_transfer import CollectiveFailed

__all__ = [
    "BACKENDS",
    "CHECK_AFTER",
    "CHECK_EVERY",
    "DeviceGroup",
    "Drops",
    "catch_up_peers",
    "check_backend",
    "departures",
    "form_group",
    "nccl_device",
]

BACKENDS = ("gloo", "nccl")
CHECK_AFTER = PROBE_EVERY  # seconds an NCCL operation may take before its peers are checked
CHECK_EVERY = PROBE_EVERY  # seconds between two checks of the peers while it still waits
_SPIN_MAX = 0.002  # seconds: the longest sleep between two completion polls


def check_backend(backend: object) -> str:
    """``backend`` (``Replicas``' keyword) checked: ``"gloo"`` or ``"nccl"``, lower case.

    NCCL needs a torch built with it and a CUDA device, and torch's watchdog
    must not end a survivor whose communicator was aborted
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, docs/GPU.md): else a ``ValueError``
    or ``RuntimeError`` that says which.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, 'gloo' or 'nccl', got {shown(backend)}")
    name = backend.strip().lower()
    if name not in BACKENDS:
        raise ValueError(
            f"backend must be 'gloo' or 'nccl' (the cross-replica groups' backend), "
            f"got {shown(backend)}"
        )
    if name == "nccl":
        if getattr(dist, "ProcessGroupNCCL", None) is None or not dist.is_nccl_available():
            raise ValueError(
                "backend='nccl' needs a torch built with NCCL; this one has none "
                "(torch.distributed.is_nccl_available() is False): use backend='gloo'"
            )
        nccl_device()  # a CUDA device is visible
        problem = error_handling_problem("nccl-legacy", os.environ)  # what form_group builds
        if problem is not None:
            raise RuntimeError(f"Replicas(backend='nccl'): {problem}")
    return name


def nccl_device() -> torch.device:
    """The CUDA device an NCCL dp group takes tensors on: this process's current one
    (``torch.cuda.set_device`` before ``Replicas``, as for any NCCL group)."""
    if not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs a CUDA device; torch sees none here")
    return torch.device("cuda", torch.cuda.current_device())


def departures(
    probes: SlotProbes,
    store: Any,
    keys: ReplicaKeys,
    decision: Decision,
    replica: int,
    coordinate: int,
) -> Callable[[], str | None]:
    """What a wait on ``decision``'s dp group along ``coordinate`` asks: why a peer will
    never take part (dead: its listener refuses; or it checked in to heal), or None."""
    peers = [r for r in decision.replicas if r != replica]
    epoch = decision.epoch

    def check() -> str | None:
        dead = [r for r in peers if probes.dead(r, coordinate, decision.token(r))]
        if dead:
            return f"replicas {dead} (coordinate {coordinate}) of epoch {epoch} died"
        left = [r for r in peers if read(store, keys.checked_in(epoch, r, coordinate)) is not None]
        if left:
            return f"replicas {left} (coordinate {coordinate}) left epoch {epoch} to heal"
        return None

    return check


class DeviceGroup:
    """An NCCL dp group that the replicas' code uses as it uses a gloo one (``allreduce``,
    ``broadcast``, ``send``, ``recv``; each returns a handle whose ``wait`` raises
    :class:`CollectiveFailed` on a failure), with the NCCL semantics handled here: the
    waits watch the peers (``departed``), a failure aborts the communicator, and CPU
    tensors are staged on ``wire_device``. The abort runs on a thread of its own,
    kept in ``aborts`` (:func:`~scopedmesh.c10d.nccl.join_within` waits for them)."""

    def __init__(
        self,
        pg: Any,
        device: torch.device,
        departed: Callable[[], str | None],
        timeout: float,
        *,
        aborts: list[threading.Thread] | None = None,
    ) -> None:
        self.pg, self.wire_device = pg, device
        self.departed, self._timeout = departed, timeout
        self.aborted = False
        self.aborts: list[threading.Thread] = [] if aborts is None else aborts

    def allreduce(self, tensors: Sequence[torch.Tensor], options: Any = None) -> _Handle:
        staged, back = self._stage(tensors, copy_in=True)
        options = dist.AllreduceOptions() if options is None else options  # a sum
        return self._issue("an all-reduce", lambda: self.pg.allreduce(staged, options), back)

    def broadcast(self, tensors: Sequence[torch.Tensor], options: Any) -> _Handle:
        staged, back = self._stage(tensors, copy_in=True)
        return self._issue("a broadcast", lambda: self.pg.broadcast(staged, options), back)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> _Handle:
        staged, _ = self._stage(tensors, copy_in=True)
        return self._issue(f"a send to {peer}", lambda: self.pg.send(staged, peer, tag), [])

    def recv(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> _Handle:
        staged, back = self._stage(tensors, copy_in=False)
        return self._issue(f"a receive from {peer}", lambda: self.pg.recv(staged, peer, tag), back)

    def abort(self) -> None:
        """Abort the communicator (once): its kernels in flight exit, its peers' never
        complete (they find this rank departed or dead, and abort in turn).

        NCCL's abort runs on a thread of its own (``scopedmesh-replicas-nccl-abort``,
        not a daemon), and this returns at once: on an H200 ``abort()`` took 0.5 s,
        while the kernels in flight exited within 6 ms of its start and other
        communicators went on meanwhile (docs/GPU.md). The thread holds the
        communicator, so it is destroyed there, after its abort, never during it.
        """
        if not self.aborted:
            self.aborted = True
            thread = threading.Thread(target=self.pg.abort, name="scopedmesh-replicas-nccl-abort")
            self.aborts[:] = [t for t in self.aborts if t.is_alive()] + [thread]
            thread.start()

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (``what``, for the error): its completion polled, the peers
        checked once it has taken :data:`CHECK_AFTER` s, never past the group's timeout."""
        start = time.monotonic()
        check, pause = start + CHECK_AFTER, 0.00002
        while not work.is_completed():
            now = time.monotonic()
            if now >= check:
                why = self.departed()
                if why is not None:
                    self.abort()
                    raise CollectiveFailed(f"{what} on the epoch's NCCL group: {why}")
                check = now + CHECK_EVERY
            if now - start >= self._timeout:
                self.abort()
                raise CollectiveFailed(
                    f"waited {self._timeout:g} s for {what} on the epoch's NCCL group"
                )
            time.sleep(pause)
            pause = min(2 * pause, _SPIN_MAX)
        if self.aborted:  # a collective an abort cut short looks done on NCCL: it failed
            raise CollectiveFailed(f"{what} on the epoch's NCCL group, which was aborted")
        try:
            work.wait()  # the current stream waits for NCCL's; raises if torch saw an error
        except Exception as error:
            self.abort()
            raise CollectiveFailed(f"{what} on the epoch's NCCL group: {error}") from error

    def _stage(
        self, tensors: Sequence[torch.Tensor], copy_in: bool
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The tensors NCCL takes: each on the group's device as it is, else a device copy
        (``copy_in``: with its values); the (original, copy) pairs to copy back."""
        staged, back = [], []
        for tensor in tensors:
            if tensor.device == self.wire_device:
                staged.append(tensor)
                continue
            copy = (
                tensor.to(self.wire_device)
                if copy_in
                else torch.empty_like(tensor, device=self.wire_device)
            )
            staged.append(copy)
            back.append((tensor, copy))
        return staged, back

    def _issue(
        self,
        what: str,
        call: Callable[[], Any],
        back: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> _Handle:
        if self.aborted:
            raise CollectiveFailed(f"{what} on the epoch's NCCL group, which was aborted")
        try:
            work = call()
        except Exception as error:
            self.abort()
            raise CollectiveFailed(f"{what} on the epoch's NCCL group: {error}") from error
        return _Handle(self, work, what, back)


class _Handle:
    """One operation of a :class:`DeviceGroup`: ``wait()`` as :meth:`DeviceGroup.wait`,
    then the staged results copied back into the caller's tensors."""

    def __init__(
        self,
        group: DeviceGroup,
        work: Any,
        what: str,
        back: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self._group, self._work, self._what, self._back = group, work, what, back

    def wait(self) -> bool:
        self._group.wait(self._work, self._what)
        for original, copy in self._back:
            original.copy_(copy)
        self._back = []
        return True


def catch_up_peers(decision: Decision, replica: int) -> list[int]:
    """The dp ranks ``replica`` exchanges state with point to point in ``decision``'s
    catch-up: the source sends to each fresh joiner, a fresh joiner receives from it.

    >>> d = Decision(5, ((0, "a"), (1, "b"), (2, "c")), source=0, joins=4, fresh=(2,))
    >>> catch_up_peers(d, 0), catch_up_peers(d, 1), catch_up_peers(d, 2)
    ([2], [], [0])
    """
    if replica == decision.source:
        return [decision.index(r) for r in decision.fresh]
    if replica in decision.fresh:
        return [decision.index(decision.source)]
    return []


def form_group(
    backend: str,
    store: Any,
    keys: ReplicaKeys,
    probes: SlotProbes,
    decision: Decision,
    replica: int,
    coordinate: int,
    *,
    form_timeout: float,
    timeout: float,
    aborts: list[threading.Thread] | None = None,
) -> Any | None:
    """``replica``'s dp group of ``decision`` along ``coordinate``, formed by its own init
    over ``store`` under the epoch's prefix; None if it could not form (a peer died or
    left: heal). On NCCL the communicators the epoch will use are all connected here:
    the group's, and the catch-up's pairs (:func:`catch_up_peers`); its aborts' threads
    go to ``aborts`` (:class:`DeviceGroup`)."""
    prefixed = dist.PrefixStore(keys.group(decision.epoch, coordinate), store)  # type: ignore[attr-defined]  # public; not in torch's stub exports
    index, size = decision.index(replica), decision.size
    if backend == "gloo":
        try:
            gloo = dist.ProcessGroupGloo(prefixed, index, size, timedelta(seconds=form_timeout))
        except RuntimeError:
            return None
        gloo.set_timeout(timedelta(seconds=timeout))
        return gloo
    device = nccl_device()
    departed = departures(probes, store, keys, decision, replica, coordinate)
    # torch's defaults (its watchdog's timeout is 10 min: the waits here end sooner).
    nccl = dist.ProcessGroupNCCL(prefixed, index, size, dist.ProcessGroupNCCL.Options())
    group = DeviceGroup(nccl, device, departed, timeout, aborts=aborts)
    peers = catch_up_peers(decision, replica)
    return group if _connect(group, form_timeout, peers, replica == decision.source) else None


def _connect(group: DeviceGroup, form_timeout: float, peers: list[int], source: bool) -> bool:
    """Connect ``group``'s communicators now, on a helper thread: its own
    (``eager_connect_single_device``), then, by one byte each way from the ``source``
    to each of ``peers``, the pairs torch's point-to-point operations use. A dead or
    departed peer, or ``form_timeout``, aborts the group (False).

    Lazily, NCCL would connect inside the epoch's first collective or the catch-up's
    first send, on the loop's thread, where nothing could stop a wait for a dead
    peer; at an admission this runs while the survivors finish their step.
    """
    connect = getattr(group.pg, "eager_connect_single_device", None)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            if connect is not None:
                connect(group.wire_device)
            byte = torch.zeros(1, dtype=torch.uint8, device=group.wire_device)
            for peer in peers:  # the loop below watches the peers, and aborts
                work = group.pg.send([byte], peer, 0) if source else group.pg.recv([byte], peer, 0)
                while not work.is_completed():
                    time.sleep(_SPIN_MAX)
                if group.aborted:
                    raise CollectiveFailed(f"the first exchange with {peer} was aborted")
                work.wait()
            outcome.append(None)
        except BaseException as error:  # reported below, on the caller's thread
            outcome.append(error)

    thread = threading.Thread(target=run, name="scopedmesh-replicas-connect", daemon=True)
    thread.start()
    deadline = time.monotonic() + form_timeout
    while True:
        thread.join(CHECK_EVERY)
        if not thread.is_alive():
            break
        if group.departed() is not None or time.monotonic() >= deadline:
            group.abort()  # the helper's init ends with the communicator's abort
            return False
    if outcome and outcome[0] is None:
        return True
    group.abort()
    return False


class Drops:
    """Lets go of the last epoch's healthy, idle dp group on a helper thread.

    Destroying a gloo group takes about 30 ms (its threads and connections),
    an NCCL one its watchdog's end; at an admission that was a third of the
    survivors' stall. It overlaps the next epoch's formation and first
    all-reduce instead; :meth:`finish` waits for it after that all-reduce (it
    has ended by then), before the step's verdict. A failed group is never
    dropped this way: its peers must fail at once.
    """

    def __init__(self, what: str, timeout: float) -> None:
        self._what, self._timeout = what, timeout
        self._thread: threading.Thread | None = None

    def start(self, held: list[Any]) -> None:
        """Drop the group ``held`` holds (its last reference) in the background."""
        self.finish()
        self._thread = threading.Thread(
            target=held.clear, name="scopedmesh-replicas-drop", daemon=True
        )
        self._thread.start()

    def finish(self) -> None:
        """Wait for the drop, if one runs (bounded: a teardown that hangs is reported)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self._timeout)
            if thread.is_alive():
                raise TimeoutError(
                    f"{self._what}: waited {self._timeout:g} s for the last epoch's dp group "
                    f"to be destroyed"
                )
