"""Gloo groups that a closing mesh really shuts: their sockets and threads go, later use raises.

torch's gloo backend has no shutdown (its ``abort`` and ``shutdown`` do
nothing), and a ``ProcessGroup`` keeps its backend alive for as long as any
handle to it lives. So a handle kept past its mesh's scope (the common
``self.tp_group = mesh.get_group_along_axis("tp")``) kept 5 file descriptors
and 3 threads per 2-rank group and went on working. The handle a mesh gives
out for a gloo group is therefore a :class:`ClosableGroup`: a Python
``ProcessGroup`` that forwards every operation to a plain gloo group it owns.
:meth:`ClosableGroup.release` drops that inner group, so torch's destructor
closes its sockets and joins its threads, and any later operation raises
:class:`~scopedmesh.errors.MeshClosedError` at once. Releasing is local: no
message goes to a peer.

torch calls :func:`make_closable_gloo` through its custom-backend registry
(``register()``), so the group is named and registered exactly as a gloo group
would be; :func:`~scopedmesh.c10d.groups.new_member_group` then records it as gloo.
"""

from __future__ import annotations

import contextlib
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from scopedmesh.errors import MeshClosedError

__all__ = ["BACKEND", "ClosableGroup", "make_closable_gloo", "register", "supported"]

# The name of the backend in torch's registry. torch records it for the group;
# new_member_group replaces that record with "gloo", which is what the group is.
BACKEND = "scopedmesh_gloo"

# Every operation of ``ProcessGroup`` that moves data, synchronises or reaches the
# backend, under each name some torch release uses for it (Python callers use the
# bound names; the C++ trampoline looks the newer ones up, then the older ones).
# Names this torch lacks are skipped; ``tests/unit/test_closable.py`` checks that every
# operation this torch has is here.
FORWARDED = (
    "_allgather_base",
    "_reduce_scatter_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "all_to_all_single",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "barrier",
    "broadcast",
    "gather",
    "gather_into_tensor",
    "gather_single",
    "get_backend",
    "get_reconfigure_handle",
    "monitored_barrier",
    "new_window",
    "reconfigure",
    "recv",
    "recv_anysource",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "register_abort_hook",
    "register_post_hook",
    "register_pre_hook",
    "scatter",
    "send",
    "set_timeout",
    "supports_abort_hooks",
    "supports_completion_hooks",
    "supports_reconfigure",
    "supports_window",
    "unregister_abort_hook",
    "unregister_post_hook",
    "unregister_pre_hook",
)


class ClosableGroup(dist.ProcessGroup):
    """A gloo group whose connections end when :meth:`release` is called.

    >>> issubclass(ClosableGroup, dist.ProcessGroup)
    True
    """

    def __init__(self, inner: dist.ProcessGroup) -> None:
        # torch's stubs list only (store, rank, size); (rank, size) holds no store.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self._inner: dist.ProcessGroup | None = inner
        self._held: dist.ProcessGroup | None = None  # aborted while busy: kept until release
        self._pending: list[dist.Work] | None = None  # None: not tracked (see track)
        self._released_because = ""
        self._name = ""
        self._desc = ""

    def inner(self) -> dist.ProcessGroup:
        """The plain gloo group underneath; ``MeshClosedError`` once released."""
        inner = self._inner
        if inner is None:
            raise MeshClosedError(
                f"process group {self.group_name!r} was shut down {self._released_because}; "
                "a handle kept past its mesh's scope cannot communicate: take the group "
                "from an open mesh"
            )
        return inner

    def release(self, because: str = "when its mesh closed") -> None:
        """Drop the inner group: its sockets close and its threads end (local, idempotent)."""
        if self._inner is not None:
            self._released_because = because
            self._inner = None
        self._pending = None
        self._held = None  # an aborted group's connections end here at the latest

    def track(self) -> None:
        """Remember the work of the collectives started from now on, for :meth:`interrupt`.

        Off by default (a handle nobody interrupts pays nothing); a liveness watch
        turns it on for the groups of the meshes it guards. Idempotent.
        """
        if self._pending is None and self._inner is not None:
            self._pending = []

    def interrupt(self, because: str) -> bool:
        """Shut the group down from another thread, without waiting for a collective on it.

        Later operations raise :class:`~scopedmesh.errors.MeshClosedError` at once.
        If no collective is in flight (as far as :meth:`track` saw), the
        connections close now, so peers blocked in a collective with this rank
        raise at once; returns True. Otherwise gloo's destructor would wait for
        that collective, so the group is held and False is returned: the
        collective in flight ends (it completes, or fails when a peer's
        connections close), and then :meth:`settle` closes the connections.
        Until then, and at the latest at :meth:`release` (the mesh's close), the
        group stays open. Local, idempotent.
        """
        inner = self._inner
        if inner is None:
            return self._held is None
        pending = self._pending
        busy = pending is None or any(not work.is_completed() for work in pending)
        self._released_because = because
        if busy:
            self._held = inner  # with its pending work (None: untracked), for settle()
        else:
            self._pending = None
        self._inner = None
        del inner  # not busy: the last reference, gloo closes its sockets here
        return not busy

    def settle(self) -> bool:
        """Close a group :meth:`interrupt` held, once the collectives it saw in flight ended.

        A held group whose collective has completed (or failed) is idle, and
        nothing new can start on it; were it kept open until its mesh closes,
        a peer that went on to its next collective on this group would wait for
        the group's timeout (and a survivor's agreement for that peer with it).
        Returns whether the group is now closed (True when nothing is held). A
        group held untracked (no record of its work) stays held until
        :meth:`release`. Local, idempotent; a liveness watch calls it every
        interval for the meshes it guards.
        """
        held, pending = self._held, self._pending
        if held is None:
            return True
        if pending is None or any(not work.is_completed() for work in pending):
            return False
        self._pending = None
        self._held = None
        del held, pending  # the last references: gloo closes its sockets here
        return True

    def __repr__(self) -> str:
        # torch names a group it no longer knows by its repr ("Process group {pg}
        # is not initialized ..."): say what happened to it.
        if self._inner is None:
            return f"<scopedmesh group {self._name!r}, shut down {self._released_because}>"
        return f"<scopedmesh group {self._name!r}, gloo, rank {self.rank()} of {self.size()}>"

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run."""
        return self._inner is None

    # torch's C++ side reads these through its trampoline, under their C++ names. A
    # plain ProcessGroup keeps its name on its backends; this one has none of its own.
    def getBackendName(self) -> str:
        """Not "gloo": C++ code that reads "gloo" casts the registered backend to gloo's class.

        ``dist.get_backend(group)`` still says ``"gloo"``: the group runs on gloo.
        """
        return BACKEND

    def getGroupName(self) -> str:
        """The group's name (torch's ``group_name``)."""
        return self._name

    def setGroupName(self, name: str) -> None:
        """Set the name, here and on the inner group."""
        self._name = name
        if self._inner is not None:
            self._inner._set_group_name(name)  # type: ignore[arg-type]  # GroupName is a str

    def getGroupDesc(self) -> str:
        """The group's description (torch's ``group_desc``)."""
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        """Set the description, here and on the inner group."""
        self._desc = desc
        if self._inner is not None:
            self._inner._set_group_desc(desc)

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: torch.device) -> Any:
        return self.inner()._get_backend(device)

    def _start_coalescing(self, device: torch.device) -> None:
        self.inner()._start_coalescing(device)

    def _end_coalescing(self, device: torch.device) -> Any:
        return self.inner()._end_coalescing(device)

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    def split_group(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not supported: torch would split the stand-in backend, not the gloo group."""
        raise NotImplementedError(
            f"{self!r} does not split or merge: ask its mesh for the group you need "
            "(get_group_along_axis, submesh)"
        )

    # The C++ names too: torch's trampoline looks those up.
    splitGroup = merge_remote_group = mergeRemoteGroup = split_group


