"""A torch ``DeviceMesh`` that belongs to a scope: distinct per lifetime, closed with it.

Below the mesh: it knows a layout, a coordinate, a way to get each axis's
group and a :class:`Lifetime`, never
:class:`~scopedmesh.mesh.process_group_mesh.ProcessGroupMesh` itself, so the
mesh can call it and :mod:`scopedmesh.mesh.interop` can sit above the mesh.

torch compares DeviceMeshes by structure (ranks, shape, names, device type),
and DTensor caches its sharding decisions and redistribute plans by that key,
as ``torch.compile`` guards its graphs. Two meshes of the same structure over
different groups (consecutive scoped blocks, two meshes open at once) would
then share cache entries, and one block's work would run on the other block's
groups. A :class:`ScopedDeviceMesh` adds a token of its groups' names, unique
per incarnation, to that key; every DeviceMesh torch derives from it (slices,
``_flatten``, ``_unflatten``) becomes one too, and one torch combines as its own class
(``DeviceMesh._concatenate``, torch 2.15) keeps the token in ``_preserve_rank_order``
(:class:`RankOrder`); a group torch makes for ``_flatten`` or
``_unflatten`` is handed to the lifetime, which destroys it when the scope
closes; and once the scope has closed, resolving any of its groups raises the
lifetime's error (:class:`~scopedmesh.errors.MeshClosedError`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from scopedmesh.c10d.groups import group_names, live_groups
from scopedmesh.errors import shown
from scopedmesh.layout.mesh_layout import Axis, MeshLayout

__all__ = [
    "Lifetime",
    "RankOrder",
    "ScopedDeviceMesh",
    "build_device_mesh",
    "check_device_type",
    "dtensor_caches",
    "forget_closed_meshes",
]

_LIFETIME = "_scopedmesh_lifetime"  # the instance attribute that binds a DeviceMesh to a scope
_NAMES = "_dim_group_names"  # torch's attribute: the names of a DeviceMesh's groups, per dim


class Lifetime(Protocol):
    """What a :class:`ScopedDeviceMesh` needs of the scope it belongs to."""

    @property
    def closed(self) -> bool:
        """Whether the scope has closed (its groups are destroyed)."""
        ...

    def check_open(self) -> None:
        """Raise the scope's error (``MeshClosedError``) once it has closed."""
        ...

    def adopt(self, group: ProcessGroup) -> None:
        """Destroy ``group`` (made by torch for this scope) when the scope closes."""
        ...


def _group_names(mesh: DeviceMesh) -> list[str]:
    """torch's group names of ``mesh``, read without the open check."""
    names: list[str] = mesh.__dict__.get(_NAMES, [])
    return names


