"""Process groups through torch's private construction path: named, counted, destroyed.

Public ``new_group(..., use_local_synchronization=True)`` names a member-only
group by hashing its ranks (and, in torch 2.13, the number of groups alive in
the process). A destroyed group's name is free again, so a re-created group
reuses its store prefix and can read the old incarnation's stale gloo
rendezvous keys ("Connect timeout"), and two live groups over the same ranks
clash. Here each incarnation of a group gets its own name,

    scopedmesh-<sha1 of backend and ranks>-<generation>

where the generation is counted per rank in torch's distributed store
(:func:`~scopedmesh.c10d.store.generation_key`): members create the same groups
in the same order, so their counts agree without any collective. Building a group under a chosen name needs torch's private
``_new_process_group_helper``. If that is missing or changed, we fall back to
public ``new_group`` with a warning that names the hazard.

>>> group_name((0, 1), "gloo", 3)
'scopedmesh-40e50a5e73f9591580d9-3'
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from scopedmesh.c10d.barrier import all_formed
from scopedmesh.c10d.diagnosis import (
    DEFAULT_GRACE,
    SLICE,
    Liveness,
    Request,
    Stop,
    Subscribe,
    Watch,
    WatchedStore,
)
from scopedmesh.c10d.diagnosis import record_process as _record_process
from scopedmesh.c10d.names import RankMap, canonical_ranks, group_name
from scopedmesh.c10d.nccl import unsplit as _unsplit
from scopedmesh.c10d.store import (
    StoreUse,
    default_store,
    generation_key,
    gloo_connects_eagerly,
    incarnation_keys,
    own_keys,
)
from scopedmesh.errors import GroupFormationError, shown

__all__ = [
    "RankMap",
    "StoreUse",
    "canonical_ranks",
    "default_store",
    "destroy",
    "destroying",
    "group_name",
    "group_names",
    "incarnation_keys",
    "is_live",
    "keeps_member_order",
    "live_group_count",
    "live_groups",
    "new_member_group",
    "private_path_supported",
    "record_process",
    "unusable_backend",
]

# The helper's parameters that named group creation passes. The options parameter
# is called ``backend_options`` in torch 2.6 and later, ``pg_options`` in 2.4; both work.
_HELPER_PARAMETERS = (
    "group_size",
    "group_rank",
    "global_ranks_in_group",
    "backend",
    "store",
    "group_name",
    "timeout",
    "device_id",
    "group_desc",
)
_HELPER_OPTIONS = ("backend_options", "pg_options")
# Backends that need a CUDA device to construct a group at all.
_CUDA_BACKENDS = frozenset({"nccl"})
FALLBACK_WARNING = (
    "scopedmesh does not recognise this torch's process-group internals; it falls back to "
    "public new_group(use_local_synchronization=True). Re-creating a group over the same "
    "ranks (a mesh opened twice, a sub-mesh re-created, two meshes over the same ranks) may "
    "then fail with 'Gloo connectFullMesh failed ... Connect timeout' or 'The specified group "
    "name has already been created'."
)


def _helper_parameters() -> tuple[str, ...]:
    """The parameter names of torch's group-construction helper; empty if it is missing."""
    helper = getattr(c10d, "_new_process_group_helper", None)
    # torch wraps many c10d functions in functools.wraps loggers (_time_logger, ...):
    # judge the function underneath, not the wrapper's (*args, **kwargs).
    code = getattr(inspect.unwrap(helper), "__code__", None) if helper is not None else None
    if code is None:
        return ()
    return tuple(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])


def private_path_supported() -> bool:
    """Whether this torch has the internals that named group creation relies on."""
    world = getattr(c10d, "_world", None)
    if world is None or not hasattr(c10d, "_get_default_store"):
        return False
    if not all(hasattr(world, attr) for attr in ("pg_map", "pg_names", "pg_group_ranks")):
        return False
    parameters = _helper_parameters()
    return all(name in parameters for name in _HELPER_PARAMETERS) and any(
        name in parameters for name in _HELPER_OPTIONS
    )


