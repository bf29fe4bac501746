"""A replica's registered state, moved to other replicas on an epoch's dp group.

Two ways: :func:`broadcast_state` (every member takes the source's state: the
first epoch and every heal) and a **catch-up** (an admission: the source sends
a snapshot to the joiners alone, in the background, while the epoch's first
step runs; the survivors already hold that state). The snapshot is taken
before the step changes anything, so the joiner loads the state the
survivors started the step from.

>>> model = torch.nn.Linear(2, 1)
>>> data = serialize({"model": model})
>>> other = torch.nn.Linear(2, 1)
>>> load({"model": other}, bytearray(bytes(data.tolist())))
>>> torch.equal(model.weight, other.weight)
True
"""

from __future__ import annotations

import importlib
import io
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Incoming", "Outgoing", "Stateful", "Transfer", "broadcast_state", "load", "serialize"]

LENGTH_TAG, DATA_TAG = 1, 2  # gloo's send/recv tags (collectives use tags of their own)


class Stateful(Protocol):
    """What a replica registers: torch's ``state_dict`` / ``load_state_dict`` pair."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True)
class Transfer:
    """One state transfer: ``epoch``, ``role`` (``sent`` or ``received``), ``nbytes``,
    ``seconds`` (a broadcast: its time; a catch-up: from the snapshot until the
    bytes left (``sent``), or from the group's formation until they were loaded)."""

    epoch: int
    role: str
    nbytes: int
    seconds: float


def serialize(state: Mapping[str, Stateful]) -> torch.Tensor:
    """``state``'s ``state_dict()``s as one ``torch.save`` blob (a uint8 tensor).

    A DTensor (FSDP2's parameters and optimizer state) travels as its local
    shard, its placements and its mesh's shape and dimension names: its mesh
    is this process's, and is rebuilt from the receiver's own (:func:`load`).
    """
    buffer = io.BytesIO()
    torch.save({name: _mapped(obj.state_dict(), _to_wire) for name, obj in state.items()}, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def load(state: Mapping[str, Stateful], data: bytearray) -> None:
    """Load a :func:`serialize` blob into ``state`` (``weights_only``: tensors and plain data).

    A DTensor is rebuilt on the mesh of the same shape and dimension names
    among the DTensors of ``state``'s own ``state_dict()``s (a ``ValueError``
    if there is none).
    """
    sharded = _DTENSOR.encode() in data
    if sharded:  # its import allowlists placements for weights_only
        importlib.import_module("torch.distributed.tensor")
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    meshes = _meshes(state) if sharded else {}
    for name, obj in state.items():
        value = loaded[name]
        if sharded:
            value = _mapped(value, lambda v: _from_wire(v, meshes))
        obj.load_state_dict(value)


_DTENSOR = "__scopedmesh_dtensor_shard__"


def _is_dtensor(value: object) -> bool:
    module = type(value).__module__
    return module.startswith("torch.distributed.tensor") and type(value).__name__ == "DTensor"


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))


def _mapped(value: Any, convert: Callable[[Any], Any]) -> Any:
    """``value`` with each part that ``convert`` answers (not None) replaced by its answer,
    through dicts, lists and tuples; a container is copied only where a part changed."""
    replaced = convert(value)
    if replaced is not None:
        return replaced
    if isinstance(value, dict):
        items = {k: _mapped(v, convert) for k, v in value.items()}
        return items if any(items[k] is not value[k] for k in value) else value
    if isinstance(value, list | tuple):
        converted = [_mapped(v, convert) for v in value]
        same = all(a is b for a, b in zip(converted, value))
        return value if same else type(value)(converted)
    return value


def _to_wire(value: Any) -> Any:
    """A plain record of ``value`` if it is a DTensor (its shard, placements, shape, and
    its mesh's shape and names), else None."""
    if not _is_dtensor(value):
        return None
    return {
        _DTENSOR: value.to_local(),
        "placements": list(value.placements),
        "mesh": _mesh_key(value.device_mesh),
        "shape": tuple(value.shape),
        "stride": tuple(value.stride()),
    }


