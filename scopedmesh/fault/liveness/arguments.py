"""What a liveness watch checks of its arguments, and what its last member deletes.

>>> check_interval(0.5)
0.5
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from scopedmesh.c10d.checks import sorted_ranks
from scopedmesh.c10d.store import WatchKeys, read
from scopedmesh.errors import shown
from scopedmesh.fault.liveness.deaths import parse_deaths

__all__ = ["MAX_INTERVAL", "check_interval", "check_members", "clean_up"]

MAX_INTERVAL = 60.0  # seconds: an interval longer than this is a mistake, not a choice


def check_interval(interval: object) -> float:
    """``interval`` as positive finite seconds (at most :data:`MAX_INTERVAL`), or an error."""
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise TypeError(f"interval must be a number of seconds, got {shown(interval)}")
    seconds = float(interval) if abs(interval) < 1e300 else math.inf
    if not (0 < seconds <= MAX_INTERVAL):  # NaN fails this too
        raise ValueError(
            f"interval must be a positive number of seconds (at most {MAX_INTERVAL:g}), "
            f"got {shown(interval)}"
        )
    return seconds


def check_members(
    ranks: Iterable[int] | None, host: object, store: object, *, world: int, rank: int
) -> list[int]:
    """The watch's members (sorted global ranks of a WORLD of ``world``, ``rank`` among
    them), or an error naming the bad argument (``host`` and ``store`` are checked too)."""
    if host is not None and (not isinstance(host, str) or not host):
        raise TypeError(f"host must be a non-empty str or None, got {shown(host)}")
    if store is not None and not isinstance(store, dist.Store):  # type: ignore[attr-defined]
        raise TypeError(f"store must be a torch.distributed Store or None, got {shown(store)}")
    members = list(range(world)) if ranks is None else sorted_ranks(ranks)
    if not members:
        raise ValueError("ranks must hold at least one rank")
    if members[-1] >= world:
        raise ValueError(f"ranks must be ranks of WORLD (0..{world - 1}), got {members[-1]}")
    if rank not in members:
        raise ValueError(f"this rank ({rank}) must be one of ranks {shown(members)}")
    return members


def clean_up(store: Any, keys: WatchKeys, rank: int, ranks: tuple[int, ...]) -> None:
    """The last member to close (the lost ones never will) deletes the watch's keys.

    Each member appends itself to the list of those closed, unless the list of
    deaths holds it (a departure, or a rank declared dead that was alive: the
    others count it there, and an entry of its own could outlive the clean-up);
    once the closed and the dead account for every member, the clean-up runs.
    Nothing is written once the clean-up ran (the list of deaths is gone).
    Requests never wait for a key. Only the keys written, each once: the lists
    of the closed, deaths, stops, asks and tags, each agreement's keys (its tag appears once per member on
    the list: counted once; a claim per dead member), the dead members'
    addresses (the others deleted their own), every member's wake key (a
    wake-up may have re-made a closed member's) and the dead members'
    declaration counts. O(keys written), never O(members x tags).
    """
    deaths = read(store, keys.lost)
    if deaths is None:  # the others closed and cleaned up already
        return
    dead = sorted(set(parse_deaths(deaths)).intersection(ranks))
    if rank in dead:
        return
    store.append(keys.closed, f"{rank},")
    closed = {int(r) for r in (read(store, keys.closed) or "").split(",") if r}
    if len(closed.union(dead)) < len(ranks):  # a rank both closed and dead: once
        return
    tags = read(store, keys.tags)
    doomed = [keys.closed, keys.lost, keys.stops, keys.asks]
    doomed += [keys.tags] if tags is not None else []
    for tag in dict.fromkeys(tag for tag in (tags or "").split("\n") if tag):
        doomed += keys.agreement(tag).all(dead)
    doomed += [keys.addr(r) for r in dead] + [keys.declared(r) for r in dead]
    doomed += [keys.wake(r) for r in ranks]
    for key in doomed:
        store.delete_key(key)