def keeps_member_order() -> bool:
    """Whether groups form with their members in the order given (else ascending).

    torch's private helper takes ``global_ranks_in_group`` as it comes, so a
    group over ``[3, 1]`` has rank 3 as its group rank 0; public ``new_group``
    (the fallback) sorts them.
    """
    if not dist.is_initialized():
        return private_path_supported()
    default_pg = c10d._get_default_group()
    return private_path_supported() and not callable(getattr(default_pg, "new_group", None))


def unusable_backend(backend: str) -> str | None:
    """Why ``backend`` cannot construct a group on this host, or ``None`` if it can.

    A CUDA build of torch has NCCL compiled in, so ``is_backend_available("nccl")``
    says yes on a host without a GPU; the group would then fail inside torch's
    constructor. Ask before: that failure is about the host, not about the members.

    >>> unusable_backend("gloo") is None
    True
    """
    for part in backend.lower().split(","):
        name = part.split(":")[-1].strip()
        if name in _CUDA_BACKENDS and not torch.cuda.is_available():
            return f"{name!r} needs a CUDA device and this host has none visible to torch"
    return None


def _is_fake(backend: str) -> bool:
    """Whether ``backend`` is torch's fake backend: one process, no rendezvous, no counting store."""
    return backend.lower() == "fake"


def _next_generation(ranks: Sequence[int], backend: str) -> tuple[int, str]:
    """This rank's count of incarnations of the group, kept in the distributed store, and the
    incarnation's name (one hash of the ranks per formation)."""
    stem = group_name(ranks, backend, 0)[:-1]  # "scopedmesh-<digest>-"
    if _is_fake(backend):
        # The fake backend's FakeStore cannot count (its add raises up to torch 2.13 and
        # returns 1 from 2.14 on); nothing rendezvous there, so the first name free in
        # this process is safe.
        taken = set(c10d._world.pg_names.values())
        generation = 1
        while f"{stem}{generation}" in taken:
            generation += 1
        return generation, f"{stem}{generation}"
    generation = int(default_store().add(generation_key(ranks, backend, dist.get_rank()), 1))
    return generation, f"{stem}{generation}"


def _catch_up(ranks: Sequence[int], backend: str, generation: int) -> None:
    """After incarnation ``generation`` failed to form, move members one count behind up to it.

    A member that never asked (the usual cause of the failure) would otherwise
    count one fewer incarnation than this rank forever, so the group could never
    form again. compare_set moves only a member still at ``generation - 1``; one
    that asked meanwhile already counted it. Store requests only, no collective.
    """
    if _is_fake(backend):  # no counters to align
        return
    try:
        store = default_store()
        for member in ranks:
            counter = generation_key(ranks, backend, member)
            store.add(counter, 0)  # make the counter exist, so compare_set can see it
            store.compare_set(counter, str(generation - 1), str(generation))
    except RuntimeError:  # a store that cannot count (fake) or is gone: nothing to align
        pass


