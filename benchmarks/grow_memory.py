"""A state transfer's extra peak memory: ``python -m benchmarks.grow_memory [--mib 256]``.

Two gloo ranks on 127.0.0.1: rank 0 (the source) sends its registered state (a
module of ``--tensors`` float32 parameters, ``--mib`` MiB in all, with a
counter and the RNG beside it) to rank 1 (a joiner holding its own state of
the same shapes), once as :class:`~scopedmesh.fault.replicas.Replicas` does now
(:func:`~scopedmesh.fault.state_transfer.send_state` /
:func:`~scopedmesh.fault.state_transfer.receive_state`: a header, then each
tensor into the joiner's own), and once more with every tensor not contiguous (``staged``: each goes
through one contiguous CPU copy on either side, one at a time), and once as it
did before (``blob``: one
``torch.save`` of the whole state, its length and bytes, ``torch.load`` and
``load_state_dict``). Each rank measures its peak resident memory during the
transfer over its resident memory before it (Linux: ``VmHWM`` reset through
``/proc/self/clear_refs``), so the figure is the transfer's own: what it
allocated and touched beyond the state both sides already hold.

>>> parser().parse_args([]).mib
256
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.fault.state_transfer import receive_state, send_state
from scopedmesh.testing.launcher import run_world


class Progress:
    """A counter and the RNG, registered beside the model."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state["samples"])
        torch.set_rng_state(state["rng"])


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS


def _state(mib: int, tensors: int, value: float, staged: bool) -> dict[str, Any]:
    """``tensors`` parameters of ``mib`` MiB in all; ``staged``: each a transposed (not
    contiguous) view, which the transfer stages through a contiguous CPU copy."""
    numel = mib * 2**20 // 4 // tensors

    def one(i: int) -> torch.Tensor:
        if staged:
            return torch.full((1024, numel // 1024), value + i).t()
        return torch.full((numel,), value + i)

    model = torch.nn.ParameterList([torch.nn.Parameter(one(i)) for i in range(tensors)])
    return {"model": model, "progress": Progress()}


def _blob_send(pg: Any, state: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in state.items()}, buffer)
    data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    pg.send([torch.tensor([data.numel()], dtype=torch.int64)], 1, 1).wait()
    pg.send([data], 1, 2).wait()


def _blob_receive(pg: Any, state: dict[str, Any]) -> None:
    length = torch.zeros(1, dtype=torch.int64)
    pg.recv([length], 0, 1).wait()
    received = bytearray(int(length[0]))
    pg.recv([torch.frombuffer(received, dtype=torch.uint8)], 0, 2).wait()
    loaded = torch.load(io.BytesIO(received), weights_only=True)
    for name, obj in state.items():
        obj.load_state_dict(loaded[name])


def rank_main(rank: int, world_size: int, mib: int, tensors: int, way: str) -> dict[str, Any]:
    """One side of one transfer: its extra peak memory and seconds."""
    pg = dist.group.WORLD
    state = _state(mib, tensors, float(rank), way == "staged")
    state["progress"].samples = 100 * (rank + 1)
    dist.barrier()
    _reset_peak()
    before, start = _status("VmRSS"), time.perf_counter()
    if way in ("tensor", "staged"):
        if rank == 0:
            send_state(pg, state, [1])
        else:
            receive_state(pg, state, 0)
    elif rank == 0:
        _blob_send(pg, state)
    else:
        _blob_receive(pg, state)
    seconds = time.perf_counter() - start
    extra = _status("VmHWM") - before
    equal = all(float(p.detach().reshape(-1)[0]) == float(i) for i, p in enumerate(state["model"]))
    equal = equal and state["progress"].samples == 100
    dist.barrier()
    return {"extra": extra, "seconds": seconds, "equal": equal}


def parser() -> argparse.ArgumentParser:
    """This module's arguments."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of registered state")
    parser.add_argument("--tensors", type=int, default=16, help="how many tensors hold it")
    parser.add_argument(
        "--ways",
        default="tensor,staged,blob",
        help="tensor (now), staged (now, every tensor not contiguous), blob (before)",
    )
    return parser


def main() -> int:
    args = parser().parse_args()
    largest = args.mib / args.tensors
    load = os.getloadavg()
    print(
        f"grow_memory: {args.mib} MiB of state in {args.tensors} float32 tensors "
        f"(largest {largest:g} MiB) + a counter and the RNG, gloo, 2 ranks; "
        f"load {load[0]:.1f}/{load[1]:.1f}"
    )
    print("way      source extra peak   joiner extra peak   seconds  joiner equal")
    for way in args.ways.split(","):
        source, joiner = run_world(rank_main, 2, args=(args.mib, args.tensors, way), timeout=600)
        print(
            f"{way:7}  {source['extra'] / 2**20:10.1f} MiB  {joiner['extra'] / 2**20:14.1f} MiB"
            f"  {joiner['seconds']:8.2f}  {joiner['equal']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
