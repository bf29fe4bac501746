"""NCCL's side of healing: abort a mesh's communicators, form healed groups unsplit, check the watchdog.

The one module that touches NCCL's internals in torch. A liveness watch that
learns of a death aborts its mesh (:meth:`GroupTable.abort
<scopedmesh.mesh.group_table.GroupTable.abort>`); for a gloo group that is
:class:`~scopedmesh.c10d.closable.ClosableGroup.interrupt`, for every other
group it is :func:`abort_groups`: ``ProcessGroup.abort()`` on each, all inside
one NCCL group call (``ncclGroupStart`` ... ``ncclGroupEnd``, as torch's own
``_abort_process_group`` does for WORLD), so that aborting one communicator
never waits for another's kernels. What a collective in flight then reports
is NCCL's, not ours: its kernel exits early, and ``wait()`` and
``torch.cuda.synchronize()`` may return normally over whatever the cut left in
the buffer (the work handle is torch's, not wrapped as a gloo group's is). So
the abort is a state to read, not an error to wait for: ``LivenessWatch.step``
synchronises, reads the mesh's abort state and votes, and a step an abort
touched never counts (docs/step.md).

A healed mesh's groups must not derive from a communicator that holds a lost
rank. With WORLD bound to a device (``init_process_group(device_id=...)``)
torch's group helper splits every new NCCL communicator from WORLD's, which
holds the dead rank, and the split fails with ``ncclRemoteError``.
:func:`unsplit` hides WORLD's device from the helper for one construction, so
the group forms by its own ``ncclCommInitRank`` over the store.

torch's NCCL watchdog ends the process some 60 s after it saw an error
(``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3, 3 the default), even once the
survivor has healed. :func:`check_error_handling` says, before any group is
made, whether this process is set up so that a healed survivor lives on.

>>> error_handling_problem("gloo", {}) is None
True
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "ASYNC_ERROR_HANDLING",
    "abort_groups",
    "aborts",
    "check_error_handling",
    "error_handling_problem",
    "join_within",
    "nccl_flavour",
    "needs_abort",
    "unsplit",
]

# torch reads the first name and, when it is unset, the deprecated second one
# (c10d's getCvarInt walks the list from the last name to the first, so the first wins).
ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
_DEFAULT_MODE = 3  # SkipCleanUp: the watchdog ends the process, torch >= 2.2
_SURVIVABLE_MODES = frozenset({0, 2})  # NoHandling, CleanUpOnly: the process lives on
USE_NCCL2 = "TORCH_DIST_USE_NCCL2"
# The backend names whose communicators are NCCL's, and how "nccl" resolves.
_STOCK_NAMES = frozenset({"nccl-legacy"})
_NCCL2_NAMES = frozenset({"nccl2", "nccl-lazy"})
_NCCL2_DEFAULT_FROM = (2, 15)  # "nccl" means nccl2 unless TORCH_DIST_USE_NCCL2=0


def needs_abort(group: dist.ProcessGroup) -> bool:
    """Whether aborting ``group`` must reach torch's ``ProcessGroup.abort()``
    (:func:`aborts`, from torch's record of its backend); never WORLD, not the mesh's."""
    if group is c10d.GroupMember.WORLD:
        return False
    config = c10d._world.pg_backend_config.get(group)
    return aborts(str(config) if config is not None else str(group.name()))


def aborts(backend: str) -> bool:
    """Whether a group on ``backend`` is aborted through ``ProcessGroup.abort()``.

    Every backend but plain gloo, whose ``abort`` does nothing (a mesh's gloo
    groups are closable and interrupted instead). A mixed group is aborted:
    ``abort`` reaches each of its backends, NCCL's included.

    >>> aborts("gloo"), aborts("cpu:gloo"), aborts("cpu:gloo,cuda:nccl"), aborts("nccl")
    (False, False, True, True)
    """
    return set(_parts(backend)) != {"gloo"}


def _group_call(groups: Sequence[dist.ProcessGroup]) -> Any | None:
    """A backend of ``groups`` that opens one NCCL group call (stock ``ProcessGroupNCCL``).

    ``_group_start`` / ``_group_end`` call ``ncclGroupStart`` / ``ncclGroupEnd``,
    which are per thread in NCCL, so one backend's pair brackets every abort
    made on this thread. ``None`` where none of the groups has one (nccl2,
    which torch aborts one by one).
    """
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError, ValueError):
            continue
        if callable(getattr(backend, "_group_start", None)) and callable(
            getattr(backend, "_group_end", None)
        ):
            return backend
    return None


def abort_groups(groups: Sequence[dist.ProcessGroup]) -> list[Exception]:
    """Abort every group of ``groups`` that :func:`needs_abort`, in one NCCL group call.

    Safe from any thread (a liveness watch's): it takes no lock and waits for
    no collective. NCCL makes the kernels in flight on an aborted communicator
    exit, and the collective (its ``wait()``, a CUDA synchronize on its
    stream) raises. A group already destroyed is skipped. A failure does not
    stop the others: the failures are returned, first first (a group destroyed
    meanwhile, by a close on another thread, is not a failure).
    """
    targets = [group for group in groups if group in c10d._world.pg_map and needs_abort(group)]
    if not targets:
        return []
    errors: list[Exception] = []
    batch = _group_call(targets)
    if batch is not None:
        batch._group_start()
    try:
        for group in targets:
            try:
                group.abort()
            except Exception as error:  # keep going: the others must still be aborted
                if group in c10d._world.pg_map:  # destroyed meanwhile (a close): nothing lost
                    errors.append(error)
    finally:
        if batch is not None:
            batch._group_end()
    return errors


def join_within(threads: Sequence[threading.Thread], timeout: float) -> list[threading.Thread]:
    """Wait up to ``timeout`` seconds in all for ``threads`` (an abort's or a destroy's,
    started so that a heal never waits for NCCL); those still running then, in order."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


@contextlib.contextmanager
def unsplit() -> Iterator[None]:
    """Inside, torch's group helper splits no new communicator from WORLD's.

    torch decides to split when WORLD has a bound device
    (``_get_default_group().bound_device_id``); inside this block it has none,
    so a new NCCL group forms by its own init over the store. Hold the group
    table's lock around it: another thread's group formed meanwhile would not
    split either (slower, never wrong, unless that thread makes a group this
    rank is not a member of, which needs WORLD's split on every rank: meshes
    make their groups on their members only).

    >>> with unsplit():
    ...     pass
    """
    if not dist.is_initialized():
        yield
        return
    world = c10d._get_default_group()
    bound = world.bound_device_id
    if bound is None:
        yield
        return
    world.bound_device_id = None
    try:
        yield
    finally:
        world.bound_device_id = bound


def _parts(backend: str) -> list[str]:
    """The backend names in ``backend`` (``"cpu:gloo,cuda:nccl"`` -> ``["gloo", "nccl"]``)."""
    return [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]


def _release() -> tuple[int, int]:
    """torch's (major, minor)."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def nccl_flavour(environ: Mapping[str, str]) -> str:
    """What ``"nccl"`` builds here: ``"stock"`` (``ProcessGroupNCCL``) or ``"nccl2"``.

    torch 2.14 added ``nccl2`` (opt in with ``TORCH_DIST_USE_NCCL2=1``); 2.15
    made it the default (opt out with ``=0``). torch reads the variable once,
    when it registers ``"nccl"``; once registered, the registry says.

    >>> nccl_flavour({}) in ("stock", "nccl2")
    True
    """
    nccl2 = getattr(c10d, "_create_nccl2_process_group", None)
    if nccl2 is None:  # torch <= 2.13: only the stock backend
        return "stock"
    plugin = getattr(dist.Backend, "_plugins", {}).get("NCCL")
    if plugin is not None:
        return "nccl2" if getattr(plugin, "creator_fn", None) is nccl2 else "stock"
    chosen = environ.get(USE_NCCL2)
    if _release() >= _NCCL2_DEFAULT_FROM:
        return "stock" if chosen == "0" else "nccl2"
    return "nccl2" if chosen == "1" else "stock"


def _async_mode(environ: Mapping[str, str]) -> tuple[str, int]:
    """The variable torch reads for its error handling and the mode it reads (3 if unset)."""
    for name in ASYNC_ERROR_HANDLING:
        value = environ.get(name)
        if value is not None:
            try:
                return name, int(value.strip())
            except ValueError:  # torch warns and keeps its default
                return name, _DEFAULT_MODE
    return ASYNC_ERROR_HANDLING[0], _DEFAULT_MODE


def error_handling_problem(backend: str, environ: Mapping[str, str]) -> str | None:
    """Why torch's watchdog would end a healed survivor on ``backend``, or None.

    Only stock ``ProcessGroupNCCL`` has that watchdog rule: with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3 (3 is the default) it rethrows
    the communicator's error about 60 s after seeing it and the process ends.
    0 (no handling) and 2 (clean up only) let the process live on.

    >>> env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    >>> print(error_handling_problem("nccl-legacy", env))  # doctest: +ELLIPSIS
    TORCH_NCCL_ASYNC_ERROR_HANDLING is 1: torch's NCCL watchdog ends this process ...
    >>> error_handling_problem("cuda:nccl-legacy", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) is None
    True
    """
    stock = False
    for name in _parts(backend):
        if name in _STOCK_NAMES or (name == "nccl" and nccl_flavour(environ) == "stock"):
            stock = True
    if not stock:
        return None
    variable, mode = _async_mode(environ)
    if mode in _SURVIVABLE_MODES:
        return None
    shown_value = environ.get(variable, f"unset (torch's default, {_DEFAULT_MODE})")
    return (
        f"{variable} is {shown_value}: torch's NCCL watchdog ends this process about 60 s "
        "after a peer's death, even once the survivor has healed. Set "
        f"{ASYNC_ERROR_HANDLING[0]}=2 (or 0) in the environment of every rank before the "
        "first NCCL group is made (in the launcher, before init_process_group)"
    )


def check_error_handling(backend: str | None, environ: Mapping[str, str]) -> None:
    """Refuse, with ``RuntimeError``, a watch over ``backend`` that torch would end.

    Call it when a liveness watch starts guarding a mesh (``backend`` is the
    mesh's, None: gloo); the variable is never changed here, because torch
    read it when it made the groups that exist already.

    >>> check_error_handling("gloo", {})
    >>> check_error_handling("nccl-legacy", {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: cannot guard a mesh on 'nccl-legacy': TORCH_NCCL_ASYNC_ERROR_HANDLING is unset ...
    """
    if backend is None:
        return
    problem = error_handling_problem(backend, environ)
    if problem is not None:
        raise RuntimeError(f"cannot guard a mesh on {backend!r}: {problem}")