def new_member_group(
    ranks: Sequence[int],
    *,
    backend: str,
    timeout: timedelta | None,
    pg_options: object | None,
    description: str,
    what: str = "",
    grace: timedelta | None = None,
    liveness: Liveness | None = None,
    store_use: StoreUse | None = None,
    aborted: Callable[[], str] | None = None,
    on_abort: Subscribe | None = None,
    unsplit: bool = False,
) -> dist.ProcessGroup | None:
    """Make the group over ``ranks`` on its members only; ``None`` on other ranks.

    Group rank ``k`` is ``ranks[k]`` where :func:`keeps_member_order` (else the
    members ascend, as public ``new_group`` has them). The caller must be a
    member; non-members get ``None`` whatever torch's version returns for them
    (``None`` up to 2.13, ``GroupMember.NON_GROUP_MEMBER`` from 2.14). A backend
    that cannot run on this host (NCCL without a CUDA device) is a
    ``ValueError`` before any group is made.

    A gloo group's rendezvous is watched (:mod:`scopedmesh.c10d.diagnosis`):
    past ``grace`` (default 0.5 s) a member announces what it waits for and
    raises :class:`~scopedmesh.errors.GroupFormationError` at once if the wait can
    never end (a deadlock cycle, a dead peer); ``what`` names the group there
    (``"axis 'tp'"``). ``liveness`` (a liveness watch, or None) says which peers
    are lost; without one, only a peer's process on this host can be seen dying.
    ``aborted`` says why the mesh asking was aborted (``""`` while it is not):
    every wait of the formation, its barrier's too, asks it and ``liveness``
    between slices and stops with :class:`~scopedmesh.errors.MeshClosedError`
    (aborted) or ``GroupFormationError`` (a member lost), so that a death at
    any moment of a formation releases the survivors. ``on_abort(wake)`` has
    ``wake()`` called when the mesh is aborted (and returns its cancel): the
    formation barrier's wait is then one request, ended by the abort, not
    sliced (:mod:`scopedmesh.c10d.barrier`). ``store_use`` decides whether the group forms over torch's store client or
    a clone of it (:class:`~scopedmesh.c10d.store.StoreUse`; None: a new one,
    in which every other thread of the process counts). ``unsplit``: never derive
    the group from WORLD's communicator, even where WORLD is bound to a device
    (a healed mesh's groups: WORLD holds the lost ranks; see
    :func:`scopedmesh.c10d.nccl.unsplit`); otherwise torch splits it from WORLD's
    where it would (fast).
    """
    ranks = ranks if isinstance(ranks, range) else tuple(ranks)
    rank = dist.get_rank()
    if rank not in ranks:
        return None
    problem = unusable_backend(str(backend))
    if problem is not None:  # torch's own failure would read like a formation failure
        raise ValueError(f"backend {shown(backend)} cannot form a group on this host: {problem}")
    if not keeps_member_order():
        warnings.warn(FALLBACK_WARNING, RuntimeWarning, stacklevel=3)
        with _unsplit() if unsplit else contextlib.nullcontext():
            return _public_group(ranks, backend, timeout, pg_options, description)
    return _named_group(
        ranks,
        dist.Backend(backend),
        timeout,
        pg_options,
        description,
        what=what or "the requested axes",
        grace=DEFAULT_GRACE if grace is None else grace,
        liveness=liveness,
        store_use=store_use or StoreUse(),
        aborted=aborted,
        on_abort=on_abort,
        unsplit=unsplit,
    )


def _named_group(
    ranks: Sequence[int],
    backend_enum: dist.Backend,
    timeout: timedelta | None,
    pg_options: object | None,
    description: str,
    *,
    what: str,
    grace: timedelta,
    liveness: Liveness | None,
    store_use: StoreUse,
    aborted: Callable[[], str] | None,
    on_abort: Subscribe | None,
    unsplit: bool,
) -> dist.ProcessGroup:
    """:func:`new_member_group` on the private path: a named incarnation, watched, then the
    formation barrier (see :func:`_all_formed`)."""
    rank = dist.get_rank()
    fake = _is_fake(str(backend_enum))
    generation, name = _next_generation(ranks, str(backend_enum))
    store = default_store()
    if not fake:  # torch 2.9 has no Backend.FAKE; its fake store cannot clone
        store = store_use.formation_store(store)
    group_timeout = timeout if timeout is not None else c10d._get_default_timeout(backend_enum)
    request = Request(
        rank=rank,
        name=name,
        generation=generation,
        ranks=shown(list(ranks)),
        backend=str(backend_enum),
        what=what,
        description=description,
    )
    watch = None
    if backend_enum == dist.Backend.GLOO and gloo_connects_eagerly():  # rendezvous here: watch it
        watch = Watch(store, request, ranks, grace, group_timeout, liveness, aborted)
    stop = Stop(store, request.group(), ranks, rank, liveness, aborted, on_abort)
    build = functools.partial(
        _construct,
        *(ranks, backend_enum, store, watch, name, group_timeout, description, pg_options),
        unsplit=unsplit,
    )
    try:
        if watch is not None and liveness is not None:  # guarded: a connect can be left behind
            group = _construct_stoppable(build, stop, watch.deadline, watch.forget_written)
        else:
            group = build()
    except Exception:
        _catch_up(ranks, str(backend_enum), generation)
        raise
    if not fake:  # fake members never rendezvous: nobody to wait for
        try:
            _all_formed(
                store,
                name,
                len(ranks),
                ranks.index(rank),
                group_timeout,
                str(backend_enum),
                stop=stop,
            )
        except Exception:
            destroy(group)
            raise
    return group


