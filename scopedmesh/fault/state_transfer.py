"""A replica's registered state, moved to other replicas on an epoch's dp group,
tensor by tensor, into the receivers' own tensors.

The source sends a **header** (its ``state_dict()``s with each tensor replaced
by a reference, and each tensor's dtype and shape: a small ``torch.save`` blob),
then each tensor's bytes straight from its live storage (a tensor on the group's
device is not copied: the CPU for gloo, this process's CUDA device for NCCL;
another is staged through one copy on that device at a time). A receiver takes
each tensor into its own tensor at the same place of its own ``state_dict()``
(same dtype and shape), or into a new one on its own device, then calls
``load_state_dict``. The extra memory on either side is about the largest
tensor, never the whole state.

Two ways: :func:`broadcast_state` (every member takes the source's state: the
first epoch and every heal, at a boundary) and a **catch-up** (an admission:
inside the epoch's first step the source sends to the fresh joiners alone,
:func:`send_state` / :func:`receive_state`, before the step's all-reduce: the
joiner holds the state the source holds at that moment, RNG and counters the
loop moved since the boundary included).

>>> model, other = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
>>> header, tensors = pack({"model": model})
>>> [tuple(t.shape) for t in tensors]
[(1, 2), (1,)]
>>> mine = own_tensors({"model": other})
>>> plan = unpack_header(bytes(header.tolist()), {"model": other})
>>> for index, (path, dtype, shape) in enumerate(plan.slots):
...     _ = mine[path].copy_(tensors[index])  # what the wire does, byte for byte
>>> plan.load({"model": other}, [mine[p] for p, _, _ in plan.slots])
>>> torch.equal(model.weight, other.weight)
True
"""

from __future__ import annotations

import functools
import importlib
import io
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from scopedmesh.errors import JobMismatchError

__all__ = [
    "CollectiveFailed",
    "Stateful",
    "Transfer",
    "broadcast_state",
    "local",
    "own_tensors",
    "pack",
    "receive_state",
    "send_state",
    "unpack_header",
    "wire_device",
]

LENGTH_TAG, HEADER_TAG, FIRST_TENSOR_TAG = 1, 2, 3  # gloo's send/recv tags
MAX_HEADER = 1 << 31  # bytes: a header length beyond this is corrupt, not state


class Stateful(Protocol):
    """What a replica registers: torch's ``state_dict`` / ``load_state_dict`` pair."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class CollectiveFailed(RuntimeError):
    """A collective or point-to-point operation of the dp group failed (a peer died or
    dropped the group). Anything else a transfer raises is an error of the state."""


class UnmovableState(Exception):
    """The source could not pack its registered state (raised there, chained to why),
    or, on a receiver, the source said so (a header length of -1): no replica can
    take the job's state from it, and the group is intact (nothing else was sent)."""


UNMOVABLE = -1  # the header length a source sends when it cannot pack its state


@dataclass(frozen=True)
class Transfer:
    """One state transfer: ``epoch``, ``role`` (``sent`` or ``received``), ``nbytes``,
    ``seconds`` (from its start until the last byte left or was loaded)."""

    epoch: int
    role: str
    nbytes: int
    seconds: float


def run(call: Callable[[], Any]) -> None:
    """Issue one operation of the dp group and wait for it; :class:`CollectiveFailed` if
    either fails."""
    try:
        call().wait()
    except Exception as error:
        raise CollectiveFailed(_first_line(error)) from error


def post(call: Callable[[], Any]) -> Any:
    """Issue one operation of the dp group without waiting (:class:`CollectiveFailed`)."""
    try:
        return call()
    except Exception as error:
        raise CollectiveFailed(_first_line(error)) from error


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0][:300] if text else type(error).__name__


def wait_all(works: list[Any]) -> None:
    """Wait for every posted operation (:class:`CollectiveFailed` at the first that failed)."""
    for work in works:
        wait(work)
    works.clear()


def wait(work: Any) -> None:
    """Wait for one posted operation (:class:`CollectiveFailed` if it failed)."""
    try:
        work.wait()
    except Exception as error:
        raise CollectiveFailed(_first_line(error)) from error