class ScopedDeviceMesh(DeviceMesh):
    """A ``DeviceMesh`` bound to the lifetime of the scope whose groups it uses.

    Equal to another only if torch finds them equal *and* their groups are the
    same incarnations (torch's own ``__eq__``, ``__hash__`` and compile guard see
    a token of them), so no torch cache keyed by a DeviceMesh, nor a compiled
    graph, can hand one scope's work to another scope's groups. After its scope
    closes, any use that resolves a group (DTensor's collectives, ``get_group``,
    slicing, ``_flatten``) raises ``MeshClosedError``. Copies are the mesh itself.
    """

    @property  # type: ignore[override]
    def _dim_group_names(self) -> list[str]:
        lifetime: Lifetime | None = self.__dict__.get(_LIFETIME)
        if lifetime is not None:
            lifetime.check_open()
        return _group_names(self)

    @_dim_group_names.setter
    def _dim_group_names(self, names: list[str]) -> None:
        self.__dict__[_NAMES] = names

    @property
    def _thread_id(self) -> int | None:
        # torch's equality, hash and torch.compile guard (``guard_fn``) all compare
        # ``_thread_id``, which torch sets only under its test-only "threaded" backend.
        # A token of this mesh's group incarnations there makes each lifetime distinct
        # to all three, without changing how torch compares anything else.
        stored: int | None = self.__dict__.get("_thread_id")
        token = _incarnation_token(_group_names(self))
        return token if stored is None else hash((stored, token))

    @_thread_id.setter
    def _thread_id(self, value: int | None) -> None:
        self.__dict__["_thread_id"] = value

    @property
    def _preserve_rank_order(self) -> RankOrder:
        # torch (2.15) builds a mesh with the static ``DeviceMesh._concatenate`` (FSDP2's
        # HSDP and FSDP2 + TP meshes) as its own class, with no ``_thread_id``; but it
        # copies this field from the first mesh, and ``__eq__``, ``__hash__`` and the
        # compile guard compare it. Read here it carries this mesh's incarnation token, so
        # such a mesh is distinct per incarnation as well. Releases without the field
        # never set it: then it stays absent (AttributeError), as on torch's class.
        stored = self.__dict__.get("_preserve_rank_order", _ABSENT)
        if stored is _ABSENT:
            raise AttributeError("_preserve_rank_order")
        return RankOrder(bool(stored), _incarnation_token(_group_names(self)))

    @_preserve_rank_order.setter
    def _preserve_rank_order(self, value: bool) -> None:
        self.__dict__["_preserve_rank_order"] = bool(value)  # torch's may pass a RankOrder

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (torch.save of DTensors, FSDP2's state_dict): the scope stays in this
        # process; torch's own DeviceMesh drops its group registry likewise.
        return {k: v for k, v in self.__dict__.items() if k not in (_LIFETIME, "_pg_registry")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Loaded: torch's own DeviceMesh over the same group names, resolved by name
        # where they exist (as torch's own pickled DeviceMesh is), bound to no scope.
        self.__class__ = DeviceMesh  # type: ignore[assignment]  # same layout: torch's class
        setstate = DeviceMesh.__dict__.get("__setstate__")
        if setstate is not None:
            setstate(self, state)
        else:
            self.__dict__.update(state)

    def __copy__(self) -> ScopedDeviceMesh:
        return self  # a handle on its scope's groups: copies would share them anyway

    def __deepcopy__(self, memo: dict[int, Any]) -> ScopedDeviceMesh:
        return self

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        self._check_open()
        return _bind(super().__getitem__(mesh_dim_names), self._lifetime)

    def _flatten(self, *args: Any, **kwargs: Any) -> DeviceMesh:
        self._check_open()
        backend = _closable_backend(self)
        if backend is not None:  # torch's (mesh_dim_name, backend_override)
            args, kwargs = _overriding(args, kwargs, 1, lambda given: _closable(given, backend))
        return _bind(_adopting(self._lifetime, super()._flatten, *args, **kwargs), self._lifetime)

    def _unflatten(self, *args: Any, **kwargs: Any) -> DeviceMesh:
        self._check_open()
        backend = _closable_backend(self)
        if backend is not None:  # torch's (dim, mesh_sizes, mesh_dim_names, backend_override)
            names = args[2] if len(args) > 2 else kwargs.get("mesh_dim_names", ())
            args, kwargs = _overriding(
                args, kwargs, 3, lambda given: _closable_per_name(given, names, backend)
            )
        unflat = _adopting(self._lifetime, super()._unflatten, *args, **kwargs)
        return _bind(unflat, self._lifetime)

    @property
    def _lifetime(self) -> Lifetime:
        lifetime: Lifetime = self.__dict__[_LIFETIME]
        return lifetime

    def _check_open(self) -> None:
        lifetime: Lifetime | None = self.__dict__.get(_LIFETIME)
        if lifetime is not None:
            lifetime.check_open()


_ABSENT = object()


class RankOrder:
    """torch's ``preserve_rank_order`` flag, tagged with a group-incarnation token.

    True or false exactly as the flag; equal to another only with the same flag
    and token (never to a plain bool), hashed alike; immutable, so copies are
    itself, and it pickles as its two values. A DeviceMesh torch derives from a
    :class:`ScopedDeviceMesh` by itself (``DeviceMesh._concatenate``) keeps the
    token in that field, which its ``__eq__``, ``__hash__`` and compile guard read.

    >>> RankOrder(False, 1) == RankOrder(False, 1), RankOrder(False, 1) == RankOrder(False, 2)
    (True, False)
    >>> bool(RankOrder(False, 1)), RankOrder(False, 1) == False, not RankOrder(True, 1)
    (False, False, False)
    """

    __slots__ = ("_flag", "_token")
    _flag: bool
    _token: int

    def __init__(self, flag: bool, token: int) -> None:
        object.__setattr__(self, "_flag", bool(flag))
        object.__setattr__(self, "_token", token)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __bool__(self) -> bool:
        return self._flag

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankOrder):
            return NotImplemented
        return (self._flag, self._token) == (other._flag, other._token)

    def __hash__(self) -> int:
        return hash((RankOrder, self._flag, self._token))

    def __repr__(self) -> str:  # torch's stable hash (AOT autograd's cache) reads it
        return f"RankOrder({self._flag}, {self._token})"

    def __reduce__(self) -> tuple[type[RankOrder], tuple[bool, int]]:
        return RankOrder, (self._flag, self._token)

    def __copy__(self) -> RankOrder:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RankOrder:
        return self


# torch.load(weights_only=True), torch's default, takes only allowlisted classes: as
# torch.distributed.tensor allowlists DeviceMesh, this allowlists the classes a DTensor on a
# scoped DeviceMesh pickles (the mesh's own, and a combined mesh's rank-order field).
torch.serialization.add_safe_globals([ScopedDeviceMesh, RankOrder])


def _incarnation_token(names: list[str]) -> int:
    """A number that tells apart DeviceMeshes over different group incarnations.

    >>> _incarnation_token(["scopedmesh-1a-1"]) != _incarnation_token(["scopedmesh-1a-2"])
    True
    """
    digest = hashlib.sha1("|".join(names).encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:7], "big")