def _public_group(
    ranks: Sequence[int],
    backend: str,
    timeout: timedelta | None,
    pg_options: object | None,
    description: str,
) -> dist.ProcessGroup | None:
    """The fallback: public ``new_group`` over ``ranks`` (this rank a member), members ascending."""
    group = dist.new_group(
        list(ranks),
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=True,
        group_desc=description,
    )
    return None if group is None or group == dist.GroupMember.NON_GROUP_MEMBER else group


ABANDON_GRACE = 0.5  # seconds an abandoned construction is given to end its watched wait


def _construct_stoppable(
    build: Callable[[], dist.ProcessGroup],
    stop: Stop,
    deadline: float,
    forget: Callable[[], None],
) -> dist.ProcessGroup:
    """``build`` (:func:`_construct`) on a helper thread, this one asking ``stop`` every :data:`SLICE`.

    gloo connects each pair in C++ once the addresses are in the store, and a
    member waits there for a peer that died after publishing its address, for
    the whole group timeout; nothing reaches that wait. So under a liveness
    watch the construction runs on a thread of its own, and a lost member or an
    abort raises here at once: the thread is left to end by itself (a store
    wait ends at its next slice, a connect at gloo's timeout), and destroys
    the group if it forms after all. A hang guard past ``deadline`` raises too.
    An abandoned construction's address is deleted (``forget``) before the
    error is raised, so that nothing of it stays in the store.
    """
    lock = threading.Lock()
    outcome: list[Any] = []  # [group or exception], or ["abandoned"]

    def run() -> None:
        try:
            result: Any = build()
        except BaseException as error:  # handed to the caller below
            result = error
        with lock:
            left = bool(outcome)
            if not left:
                outcome.append(result)
        if left and isinstance(result, dist.ProcessGroup):
            destroy(result)  # formed after its caller stopped waiting: nobody holds it

    thread = threading.Thread(target=run, name="scopedmesh-formation", daemon=True)
    thread.start()
    guard = deadline + 30.0  # gloo's connect timeout is the group's: it ends before this
    while True:
        thread.join(SLICE)
        error = None if outcome else stop.why()
        if error is None and time.monotonic() >= guard and not outcome:
            error = GroupFormationError(f"could not form {stop.group}: its construction hung")
        with lock:
            abandoned = not outcome and error is not None
            if abandoned:
                outcome.append("abandoned")
            elif outcome and not thread.is_alive():
                break
        if abandoned and error is not None:
            thread.join(ABANDON_GRACE)  # a watched wait ends at its next slice, cleaning up
            forget()  # a connect can go on for gloo's timeout: its address goes now
            raise error
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    group: dist.ProcessGroup = outcome[0]
    return group


def _construct(
    ranks: Sequence[int],
    backend: dist.Backend,
    store: c10d.Store,
    watch: Watch | None,
    name: str,
    timeout: timedelta,
    description: str,
    pg_options: object | None,
    *,
    unsplit: bool = False,
) -> dist.ProcessGroup:
    """Build incarnation ``name`` through torch's private helper and record it as torch would.

    A gloo group is made closable (:mod:`scopedmesh.c10d.closable`) and forms
    over ``watch``'s store; the watch is finished however construction ends,
    and a failed construction's address is deleted (nobody reads it).
    The group is bound to WORLD's device, if any (an NCCL communicator then
    connects here, not at its first collective). ``unsplit``: it forms by its
    own init over the store rather than as a split of WORLD's communicator.
    """
    made_as: str = backend
    if backend == dist.Backend.GLOO:  # closable; others are torch's own
        from scopedmesh.c10d import (
            closable,
        )  # here, on the first gloo group: not in the mesh's import

        made_as = closable.register() or backend
    parameters = _helper_parameters()
    # Pass only what this torch's helper takes (see _HELPER_OPTIONS).
    options_name = "backend_options" if "backend_options" in parameters else "pg_options"
    make_name: Any = getattr(c10d, "GroupName", str)
    device_id = c10d._get_default_group().bound_device_id  # read before unsplit hides it
    try:
        with _unsplit() if unsplit else contextlib.nullcontext():
            group, prefix_store = c10d._new_process_group_helper(
                len(ranks),
                ranks.index(dist.get_rank()),
                ranks,
                made_as,
                WatchedStore(store, watch) if watch is not None else store,
                make_name(name),
                timeout=timeout,
                device_id=device_id,
                group_desc=description,
                **{options_name: pg_options},
            )
    except Exception:
        if watch is not None:
            watch.finish()
            watch.forget_written()  # this incarnation is abandoned: nobody reads its address
        raise
    if watch is not None:
        watch.finish()
    if made_as != backend:  # torch recorded the registry's name: record what it runs on
        c10d._world.pg_map[group] = (backend, prefix_store)
        c10d._world.pg_backend_config[group] = f"cpu:{backend}"
    rank_map = (
        RankMap(ranks)
        if isinstance(ranks, range) and ranks.step > 0
        else {r: i for i, r in enumerate(ranks)}
    )
    c10d._world.pg_group_ranks[group] = rank_map  # type: ignore[assignment]  # read as a Mapping
    return group  # type: ignore[no-any-return]