# ------------------------------------------------------------------ the header

_REF = "__scopedmesh_tensor__"
_DTENSOR = "__scopedmesh_dtensor_shard__"
Path = tuple[Any, ...]


def local(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's shard (dicts, lists and tuples
    walked): what a digest or a comparison of registered state reads.

    >>> local({"a": [torch.ones(1)], "b": 2})
    {'a': [tensor([1.])], 'b': 2}
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [local(v) for v in value]
    return value


def pack(state: Mapping[str, Stateful]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``state``'s ``state_dict()``s as a header (uint8 bytes) and their tensors, in order.

    The tensors are the live ones (detached, not copied). A DTensor (FSDP2)
    travels as its local shard, with its placements and its mesh's shape and
    dimension names; the receiver rebuilds it on its own mesh of that kind.
    """
    tensors: list[torch.Tensor] = []

    def take(value: Any) -> Any:
        wire = _to_wire(value)
        if wire is not None:
            return _mapped(wire, take)
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized:
                raise TypeError(f"a registered tensor must be dense, got {value.layout}")
            tensors.append(value.detach())
            return {_REF: len(tensors) - 1}
        return None

    tree = {name: _mapped(obj.state_dict(), take) for name, obj in state.items()}
    meta = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.device.type) for t in tensors]
    buffer = io.BytesIO()
    torch.save({"tree": tree, "meta": meta}, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8), tensors


def own_tensors(state: Mapping[str, Stateful]) -> dict[Path, torch.Tensor]:
    """This process's tensors in ``state``'s ``state_dict()``s, by their place (a DTensor's
    local shard at its wire record's place)."""
    found: dict[Path, torch.Tensor] = {}
    for name, obj in state.items():
        tree = _mapped(obj.state_dict(), _to_wire)
        for path, leaf in _leaves(tree, (name,)):
            if isinstance(leaf, torch.Tensor):
                found[path] = leaf.detach()
    return found


@dataclass(frozen=True)
class Plan:
    """A received header: the tree to load and, per tensor, its place, dtype and shape
    (``slots``) and the type of the source's device (``devices``)."""

    tree: dict[str, Any]
    slots: list[tuple[Path, torch.dtype, tuple[int, ...]]]
    sharded: bool
    devices: list[str]

    def load(self, state: Mapping[str, Stateful], values: Sequence[torch.Tensor]) -> None:
        """Put ``values`` (the tensors, in order) in the tree and load it into ``state``."""

        def fill(value: Any) -> Any:
            if isinstance(value, dict) and len(value) == 1 and _REF in value:
                return values[value[_REF]]
            return None

        meshes = _meshes(state) if self.sharded else {}
        for name, obj in state.items():
            value = _mapped(self.tree[name], fill)
            if self.sharded:
                value = _mapped(value, lambda v: _from_wire(v, meshes))
            obj.load_state_dict(value)


def unpack_header(header: bytes | bytearray, state: Mapping[str, Stateful]) -> Plan:
    """The :class:`Plan` of a :func:`pack` header (``weights_only``, onto the CPU); a
    ``ValueError`` if it does not name exactly ``state``'s names."""
    data = header
    sharded = _DTENSOR.encode() in data
    if sharded:  # its import allowlists placements for weights_only
        importlib.import_module("torch.distributed.tensor")
    loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not (isinstance(loaded, dict) and {"tree", "meta"} <= set(loaded)):
        raise ValueError("the source's header is not a scopedmesh state header")
    tree, meta = loaded["tree"], loaded["meta"]
    if set(tree) != set(state):
        raise ValueError(
            f"the source's registered state has the names {sorted(tree)}, this replica's "
            f"{sorted(state)}: every replica must register the same names"
        )
    places = dict((index, path) for path, index in _refs(tree, ()))
    slots, devices = [], []
    for index, (dtype_name, shape, device_type) in enumerate(meta):
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype) or index not in places:
            raise ValueError(f"the source's header is corrupt at tensor {index} ({dtype_name})")
        slots.append((places[index], dtype, tuple(int(s) for s in shape)))
        devices.append(str(device_type))
    return Plan(tree, slots, sharded, devices)


_CPU = torch.device("cpu")


def wire_device(pg: Any) -> torch.device:
    """The device ``pg`` sends from and receives into: a
    :class:`~scopedmesh.fault.dp_groups.DeviceGroup`'s (NCCL: CUDA), else the CPU (gloo)."""
    device = getattr(pg, "wire_device", None)
    return device if isinstance(device, torch.device) else _CPU


def _wire(tensor: torch.Tensor, device: torch.device = _CPU) -> torch.Tensor | None:
    """``tensor``'s bytes as a uint8 view, or None when it needs a copy on ``device`` first.

    >>> _wire(torch.zeros(2, dtype=torch.int16)).tolist(), _wire(torch.zeros(2, 2).t())
    ([0, 0, 0, 0], None)
    """
    if tensor.device != device or not tensor.is_contiguous() or tensor.is_sparse:
        return None
    return tensor.reshape(-1).view(torch.uint8)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Staging:
    """One buffer of ``size`` bytes on the group's ``device`` (the largest tensor that is
    not a contiguous one there), reused for each such tensor in turn: a tensor's bytes
    go in (:meth:`put`) or come out (:meth:`room`, then :meth:`settle`)."""

    def __init__(self, size: int, device: torch.device = _CPU) -> None:
        self._buffer = torch.empty(size, dtype=torch.uint8, device=device)

    def room(self, nbytes: int) -> torch.Tensor:
        return self._buffer[:nbytes]

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        view = self.room(_nbytes(tensor))
        view.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return view

    def settle(self, target: torch.Tensor) -> None:
        target.copy_(self.room(_nbytes(target)).view(target.dtype).view(target.shape))


def _stage_for(tensors: Iterable[torch.Tensor], device: torch.device) -> _Staging:
    size = max((_nbytes(t) for t in tensors if _wire(t, device) is None), default=0)
    return _Staging(size, device)


class _Receiver:
    """Where each incoming tensor lands: into this process's own tensor at its place (same
    dtype and shape), else into a new one: on its counterpart's device if it has one,
    else on this process's device of the source's kind (a CPU tensor stays on the CPU,
    as Adam's ``step`` must; a CUDA one goes to this process's CUDA device)."""

    def __init__(self, state: Mapping[str, Stateful], plan: Plan, device: torch.device) -> None:
        self.own = own_tensors(state)
        self.plan, self.device = plan, device
        self.values: list[torch.Tensor] = []

    def mismatched(self) -> list[tuple[Path, tuple[int, ...], tuple[int, ...]]]:
        """The places where this process has a tensor of another shape than the source's:
        (place, own shape, source's shape)."""
        found = []
        for path, _, shape in self.plan.slots:
            own = self.own.get(path)
            if own is not None and tuple(own.shape) != shape:
                found.append((path, tuple(own.shape), shape))
        return found

    def target(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor that will hold tensor ``index``, and its uint8 view to receive into
        (None: receive through the staging buffer)."""
        path, dtype, shape = self.plan.slots[index]
        own = self.own.get(path)
        if own is not None and own.dtype == dtype and tuple(own.shape) == shape:
            self.values.append(own)
            return own, _wire(own, self.device)
        kind = self.plan.devices[index]
        device = own.device if own is not None else _device_for(kind, self.own.values())
        fresh = torch.empty(shape, dtype=dtype, device=device)
        self.values.append(fresh)
        return fresh, _wire(fresh, self.device)


def _device_for(kind: str, own: Iterable[torch.Tensor]) -> torch.device:
    """This process's device of type ``kind``: the one its own state uses, else the
    current CUDA device, else the CPU.

    >>> _device_for("cpu", [torch.zeros(1, device="meta")])
    device(type='cpu')
    >>> _device_for("meta", [torch.zeros(1, device="meta")])
    device(type='meta')
    """
    if kind == "cpu":
        return torch.device("cpu")
    for tensor in own:
        if tensor.device.type == kind:
            return torch.device(tensor.device)
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ the two ways


def broadcast_state(
    pg: Any, state: Mapping[str, Stateful], root: int, rank: int
) -> tuple[str, int]:
    """Every member of ``pg`` takes member ``root``'s state: the header's length, the
    header, then each tensor. Returns this member's role and the bytes moved."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    device = wire_device(pg)

    def cast(tensor: torch.Tensor) -> Any:
        return post(lambda: pg.broadcast([tensor], options))

    if rank == root:
        header, tensors = _packed(state, lambda length: run(lambda: cast(length)))
        run(lambda: cast(torch.tensor([header.numel()], dtype=torch.int64)))
        run(lambda: cast(header))
        nbytes, works, staging = header.numel(), [], _stage_for(tensors, device)
        for tensor in tensors:
            view = _wire(tensor, device)
            if view is None:
                wait(cast(staging.put(tensor)))  # one staged tensor at a time
            else:
                works.append(cast(view))
            nbytes += _nbytes(tensor)
        wait_all(works)
        return "sent", nbytes
    length = torch.zeros(1, dtype=torch.int64)
    run(lambda: cast(length))
    received = bytearray(_checked_length(length))
    run(lambda: cast(torch.frombuffer(received, dtype=torch.uint8)))
    plan = unpack_header(received, state)
    received_bytes = _take(plan, state, lambda view, index: cast(view), device)
    return "received", received_bytes + len(received)


def send_state(pg: Any, state: Mapping[str, Stateful], joiners: Sequence[int]) -> int:
    """Send this member's state to each of ``joiners`` (ranks of ``pg``); return the bytes
    sent to each. Waits until every joiner received everything."""

    def refuse(length: torch.Tensor) -> None:
        for joiner in joiners:
            run(functools.partial(pg.send, [length], joiner, LENGTH_TAG))

    header, tensors = _packed(state, refuse)
    length = torch.tensor([header.numel()], dtype=torch.int64)
    works: list[Any] = []
    device = wire_device(pg)
    staging = _stage_for(tensors, device)
    for joiner in joiners:
        works.append(post(functools.partial(pg.send, [length], joiner, LENGTH_TAG)))
        works.append(post(functools.partial(pg.send, [header], joiner, HEADER_TAG)))
        for index, tensor in enumerate(tensors):
            view, tag = _wire(tensor, device), FIRST_TENSOR_TAG + index
            if view is None:  # one staged tensor at a time
                run(functools.partial(pg.send, [staging.put(tensor)], joiner, tag))
            else:
                works.append(post(functools.partial(pg.send, [view], joiner, tag)))
    wait_all(works)
    return header.numel() + sum(_nbytes(t) for t in tensors)


def receive_state(pg: Any, state: Mapping[str, Stateful], source: int) -> int:
    """Receive ``source``'s state (a rank of ``pg``) into ``state``'s own tensors, then
    load it; return the bytes received."""
    length = torch.zeros(1, dtype=torch.int64)
    run(lambda: pg.recv([length], source, LENGTH_TAG))
    header = bytearray(_checked_length(length))
    run(lambda: pg.recv([torch.frombuffer(header, dtype=torch.uint8)], source, HEADER_TAG))
    plan = unpack_header(header, state)

    def recv(view: torch.Tensor, index: int) -> Any:
        return post(lambda: pg.recv([view], source, FIRST_TENSOR_TAG + index))

    return _take(plan, state, recv, wire_device(pg)) + len(header)


def _take(
    plan: Plan,
    state: Mapping[str, Stateful],
    transport: Callable[[torch.Tensor, int], Any],
    device: torch.device = _CPU,
) -> int:
    """Receive each tensor of ``plan`` with ``transport(view, index)`` (a posted
    operation on a group whose tensors live on ``device``), then load; return the
    tensors' bytes."""
    receiver, works = _Receiver(state, plan, device), []
    targets = [receiver.target(index) for index in range(len(plan.slots))]
    size = max((_nbytes(t) for t, view in targets if view is None), default=0)
    staging = _Staging(size, device)
    for index, (target, view) in enumerate(targets):
        if view is None:  # one staged tensor at a time
            wait(transport(staging.room(_nbytes(target)), index))
            staging.settle(target)
        else:
            works.append(transport(view, index))
    nbytes = sum(_nbytes(t) for t, _ in targets)
    wait_all(works)
    try:
        plan.load(state, receiver.values)
    except Exception as error:
        differ = receiver.mismatched()
        if not differ:
            raise
        raise JobMismatchError(mismatch_message(differ, error)) from error
    return nbytes


def mismatch_message(
    differ: Sequence[tuple[Path, tuple[int, ...], tuple[int, ...]]], error: BaseException
) -> str:
    """Why a received state does not fit: each tensor (its key in the registered state)
    whose shape differs, with both shapes, and the error its load raised.

    >>> print(mismatch_message([(("w", "buf"), (1024,), (512,))], RuntimeError("size")))
    the source's tensor state['w']['buf'] has shape (512,), this replica's (1024,): the replicas run different programs (a model or configuration that differs), so a restart will not help; fix the program (load_state_dict raised RuntimeError: size)
    """
    shown = [
        f"state{''.join(f'[{p!r}]' for p in path)} has shape {theirs}, this replica's {own}"
        for path, own, theirs in differ[:3]
    ]
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    return (
        f"the source's tensor {'; '.join(shown)}{more}: the replicas run different programs "
        f"(a model or configuration that differs), so a restart will not help; fix the "
        f"program (load_state_dict raised {type(error).__name__}: {_first_line(error)})"
    )


def _packed(
    state: Mapping[str, Stateful], refuse: Callable[[torch.Tensor], None]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`pack`; if it raises, ``refuse`` tells the receivers (a length of -1) and
    :class:`UnmovableState` says why."""
    try:
        return pack(state)
    except Exception as error:
        refuse(torch.tensor([UNMOVABLE], dtype=torch.int64))
        raise UnmovableState(f"{type(error).__name__}: {error}") from error


def _checked_length(length: torch.Tensor) -> int:
    value = int(length[0])
    if value == UNMOVABLE:
        raise UnmovableState("the source could not pack its registered state (its error says why)")
    if not 0 < value <= MAX_HEADER:
        raise ValueError(f"the source's header length is {value} bytes: corrupt")
    return value


# ------------------------------------------------------------------ the tree walk


def _is_dtensor(value: object) -> bool:
    module = type(value).__module__
    return module.startswith("torch.distributed.tensor") and type(value).__name__ == "DTensor"


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))


def _mapped(value: Any, convert: Callable[[Any], Any]) -> Any:
    """``value`` with each part that ``convert`` answers (not None) replaced by its answer,
    through dicts (an ``OrderedDict`` keeps its type and torch's ``_metadata``), lists
    and tuples; a container is copied only where a part changed."""
    replaced = convert(value)
    if replaced is not None:
        return replaced
    if type(value) in (dict, OrderedDict):
        items = {k: _mapped(v, convert) for k, v in value.items()}
        if all(items[k] is value[k] for k in value):
            return value
        copy = type(value)(items)
        if hasattr(value, "_metadata"):
            copy._metadata = value._metadata  # torch's module versions
        return copy
    if type(value) in (list, tuple):
        converted = [_mapped(v, convert) for v in value]
        same = all(a is b for a, b in zip(converted, value))
        return value if same else type(value)(converted)
    return value


def _leaves(value: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _refs(value: Any, path: Path) -> Iterator[tuple[Path, int]]:
    """The places of a header tree's tensor references, with their indices."""
    if isinstance(value, dict) and len(value) == 1 and _REF in value:
        yield path, int(value[_REF])
    elif type(value) in (dict, OrderedDict):
        for key, item in value.items():
            yield from _refs(item, (*path, key))
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _refs(item, (*path, i))


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


def timed(work: Callable[[], int]) -> tuple[int, float]:
    """``work()``'s bytes and the seconds it took.

    >>> timed(lambda: 3)[0]
    3
    """
    start = time.perf_counter()
    nbytes = work()
    return nbytes, time.perf_counter() - start