def _bind(mesh: DeviceMesh, lifetime: Lifetime) -> DeviceMesh:
    """Make ``mesh`` (torch's, derived from a scoped one) a :class:`ScopedDeviceMesh` of ``lifetime``."""
    if type(mesh) is DeviceMesh:
        mesh.__class__ = ScopedDeviceMesh
    if isinstance(mesh, ScopedDeviceMesh) and _LIFETIME not in mesh.__dict__:
        mesh.__dict__[_LIFETIME] = lifetime
    return mesh


def _closable_backend(mesh: DeviceMesh) -> str | None:
    """The closable gloo backend's name if ``mesh`` runs on CPU over closable gloo groups only.

    A group torch makes for such a mesh (``_flatten``, ``_unflatten``) is then made
    closable too, so that an abort of the mesh's table shuts it down like the
    mesh's own (:meth:`GroupTable.adopt <scopedmesh.mesh.group_table.GroupTable.adopt>`).
    """
    closable = sys.modules.get("scopedmesh.c10d.closable")  # loaded with the first gloo group
    if closable is None or mesh.device_type != "cpu":
        return None
    if not all(isinstance(group, closable.ClosableGroup) for group in mesh.get_all_groups()):
        return None
    name: str = closable.BACKEND
    return name


def _closable(given: Any, backend: str) -> Any:
    """``backend`` where torch would make a plain gloo group (no override, or ``"gloo"``).

    >>> _closable(None, "scopedmesh_gloo"), _closable("gloo", "x"), _closable("nccl", "x")
    ('scopedmesh_gloo', 'x', 'nccl')
    """
    return backend if given is None or (isinstance(given, str) and given == "gloo") else given


def _closable_per_name(given: Any, names: Any, backend: str) -> dict[Any, Any]:
    """``_unflatten``'s per-dim overrides, with :func:`_closable` for each of ``names``.

    >>> _closable_per_name({1: "nccl"}, ("dp", "tp"), "x")
    {1: 'nccl', 'dp': 'x'}
    """
    chosen = dict(given or {})
    for index, name in enumerate(names):
        key = name if name in chosen else index if index in chosen else None
        if key is None:
            chosen[name] = backend
        else:
            chosen[key] = _closable(chosen[key], backend)
    return chosen