def _all_formed(
    store: c10d.Store,
    name: str,
    size: int,
    group_rank: int,
    timeout: timedelta,
    backend: str,
    *,
    stop: Stop | None = None,
) -> None:
    """Return once every member has finished forming incarnation ``name``; leave no key behind.

    The formation barrier (:func:`scopedmesh.c10d.barrier.all_formed`): each
    member arrives with one ``add``, the last releases the others with one
    ``set``, each waiter is woken once; an abort (``stop``) ends every wait at
    once. Each member then deletes its own gloo address (all in parallel, rather
    than one member deleting them all in turn). Store requests per formation of
    ``n > 1`` members on gloo: ``4n + 1``; every member makes 4 here or fewer, the last to
    leave 5.
    """
    all_formed(store, name, size, timeout, own_keys(name, group_rank, backend), stop)


def live_groups() -> Mapping[dist.ProcessGroup, object]:
    """torch's registry of live groups: the same dict object for the life of the process.

    ``group in live_groups()`` is the cheapest liveness test there is; callers
    may keep the mapping (read-only) to test many times.
    """
    return c10d._world.pg_map


def group_names() -> Mapping[dist.ProcessGroup, str]:
    """torch's name of each live group (``_world.pg_names``): the same dict for the process."""
    names: Mapping[dist.ProcessGroup, str] = c10d._world.pg_names
    return names


def is_live(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered with torch (not yet destroyed)."""
    return group in live_groups()  # empty when torch.distributed is not initialised


def destroy(group: dist.ProcessGroup, *, wait: bool = True) -> bool:
    """Destroy ``group`` if it is still live; never WORLD. Local: no communication.

    A closable gloo group is shut down too, live or not: its sockets close, its
    threads end, and a handle kept to it raises ``MeshClosedError`` from then on.
    With ``wait=False`` its destructor, which waits for its event loop's next
    tick (10 ms), may go on on a thread (:func:`destroying`).
    """
    closable = sys.modules.get("scopedmesh.c10d.closable")  # None: no group is closable yet
    if closable is not None and isinstance(group, closable.ClosableGroup):
        try:
            return _destroy(group)
        finally:
            group.release(wait=wait)
    return _destroy(group)


def destroying(group: dist.ProcessGroup) -> threading.Thread | None:
    """The thread on which the destructor of ``group`` (a closable gloo group) still runs,
    or None."""
    closable = sys.modules.get("scopedmesh.c10d.closable")
    if closable is not None and isinstance(group, closable.ClosableGroup):
        thread: threading.Thread | None = group.dropping
        return thread
    return None


def _destroy(group: dist.ProcessGroup) -> bool:
    if not is_live(group) or group is c10d.GroupMember.WORLD:
        return False
    tag = c10d._world.pg_to_tag.get(group)
    dist.destroy_process_group(group)
    # torch leaves an empty tags_to_pg entry behind; every incarnation has its own
    # name (and tag), so those would pile up, one per group made.
    if tag is not None and not c10d._world.tags_to_pg.get(tag, True):
        del c10d._world.tags_to_pg[tag]
    return True


def live_group_count() -> int:
    """The number of process groups torch holds in this process, WORLD included."""
    return len(c10d._world.pg_map) if dist.is_initialized() else 0


def record_process() -> None:
    """Write who this rank is (host, process) to the store, for peers' diagnoses."""
    _record_process(default_store(), dist.get_rank())
