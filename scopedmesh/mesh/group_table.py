"""The group cache of a mesh: one group per (ranks, backend), made on first request by its members.

:class:`GroupCache` is the group half of :class:`~scopedmesh.mesh.process_group_mesh.ProcessGroupMesh`:
``get_group_along_axis`` and its fast path, formation through
:mod:`scopedmesh.c10d.groups`, and the errors that name the axis and ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.checks import check_backend
from scopedmesh.errors import GroupFormationError
from scopedmesh.layout.mesh_layout import Axes, Axis
from scopedmesh.mesh.scope import Entry, Scope

__all__ = ["GroupCache", "plain_axes"]


class GroupCache(Scope):
    """Make, cache and hand out this rank's groups along axes of the mesh."""

    def get_group_along_axis(
        self,
        axis: Axes,
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
        pg_options: Any = None,
    ) -> dist.ProcessGroup | None:
        """This rank's group along ``axis`` (one or several axes), made on first use.

        ``indices_at_axis`` keeps only those positions of the axes (e.g. ``[0, -1]``
        for the first and last pipeline stages); ranks outside them get ``None``.
        Every member must request the group, in the same order as its peers.
        If a member does not arrive within the mesh's timeout, this raises
        :class:`GroupFormationError`; once every member asks again, it forms.
        """
        if indices_at_axis is None and backend is None and pg_options is None:
            try:
                entry = self._by_axis[axis]
            except (KeyError, TypeError):  # not cached yet, or an unhashable axes list
                pass
            else:
                kind = axis.__class__
                if (
                    entry.alive
                    and (kind is str or kind is int or plain_axes(axis))
                    and (entry.group is None or entry.group in self._live)
                ):
                    return entry.group
        return self._get_group(axis, indices_at_axis, backend, pg_options)

    def create_group_along_axis(
        self,
        axis: Axes,
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
        pg_options: Any = None,
    ) -> dist.ProcessGroup | None:
        """Same as :meth:`get_group_along_axis`: a group is never made twice."""
        return self._get_group(axis, indices_at_axis, backend, pg_options)

    def create_groups(self, *axes: Axis) -> None:
        """Make this rank's group along each of ``axes`` (default: every axis), in mesh order."""
        chosen = self._layout.axes_indices(axes) if axes else range(self._layout.ndim)
        for axis in sorted(chosen):
            self.get_group_along_axis(axis)

    def get_ranks_in_group(self, group: dist.ProcessGroup) -> list[int]:
        """The global ranks of ``group``, in group-rank order."""
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup, got {group!r}")
        return dist.get_process_group_ranks(group)

    def _get_group(
        self,
        axis: Axes,
        indices: object,
        backend: str | None,
        pg_options: Any,
    ) -> dist.ProcessGroup | None:
        with self._lock:
            return self._get_group_locked(axis, indices, backend, pg_options)

    def _get_group_locked(
        self,
        axis: Axes,
        indices: object,
        backend: str | None,
        pg_options: Any,
    ) -> dist.ProcessGroup | None:
        self._check_open()
        ranks = self._layout.compact_group(self._coord, axis, indices)
        backend_name = self._backend_name(check_backend(backend, "backend"))
        options = self._pg_options if pg_options is None else pg_options
        if self._rank not in ranks:
            entry = Entry((ranks, backend_name), None, options)
        else:
            entry = self._registry.get((ranks, backend_name)) or self._make(
                ranks, backend_name, options, self._describe(axis, indices)
            )
            if entry.group is not None and entry.group not in self._live:
                raise RuntimeError(
                    f"the group along {self._describe(axis, indices)} over ranks {list(ranks)} "
                    "was destroyed outside this mesh (by torch.distributed.destroy_process_group); "
                    "the mesh does not make it again behind its peers' backs. Close this mesh "
                    "and make a new one"
                )
            if pg_options is not None and entry.options is not options:
                raise ValueError(
                    f"pg_options differ from those of the existing group over ranks {list(ranks)} "
                    f"on {backend_name!r}; a mesh keeps one group per (ranks, backend)"
                )
        if indices is None and backend is None and pg_options is None:
            try:
                self._by_axis[axis] = entry
            except TypeError:  # unhashable axes: no fast path
                pass
        return entry.group

    def _make(self, ranks: range | tuple[int, ...], backend: str, options: Any, what: str) -> Entry:
        try:
            group = _c10d.new_member_group(
                ranks,
                backend=backend,
                timeout=self._timeout,
                pg_options=options,
                description=f"scopedmesh:{what}",
            )
        except RuntimeError as error:
            raise formation_error(backend, what, ranks, self._timeout, error) from error
        entry = Entry((ranks, backend), group, options)
        self._registry[entry.key] = entry
        self._created.append(entry)
        return entry

    def _describe(self, axis: Axes, indices: object) -> str:
        chosen = self._layout.axes_indices(axis)
        names = tuple(self._layout.axis_name(a) for a in chosen)
        what = f"axis {names[0]!r}" if len(names) == 1 else f"axes {names}"
        return what if indices is None else f"{what} at indices {indices}"

    def _backend_name(self, backend: str | None) -> str:
        chosen = backend or self._backend or dist.get_backend()
        return str(dist.Backend(chosen))


def plain_axes(axis: object) -> bool:
    """Whether ``axis`` is an int, a str or a tuple of them: safe as a cache key.

    ``1.0 == 1`` and ``(0, True) == (0, 1)``: such keys must not reach the cache.
    """
    cls = axis.__class__
    if cls is int or cls is str:
        return True
    return cls is tuple and all(a.__class__ is int or a.__class__ is str for a in axis)  # type: ignore[attr-defined]


# Words of torch's store and gloo's transport when members did not meet in time.
_MEETING_FAILURES = ("timeout", "timed out", "connection", "connect", "peer")


def formation_error(
    backend: str,
    what: str,
    ranks: Sequence[int],
    timeout: timedelta | None,
    error: RuntimeError,
) -> GroupFormationError:
    """The error for a group that could not be made, with the likely cause.

    Members that did not meet (a wait or a connection failed) and a backend that
    failed on its own (say, NCCL without a CUDA device) read differently.

    >>> str(formation_error("nccl", "axis 'dp'", [0, 1], None, RuntimeError("no GPU")))
    "the nccl backend failed to make the process group along axis 'dp' over ranks [0, 1]: no GPU"
    """
    text = str(error)
    if not any(word in text.lower() for word in _MEETING_FAILURES):
        return GroupFormationError(
            f"the {backend} backend failed to make the process group along {what} over "
            f"ranks {list(ranks)}: {text}"
        )
    waited = f" within {timeout}" if timeout is not None else ""
    return GroupFormationError(
        f"could not form the {backend} process group along {what} over ranks "
        f"{list(ranks)}{waited}. Likely cause: a member never requested this group, a member "
        "died, or members requested overlapping groups in different orders (every member "
        f"must request the same groups in the same order). torch said: {text}"
    )
