"""Workers for tests/world/test_watch.py: watches that close while their peers observe."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from scopedmesh.c10d import groups as _c10d
from scopedmesh.fault.liveness import LivenessWatch


def _meet(store: Any, key: str, count: int, timeout: float = 60.0) -> None:
    """Wait (polling, bounded) until ``key`` counts ``count`` arrivals; this rank arrives first."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: {store.add(key, 0)} of {count} arrived")
        time.sleep(0.002)


def close_and_observe(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """``rounds`` watches in a row; in each, a block of ranks closes while the others watch on.

    Round ``r``'s leavers are ``r % (world - 1) + 1`` ring neighbours from rank
    ``r % world``: they close their watches together (as the ranks of a dropped
    slice do after a heal); every other rank waits until all of them have
    closed, lets its watch see the sockets end, and records what it learned.
    Returns the rounds in which this rank counted a leaver as lost.
    """
    store = _c10d.default_store()
    wrong: list[tuple[int, list[int]]] = []
    relinks = 0
    for r in range(rounds):
        first, size = r % world, r % (world - 1) + 1
        leavers = {(first + i) % world for i in range(size)}
        watch = LivenessWatch(interval=0.005, timeout=60)
        _meet(store, f"observe/{r}/linked", world)
        if rank in leavers:
            watch.close()
            store.add(f"observe/{r}/closed", 1)
        else:
            _meet(store, f"observe/{r}/closed", size + 1)
            # The leavers' sockets are closed: this rank's watch relinks past them to
            # the next observer (bounded wait), then every observer lets its watch read
            # what is left to read before looking.
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                link = watch._ring.succ
                if link is not None and link[0] not in leavers:
                    break
                time.sleep(0.005)
            _meet(store, f"observe/{r}/relinked", world - size)
            time.sleep(0.05)  # ten intervals: end-of-file on the peer sockets is read too
            if watch.lost():
                wrong.append((r, sorted(watch.lost())))
            relinks += len(watch._ring.left & leavers)
            watch.close()
        _meet(store, f"observe/{r}/done", world)
    return {"rank": rank, "wrong": wrong, "relinks": relinks}


def held_then_settled(rank: int, world: int, settle: bool) -> dict[str, Any]:
    """A group aborted while its collective was in flight, then that collective completes.

    Rank 1 starts an all_reduce on the 2-rank group, is interrupted while it is
    in flight (the group is held, not closed: gloo's destructor would wait for
    it), and rank 0 then joins, so the collective completes. Rank 0, which
    nobody interrupted, goes on to a second all_reduce on the group. Rank 1
    then settles the group (if ``settle``) and waits until rank 0 is done
    before closing its mesh. Returns how rank 0's second all_reduce ended: a
    closed connection at once, or (held open) the group's 8 s timeout.
    """
    import torch
    import torch.distributed as dist

    from scopedmesh.c10d.closable import ClosableGroup
    from scopedmesh.mesh import ProcessGroupMesh

    store = _c10d.default_store()
    out: dict[str, Any] = {"rank": rank}
    with ProcessGroupMesh(2, names=("tp",), timeout=8) as mesh:
        mesh.create_groups("tp")
        (group,) = mesh._table.groups()
        assert isinstance(group, ClosableGroup)
        handle = mesh.get_group_along_axis("tp")
        if rank == 1:
            work = dist.all_reduce(torch.ones(1), group=handle, async_op=True)
            out["interrupt_closed"] = group.interrupt("the test interrupted it")
            store.set("held/interrupted", "1")
            assert work is not None
            work.wait()  # rank 0 joins: the collective completes
            del work  # a finished collective's handle keeps gloo's connections too
            out["settled"] = group.settle() if settle else False
            store.set("held/settled", "1")
            store.wait(["held/second-done"], timedelta(seconds=60))
        else:
            store.wait(["held/interrupted"], timedelta(seconds=60))
            dist.all_reduce(torch.ones(1), group=handle)  # completes rank 1's collective
            store.wait(["held/settled"], timedelta(seconds=60))
            try:
                dist.all_reduce(torch.ones(1), group=handle)
                out["second"] = "completed"
            except RuntimeError as error:
                out["second"] = str(error)[:300]
            store.set("held/second-done", "1")
    return out


def _killer(store: Any, victim: int, after: int, delay: float) -> None:
    """Once every rank has finished ``after`` collectives, wait ``delay`` s, then SIGKILL
    ``victim``: from outside it, at a moment it does not choose."""
    import os
    import signal

    store.wait([f"inside/{victim}/pid"], timedelta(seconds=60))
    pid = int(store.get(f"inside/{victim}/pid"))
    deadline = time.monotonic() + 60.0
    while int(store.add("inside/ready", 0)) < int(store.get("inside/world")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)


def killed_inside_a_collective(
    rank: int, world: int, victim: int, delay: float, axis_size: int
) -> dict[str, Any]:
    """Every rank runs all_reduces back to back along a guarded mesh's ``dp`` axis
    (``axis_size`` members per group) until ``victim`` is SIGKILLed by a thread of
    rank 0 (rank 1 if the victim is 0), which itself goes on with its collectives. Each survivor heals inside its
    ``except`` block, as a training loop does, then runs 3 more all_reduces on the
    re-formed mesh. Returns how its collective ended and what it agreed on.
    """
    import os
    import threading

    import torch
    import torch.distributed as dist

    from scopedmesh import LostRankError
    from scopedmesh.mesh import ProcessGroupMesh

    store = _c10d.default_store()
    store.set(f"inside/{rank}/pid", str(os.getpid()))
    store.set("inside/world", str(world))
    out: dict[str, Any] = {"rank": rank}
    watch = LivenessWatch(interval=0.02, timeout=60)
    shape = (axis_size, world // axis_size)
    mesh = watch.guard(ProcessGroupMesh(*shape, names=("dp", "tp"), timeout=60))
    mesh.create_groups("dp")
    if rank == (1 if victim == 0 else 0):
        args = (store, victim, 20, delay)
        threading.Thread(target=_killer, args=args, daemon=True).start()
    done = 0
    try:
        while True:
            dist.all_reduce(torch.ones(1), group=mesh.get_group_along_axis("dp"))
            done += 1
            if done == 20:
                store.add("inside/ready", 1)
    except RuntimeError as error:
        out["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        try:
            mesh = watch.heal(mesh, "dp")  # inside the except block: the traceback lives on
        except LostRankError as sat_out:
            out["sat_out"] = str(sat_out)[:200]
    out["lost"] = sorted(watch.lost())
    if "sat_out" not in out:
        out["shape"] = list(mesh.shape)
        sums = []
        for _ in range(3):
            t = torch.ones(1)
            dist.all_reduce(t, group=mesh.get_group_along_axis("dp"))
            sums.append(t.item())
        out["sums"] = sums
    mesh.close()
    watch.close()
    return out


def refused_after_the_abort(rank: int, world: int) -> dict[str, Any]:
    """A guarded 2 x 2 (dp, tp) mesh whose rank 3 SIGKILLs itself once every rank has
    formed its dp group and made a DeviceMesh. Once its watch has learned of the death,
    each survivor asks for what the mesh has and has not made yet; every answer must be
    ``MeshClosedError``. Then it heals: ranks 0 and 1 go on in a 1 x 2 mesh."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    from scopedmesh import LostRankError
    from scopedmesh.mesh import ProcessGroupMesh

    store = _c10d.default_store()
    out: dict[str, Any] = {"rank": rank}
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=60))
    dp = mesh.get_group_along_axis("dp")
    dist.all_reduce(torch.ones(1), group=dp)
    device_mesh = mesh.to_device_mesh("cpu", axes=("dp",))
    _meet(store, "refused/ready", world)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while 3 not in watch.lost() and time.monotonic() < deadline:
        time.sleep(0.005)
    out["lost"] = sorted(watch.lost())
    attempts = {
        "tp, first requested now": lambda: mesh.get_group_along_axis("tp"),
        "dp, formed before": lambda: dist.all_reduce(torch.ones(1), group=dp),
        "dp, asked again": lambda: mesh.get_group_along_axis("dp"),
        "dp + tp": lambda: mesh.get_group_along_axis(("dp", "tp")),
        "a sub-mesh's tp": lambda: mesh.submesh("tp").get_group_along_axis("tp"),
        "the DeviceMesh's group": lambda: device_mesh.get_group("dp"),
    }
    out["answers"] = {}
    for what, attempt in attempts.items():
        try:
            attempt()
            out["answers"][what] = "served"
        except Exception as error:
            out["answers"][what] = f"{type(error).__name__}: {str(error)[:400]}"
    try:
        mesh = watch.heal(mesh, "dp")
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.get_group_along_axis("tp"))
        out["healed"] = (list(mesh.shape), t.item())
    except LostRankError:
        out["healed"] = "sat out"
    mesh.close()
    watch.close()
    return out


class FailingStore:
    """A store whose ``method`` raises for its next ``failures`` calls once armed."""

    def __init__(self, store: Any, method: str, failures: int) -> None:
        self.store, self.method, self.failures, self.armed = store, method, failures, False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name != self.method or not self.armed or self.failures <= 0:
            return attr

        def fail(*args: Any, **kwargs: Any) -> Any:
            self.failures -= 1
            raise RuntimeError(f"injected store failure in {name}")

        return fail


def _wait_lost(watch: LivenessWatch, rank: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while rank not in watch._record.lost and time.monotonic() < deadline:
        time.sleep(0.005)
    return sorted(watch._record.lost)


def many_fds_then_a_death(rank: int, world: int, fds: int) -> dict[str, Any]:
    """Every rank holds ``fds`` extra open descriptors; the last rank SIGKILLs itself."""
    import os
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < fds + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, fds + 1024), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(fds)]
    store = _c10d.default_store()
    watch = LivenessWatch(interval=0.02, timeout=60)
    out: dict[str, Any] = {"rank": rank, "highest_fd": max(held)}
    _meet(store, "fds/linked", world)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out["lost"] = _wait_lost(watch, world - 1, 15.0)
    out["lost_call"] = sorted(watch.lost())  # raises if the thread failed
    watch.close()
    for fd in held:
        os.close(fd)
    return out


def store_fails_while_relinking(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 dies; rank 0, whose successor it was, relinks through a store that fails
    its next 3 ``compare_set`` calls. Rank 0 must still link to rank 2, learn of the
    death, and say once (in ``lost()``) that its thread hit the store's error."""
    import os
    import signal

    store = _c10d.default_store()
    watch = LivenessWatch(interval=0.02, timeout=60)
    out: dict[str, Any] = {"rank": rank}
    faulty = FailingStore(watch._ring.store, "compare_set", 3)
    if rank == 0:
        watch._ring.store = faulty
    _meet(store, "relink/linked", world)
    faulty.armed = True
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out["lost"] = _wait_lost(watch, 1, 15.0)
    deadline = time.monotonic() + 15.0
    while (watch._ring.succ is None or watch._ring.succ[0] != 2) and time.monotonic() < deadline:
        time.sleep(0.005)
    out["successor"] = None if watch._ring.succ is None else watch._ring.succ[0]
    out["failures_left"] = faulty.failures
    try:
        out["first_lost"] = sorted(watch.lost())
    except RuntimeError as error:
        out["first_lost"] = str(error)
    out["second_lost"] = sorted(watch.lost())
    _meet(store, "relink/done", world - 1)
    watch.close()
    return out