def _forward(name: str) -> Any:
    """``name`` of the inner gloo group: a method or a property, as ``ProcessGroup`` has it."""

    def forward(self: ClosableGroup, *args: Any, **kwargs: Any) -> Any:
        inner = self.inner()  # held until the work is recorded: interrupt() never drops it mid-call
        result = getattr(inner, name)(*args, **kwargs)
        pending = self._pending
        if pending is not None and isinstance(result, dist.Work):  # tracked: see track()
            pending[:] = [work for work in pending if not work.is_completed()]
            pending.append(result)
        return result

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` of the inner gloo group; ``MeshClosedError`` once released."
    if isinstance(vars(dist.ProcessGroup)[name], property):
        return property(lambda self: getattr(self.inner(), name), doc=forward.__doc__)
    return forward


for _name in FORWARDED:
    if _name in vars(dist.ProcessGroup):
        setattr(ClosableGroup, _name, _forward(_name))
del _name


def _stand_in(rank: int, size: int) -> Any | None:
    """A backend that holds nothing and raises on any collective; ``None`` if torch has none.

    torch's C++ side looks a group's backend up by type for bookkeeping (DDP's
    logger asks for it); the collectives themselves reach the Python methods
    above. The stand-in answers the look-ups. Should a C++ path ever send a
    collective to it, torch's fake backend raises rather than doing nothing.
    """
    fake: Any = getattr(torch._C._distributed_c10d, "FakeProcessGroup", None)
    options = fake.Options() if fake is not None else None
    if options is None or not hasattr(options, "error_on_collective"):
        return None
    options.error_on_collective = True
    return fake._create_internal(rank, size, options)


def make_closable_gloo(options: Any, backend_options: object | None = None) -> ClosableGroup:
    """torch's custom-backend creator (extended API): a gloo group, wrapped to be closable.

    ``options`` carries what torch's own gloo branch uses: the store (already
    prefixed with the group's name and device), the member's group rank, the
    group size, the timeout, the group's name and its global ranks.
    """
    store, group_rank, group_size = options.store, options.group_rank, options.group_size
    backend = dist.ProcessGroupGloo(store, group_rank, group_size, options.timeout)
    # What torch's own gloo branch sets on the options, where this torch has them.
    with contextlib.suppress(AttributeError):
        backend.options.global_ranks_in_group = options.global_ranks_in_group
        backend.options.group_name = options.group_id
    backend._set_sequence_number_for_group()
    inner = dist.ProcessGroup(store, group_rank, group_size)
    inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group = ClosableGroup(inner)
    stand_in = _stand_in(group_rank, group_size)  # register() made sure this torch has one
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, stand_in)
    return group


def register() -> str | None:
    """Register :data:`BACKEND` with torch once per process and return its name.

    ``None`` on a torch without the stand-in backend: there a mesh's gloo groups
    are torch's own, as before.
    """
    if BACKEND.upper() not in dist.Backend._plugins:
        if _stand_in(0, 1) is None:
            return None
        dist.Backend.register_backend(
            BACKEND, make_closable_gloo, extended_api=True, devices=["cpu"]
        )
    return BACKEND


def supported() -> bool:
    """Whether this torch lets a mesh's gloo groups be closable."""
    return register() is not None