def _meshes(state: Mapping[str, Stateful]) -> dict[tuple[Any, ...], Any]:
    """The DeviceMeshes of the DTensors in ``state``'s own state dicts, by shape and names."""
    found: dict[tuple[Any, ...], Any] = {}
    pending: list[Any] = [obj.state_dict() for obj in state.values()]
    while pending:
        value = pending.pop()
        if _is_dtensor(value):
            found.setdefault(_mesh_key(value.device_mesh), value.device_mesh)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list | tuple):
            pending.extend(value)
    return found


def _from_wire(value: Any, meshes: dict[tuple[Any, ...], Any]) -> Any:
    """The DTensor on this process's mesh if ``value`` is a :func:`_to_wire` record, else
    None."""
    if not (isinstance(value, dict) and _DTENSOR in value):
        return None
    from torch.distributed.tensor import DTensor

    mesh = meshes.get(tuple(value["mesh"]))
    if mesh is None:
        raise ValueError(
            f"cannot load a DTensor on a mesh of shape {value['mesh'][0]} and dims "
            f"{value['mesh'][1]}: the receiving state holds no DTensor on such a mesh"
        )
    return DTensor.from_local(
        value[_DTENSOR],
        mesh,
        value["placements"],
        run_check=False,
        shape=torch.Size(value["shape"]),
        stride=tuple(value["stride"]),
    )


def broadcast_state(
    pg: Any, state: Mapping[str, Stateful], root: int, rank: int
) -> tuple[str, int]:
    """Every member of ``pg`` takes member ``root``'s state: its length, then its bytes.

    Returns this member's role (``sent`` or ``received``) and the bytes moved.
    """
    options = dist.BroadcastOptions()
    options.rootRank = root
    sending = rank == root
    data = serialize(state) if sending else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    pg.broadcast([length], options).wait()
    received = bytearray(int(length[0]) if not sending else 0)
    if not sending:
        data = torch.frombuffer(received, dtype=torch.uint8)
    pg.broadcast([data], options).wait()
    if not sending:
        load(state, received)
    return ("sent" if sending else "received"), data.numel()


class Outgoing:
    """The source's side of a catch-up: a snapshot, sent to each joiner without waiting.

    :meth:`post` starts gloo's sends (they complete when each joiner receives);
    :meth:`finish` waits for them, by the end of the epoch's first step.
    """

    def __init__(self, state: Mapping[str, Stateful]) -> None:
        self.started = time.perf_counter()
        self.data = serialize(state)  # before the step: the state the survivors start from
        self._length = torch.tensor([self.data.numel()], dtype=torch.int64)
        self._works: list[Any] = []

    def post(self, pg: Any, joiners: Sequence[int]) -> None:
        """Send the snapshot to each of ``joiners`` (ranks of ``pg``)."""
        for joiner in joiners:
            self._works.append(pg.send([self._length], joiner, LENGTH_TAG))
            self._works.append(pg.send([self.data], joiner, DATA_TAG))

    def finish(self) -> float:
        """Wait until every joiner received the snapshot; seconds since it was taken."""
        for work in self._works:
            work.wait()
        self._works = []
        return time.perf_counter() - self.started


class Incoming:
    """A joiner's side of a catch-up: the source's snapshot, received while it steps.

    :meth:`start` receives the length (the source sends it once the group
    forms) and posts the receive of the bytes; :meth:`finish` waits for them
    and loads them.
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.received = bytearray()
        self._work: Any = None

    def start(self, pg: Any, source: int) -> None:
        """Receive the snapshot's length from ``source`` (a rank of ``pg``), then post its bytes."""
        length = torch.zeros(1, dtype=torch.int64)
        pg.recv([length], source, LENGTH_TAG).wait()
        self.received = bytearray(int(length[0]))
        data = torch.frombuffer(self.received, dtype=torch.uint8)
        self._work = pg.recv([data], source, DATA_TAG)

    def finish(self, state: Mapping[str, Stateful]) -> float:
        """Wait for the bytes and load them into ``state``; seconds since the catch-up began."""
        self._work.wait()
        load(state, self.received)
        return time.perf_counter() - self.started