def _overriding(
    args: tuple[Any, ...], kwargs: dict[str, Any], position: int, change: Callable[[Any], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with torch's ``backend_override`` (at ``position``) changed."""
    if len(args) > position:
        return (*args[:position], change(args[position]), *args[position + 1 :]), kwargs
    return args, {**kwargs, "backend_override": change(kwargs.get("backend_override"))}


def _adopting(
    lifetime: Lifetime, make: Callable[..., DeviceMesh], *args: Any, **kwargs: Any
) -> DeviceMesh:
    """``make(*args, **kwargs)``, torch's call that builds a DeviceMesh; the groups torch made
    for that mesh are handed to ``lifetime``.

    Adoption is tied to the call's result, not to the moment: of the groups
    that appeared in torch's registry while it ran, only those the new mesh
    names (``_dim_group_names``) are adopted. A group another thread formed
    meanwhile (its own mesh's, or one a user made) is not named there and
    stays its owner's. A call that raises adopts nothing: what it may have
    made cannot be told from another thread's groups, and leaving a group
    alive is safe where destroying another scope's is not.
    """
    live = live_groups()
    before = set(live)  # one C-level copy: atomic under the GIL while other threads add groups
    mesh = make(*args, **kwargs)
    used = set(_group_names(mesh))
    names = group_names()
    for group in [group for group in tuple(live) if group not in before]:
        if names.get(group) in used:
            lifetime.adopt(group)
    return mesh


def check_device_type(device_type: object) -> str:
    """``device_type`` if it names a device type torch knows, without an index.

    >>> check_device_type("cpu")
    'cpu'
    >>> check_device_type("cuda:0")
    Traceback (most recent call last):
    ...
    ValueError: device_type must be a device type without an index, such as 'cuda', got 'cuda:0'
    """
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(
            f"device_type must be a device name such as 'cpu', got {shown(device_type)}"
        )
    try:
        device = torch.device(device_type)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"device_type must be a device type torch knows, such as 'cpu' or 'cuda', "
            f"got {shown(device_type)}"
        ) from None
    if device.index is not None or device.type != device_type:
        raise ValueError(
            f"device_type must be a device type without an index, such as {device.type!r}, "
            f"got {shown(device_type)}"
        )
    return device_type


def build_device_mesh(
    layout: MeshLayout,
    coord: tuple[int, ...],
    device_type: str,
    axes: Sequence[Axis] | None,
    group_along: Callable[[int], ProcessGroup | None],
    *,
    keeps_order: bool,
    lifetime: Lifetime,
) -> ScopedDeviceMesh:
    """A :class:`ScopedDeviceMesh` over ``axes`` (default: all) through ``coord``.

    ``group_along(axis_index)`` gives the group of each selected axis; it is
    called only once the axes have been checked, in the order of ``axes``.
    ``keeps_order``: the groups list their members in mesh order, so DTensor's
    shard ``k`` lands on the rank at position ``k`` whatever the rank order;
    otherwise members ascend, and an axis whose ranks do not is refused.
    """
    check_device_type(device_type)
    chosen = tuple(range(layout.ndim)) if axes is None else layout.axes_indices(axes)
    sub = layout.sub(coord, chosen)
    ranks = torch.tensor(sub.ranks, dtype=torch.int).reshape(sub.shape)
    names = tuple(layout.axis_name(a) if layout.names else f"axis{a}" for a in chosen)
    for dim, name in enumerate(names):
        if not keeps_order and sub.shape[dim] > 1 and not bool((ranks.diff(dim=dim) > 0).all()):
            raise ValueError(
                f"axis {name!r} lists ranks out of ascending order ({ranks.tolist()}); torch "
                "orders a group's members by global rank, so DTensor would misplace shards. "
                "Lay the mesh over ranks that ascend along the axes you convert (this torch's "
                "groups cannot keep their members in mesh order)"
            )
    groups: list[ProcessGroup] = []
    for a in chosen:
        group = group_along(a)
        if group is None:  # cannot happen: without indices, every rank is in its group
            raise RuntimeError(f"this rank has no group along axis {names[len(groups)]!r}")
        groups.append(group)
    # from_group makes no group; should a release make one, it is the scope's.
    mesh = _adopting(
        lifetime, DeviceMesh.from_group, groups, device_type, ranks, mesh_dim_names=names
    )
    bound = _bind(mesh, lifetime)
    if not isinstance(bound, ScopedDeviceMesh):  # a subclass of DeviceMesh: not ours to rebind
        raise TypeError(f"DeviceMesh.from_group returned a {type(mesh).__name__}")
    return bound


def dtensor_caches() -> dict[str, Any]:
    """Every cache of DTensor and DeviceMesh that :func:`forget_closed_meshes` clears, by name.

    The value is the cache (a function with ``cache_clear``, or a dict), or
    None where this release lacks it (and for DTensor's, while DTensor is not
    loaded). ``tests/world/test_boundary.py`` pins which names each release has.
    """
    tensor = sys.modules.get("torch.distributed.tensor")
    dispatcher = getattr(getattr(tensor, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    topology = sys.modules.get("torch.distributed.tensor._collective_utils")
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    caches: dict[str, Any] = {
        # the C++ dispatch fast path's cache (torch 2.10 and later)
        "torch._C._clear_DTensor_sharding_propagator_cache": native if tensor else None,
        "_redistribute._gen_transform_infos": getattr(redistribute, "_gen_transform_infos", None),
        "_redistribute._planner_cache": getattr(redistribute, "_planner_cache", None),
        "_collective_utils.MeshTopoInfo.build_from_mesh": getattr(
            getattr(topology, "MeshTopoInfo", None), "build_from_mesh", None
        ),
    }
    for name in (
        "propagate_op_sharding",
        "_propagate_tensor_meta",
        "_propagate_tensor_meta_cached",
    ):
        caches[f"ShardingPropagator.{name}"] = getattr(propagator, name, None)
    # torch 2.9: maps keyed by DeviceMesh on a module-level _MeshEnv (thread-local).
    resources = getattr(sys.modules.get("torch.distributed.device_mesh"), "_mesh_resources", None)
    for name in ("child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
        found = getattr(resources, name, None)
        caches[f"_mesh_resources.{name}"] = found if isinstance(found, dict) else None
    return caches


def forget_closed_meshes() -> None:
    """Drop what torch cached about DeviceMeshes whose scope has closed.

    Their keys can never match a live mesh (see :class:`ScopedDeviceMesh`), so
    this is about memory, not correctness: the caches are unbounded, and a
    sweep of scoped blocks would otherwise keep every closed block's meshes.
    DTensor's sharding-propagation caches (C++ and Python), its tensor-meta and
    redistribute-transform caches and the mesh-topology cache cannot drop
    single entries, so they are cleared (this thread's, for the thread-local
    ones): a mesh that stays open recomputes each of its ops' decisions once.
    The redistribute planners (keyed by weak references) and torch 2.9's
    mesh-keyed maps lose only the closed meshes' entries. Each cache is looked
    up by name (:func:`dtensor_caches`) and skipped where a release lacks it.
    """
    for name, cache in dtensor_caches().items():
        if cache is None:
            continue
        if name == "torch._C._clear_DTensor_sharding_propagator_cache":
            cache()
        elif name == "_redistribute._planner_cache" and isinstance(cache, dict):
            for key in list(cache):
                mesh = key[0]() if isinstance(key, tuple) and callable(key[0]) else None
                if mesh is None or _closed(mesh):
                    del cache[key]
        elif name.startswith("_mesh_resources."):
            for mesh in [mesh for mesh in cache if _closed(mesh)]:
                del cache[mesh]
        else:
            _clear(cache)


def _closed(mesh: object) -> bool:
    """Whether ``mesh`` is a DeviceMesh of a scope that has closed."""
    lifetime: Lifetime | None = getattr(mesh, "__dict__", {}).get(_LIFETIME)
    return lifetime is not None and lifetime.closed


def _clear(cache: object) -> None:
    """Clear a functools cache, or the one inside torch's thread-local wrapper (2.9)."""
    for candidate in (cache, getattr(cache, "cache", None)):
        clear = getattr(candidate, "cache_clear", None)
        if callable(clear):
            clear()
            return
