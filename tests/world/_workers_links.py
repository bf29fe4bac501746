"""Workers of test_late_source.py (issue 43, finding 4): a catch-up whose source is late.

Two ranks, each with a gloo group of its own over the world's store (as ``Replicas``
forms an epoch's dp group) wrapped in a :class:`~scopedmesh.fault.links.WatchedGroup`
whose check is a real link to the other rank's listener. The source's registered
``state_dict()`` takes ``late`` seconds, so its sends come that late; the joiner's
receive waits for them, checking the link meanwhile.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scopedmesh.fault.links import Links, WatchedGroup
from scopedmesh.fault.state_transfer import receive_state, send_state


class Slow:
    """A registered state whose ``state_dict()`` takes ``late`` seconds."""

    def __init__(self, late: float, weight: torch.Tensor) -> None:
        self.late, self.weight = late, weight

    def state_dict(self) -> dict[str, Any]:
        time.sleep(self.late)
        return {"weight": self.weight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["weight"])


def late_source(rank: int, world: int, late: float) -> dict[str, Any]:
    """Rank 0 sends its state (``late`` seconds late), rank 1 receives it."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel answers the link for it
    store.set(f"late/address/{rank}", f"127.0.0.1:{listener.getsockname()[1]}")
    peer = (1 - rank, 0, "t")
    links = Links()
    links.retarget({peer: store.get(f"late/address/{1 - rank}").decode()})
    checks: list[str | None] = []

    def check() -> str | None:
        checks.append(links.check(peer))
        return checks[-1]

    prefix = dist.PrefixStore("late/group", store)  # type: ignore[attr-defined]
    pg = dist.ProcessGroupGloo(prefix, rank, world, timedelta(seconds=30))
    group = WatchedGroup(pg, check)
    weight = torch.arange(4096, dtype=torch.float32) if rank == 0 else torch.zeros(4096)
    state = {"model": Slow(late if rank == 0 else 0.0, weight)}
    start = time.monotonic()
    try:
        if rank == 0:
            send_state(group, state, [1])
        else:
            receive_state(group, state, 0)
        error = None
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    seconds = time.monotonic() - start
    store.set(f"late/done/{rank}", "1")  # neither leaves while the other still needs it
    store.wait([f"late/done/{1 - rank}"], timedelta(seconds=60))
    links.close()
    listener.close()
    return {
        "rank": rank,
        "error": error,
        "seconds": seconds,
        "equal": torch.equal(weight, torch.arange(4096, dtype=torch.float32)),
        "checks": len(checks),
        "lost": [c for c in checks if c is not None],
    }
