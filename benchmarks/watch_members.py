"""A process that hosts many liveness-watch members: the scale harness's worker.

    python -m benchmarks.watch_members PORT WORLD FIRST LAST [--interval S]

Members ``FIRST`` .. ``LAST - 1`` of a ``WORLD``-member watch, each a real
:class:`~scopedmesh.LivenessWatch` with its real ring sockets and threads,
talking to the real ``TCPStore`` at ``127.0.0.1:PORT``, and no process group:
the watch module's ``torch.distributed`` is replaced by a stand-in that answers
``get_rank`` and ``get_world_size`` for the member whose thread asks (what a
process group would answer in a one-member-per-process job) and hands
everything else to ``torch.distributed``. Every member's store clients count
their requests (:class:`CountingStore`).

It reads one command per line on stdin and answers one JSON line on stdout:

* ``count``: the store requests its members have made so far;
* ``vanish R``: member ``R`` vanishes as a SIGKILL would make it: its sockets
  close, without a goodbye and without a store request (its threads are left
  blocked); answers the time it vanished;
* ``known R``: how many of its live members have learned that ``R`` died, and
  the latest time one learned it;
* ``agree TAG``: every live member agrees (its own thread), answers the
  decisions, the slowest member's time and the requests made meanwhile;
* ``close``: closes every live member and exits.

A SIGKILL of the whole process (``benchmarks.watch_scale`` places 8 members
in some of them) is a node's death.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from scopedmesh import LivenessWatch
from scopedmesh.fault.liveness import watch as watch_module


class Requests:
    """A count of store requests shared by a process's clients (one lock)."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.count += 1


class CountingStore(dist.Store):  # type: ignore[misc]
    """A store client that counts every request made through it (a clone counts too)."""

    def __init__(self, inner: Any, requests: Requests) -> None:
        super().__init__()
        self.inner, self.requests = inner, requests

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone(), self.requests)

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def _call(self, name: str, *args: Any) -> Any:
        self.requests.add()
        return getattr(self.inner, name)(*args)

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> Any:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def append(self, key: str, value: Any) -> None:
        self._call("append", key, value)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def multi_get(self, keys: list[str]) -> Any:
        return self._call("multi_get", keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", keys, values)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._call("wait", keys)
        else:
            self._call("wait", keys, timeout)


def _stand_in(ranks: dict[int, int], world: int) -> Any:
    """``torch.distributed`` as the watch module sees it: rank by the asking thread."""
    names = {name: getattr(dist, name) for name in dir(dist) if not name.startswith("__")}
    names["get_rank"] = lambda: ranks[threading.get_ident()]
    names["get_world_size"] = lambda: world
    return SimpleNamespace(**names)


def vanish(watch: LivenessWatch) -> None:
    """Close ``watch``'s sockets as its process's death would: no goodbye, no store request."""
    watch._closing = True  # type: ignore[attr-defined]  # its store thread stops once woken
    watch._closed = True  # type: ignore[attr-defined]
    watch._ring.shut(goodbye=False)  # type: ignore[attr-defined]


def main() -> None:
    port, world, first, last = (int(arg) for arg in sys.argv[1:5])
    interval = float(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[5] == "--interval" else 0.02
    requests = Requests()
    base = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600), use_libuv=True
    )
    store = CountingStore(base, requests)
    ranks: dict[int, int] = {}
    watch_module.dist = _stand_in(ranks, world)  # type: ignore[assignment]

    def make(rank: int) -> LivenessWatch:
        ranks[threading.get_ident()] = rank
        return LivenessWatch(interval=interval, timeout=600, host="127.0.0.1", store=store)

    mine = list(range(first, last))
    with ThreadPoolExecutor(max_workers=len(mine)) as pool:
        watches = dict(zip(mine, pool.map(make, mine), strict=True))
    live = dict(watches)
    print(json.dumps({"ready": len(watches)}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "count":
            reply: dict[str, Any] = {"requests": requests.count}
        elif command == "vanish":
            victim = live.pop(int(args[0]))
            vanish(victim)
            reply = {"at": time.time()}
        elif command == "known":
            victim = int(args[0])
            times = [w.learned_at(victim) for w in live.values()]
            learned = [t for t in times if t is not None]
            reply = {"alive": len(live), "known": len(learned), "latest": max(learned or [0.0])}
        elif command == "agree":
            before = requests.count

            def agree(watch: LivenessWatch, tag: str = args[0]) -> tuple[list[int], float]:
                began = time.monotonic()
                lost = sorted(watch.agree(tag=tag))
                return lost, time.monotonic() - began

            with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
                done = list(pool.map(agree, live.values()))
            decisions = sorted({tuple(lost) for lost, _ in done})
            reply = {
                "decisions": [list(d) for d in decisions],
                "took": max(t for _, t in done) if done else 0.0,
                "requests": requests.count - before,
                "members": len(live),
            }
        elif command == "close":
            with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
                list(pool.map(LivenessWatch.close, live.values()))
            print(json.dumps({"closed": len(live)}), flush=True)
            return
        else:
            reply = {"error": f"unknown command {command!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
