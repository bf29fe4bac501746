"""Worker functions for test_liveness.py (run in each rank of a world)."""

from __future__ import annotations

import os
import selectors
import signal
import threading
import time
from typing import Any

from scopedmesh.c10d import groups as _c10d
from scopedmesh.fault.liveness import LivenessWatch


def _meet(store: Any, key: str, count: int) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + 60.0
    while int(store.add(key, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add(key, 0)} of {count} reached {key}")
        time.sleep(0.005)


def _wait_lost(watch: LivenessWatch, rank: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while rank not in watch.lost() and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(watch.lost())


def crashed_thread_then_killed(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's watch thread crashes (its selector raises); later rank 0 SIGKILLs rank 1.

    The peers must see rank 1 alive while its process runs (a crashed thread is no
    goodbye), and declare it lost once it is killed.
    """
    store = _c10d.default_store()
    armed = threading.Event()
    if rank == 1:
        base: Any = selectors.DefaultSelector

        class Crashing(base):  # type: ignore[misc, valid-type]
            def select(self, timeout: float | None = None) -> Any:
                if armed.is_set():
                    raise OSError("injected failure of the watch thread's selector")
                return super().select(timeout)

        selectors.DefaultSelector = Crashing  # type: ignore[misc]
    watch = LivenessWatch(interval=0.02, timeout=60)
    out: dict[str, Any] = {"rank": rank}
    _meet(store, "crash/linked", world)
    if rank == 1:
        armed.set()
        watch._thread.join(15.0)
        out["thread_alive"] = watch._thread.is_alive()
        try:
            watch.lost()
        except RuntimeError as error:
            out["error"] = str(error)
        store.set("crash/pid", str(os.getpid()))
        store.set("crash/crashed", "1")
        time.sleep(120)  # rank 0 kills this process
        return out
    store.wait(["crash/crashed"])
    time.sleep(0.5)  # 25 intervals: whatever rank 1's crash sent has been read
    out["lost_while_alive"] = sorted(watch.lost())
    _meet(store, "crash/looked", world - 1)
    if rank == 0:
        os.kill(int(store.get("crash/pid")), signal.SIGKILL)
    out["lost"] = _wait_lost(watch, 1, 15.0)
    out["why"] = watch.why_lost(1)
    watch.close()
    return out
