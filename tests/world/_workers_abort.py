"""Workers for tests/world/test_abort.py: what a handle, a torch-made group and a backend
say once a liveness watch has aborted their mesh.

Rank 3 writes its pid to ``folder``; the test process SIGKILLs it from outside
once rank 1 has written ``started`` (the collectives it checks are in flight).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from scopedmesh.c10d import groups as _c10d
from scopedmesh.fault.liveness import LivenessWatch

VICTIM = 3


def _meet(store: Any, key: str, count: int, timeout: float = 60.0) -> None:
    """Wait (polling, bounded) until ``key`` counts ``count`` arrivals; this rank arrives first."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: {store.add(key, 0)} of {count} arrived")
        time.sleep(0.002)


def _until(condition: Any, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition()`` until it holds; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.005)


def _be_killed(folder: Path) -> None:
    """The victim: say where to send the signal, then wait for it (bounded)."""
    import os

    (folder / f"pid.{VICTIM}.tmp").write_text(str(os.getpid()))
    (folder / f"pid.{VICTIM}.tmp").rename(folder / f"pid.{VICTIM}")
    time.sleep(120)
    raise TimeoutError("rank 3 was not killed within 120 s")


def _said(call: Any) -> str:
    """What ``call()`` did: ``"returned <value>"`` or ``"<ErrorType>: <message>"``."""
    try:
        return f"returned {call()!r}"
    except Exception as error:  # the answer is the point
        cause = error.__cause__
        chained = f" [from {type(cause).__name__}]" if cause is not None else ""
        return f"{type(error).__name__}: {str(error)[:300]}{chained}"


def _report(handle: Any, buffer: Any) -> dict[str, Any]:
    """How ``handle`` (a collective's work) reports itself, and what ``buffer`` holds."""
    return {
        "wait": _said(handle.wait),
        "is_success": _said(handle.is_success),
        "is_completed": _said(handle.is_completed),
        "future": _said(lambda: [t.tolist() for t in handle.get_future().wait()]),
        "buffer": buffer.flatten().tolist(),
    }


def kept_handles(rank: int, world: int, folder: str) -> dict[str, Any]:
    """A guarded 2 x 2 (dp, tp) mesh; rank 3 is SIGKILLed by the test process while rank
    1 has collectives in flight that need it: an all_reduce and an all_gather on dp
    [1, 3], an all_reduce on a group its sub-mesh formed, one on a group its view
    formed, and a functional all_reduce through the DeviceMesh handed to torch. Rank 1
    also keeps the handle of a tp all_reduce with rank 0 that completed before.

    Once its watch has aborted the mesh and the groups have settled (the watch's
    work; called here too, so that the report does not race it), rank 1 reports
    what each handle says.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from scopedmesh.mesh import ProcessGroupMesh

    here = Path(folder)
    store = _c10d.default_store()
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=60))
    dp, tp = mesh.get_group_along_axis("dp"), mesh.get_group_along_axis("tp")
    sub = mesh.submesh("dp", "tp").__enter__()
    both = sub.get_group_along_axis(("dp", "tp"))  # ranks 0..3, first formed through the sub-mesh
    view = mesh.view(4, names=("all",))
    ends = view.get_group_along_axis("all", indices_at_axis=[1, 2, 3])  # None on rank 0
    device_mesh = mesh.to_device_mesh("cpu")
    out: dict[str, Any] = {"rank": rank}
    if rank in (0, 1):
        done = torch.ones(2)
        kept = dist.all_reduce(done, group=tp, async_op=True)
        _until(kept.is_completed, "the tp all_reduce to complete")
    _meet(store, "abort/formed", world)
    if rank == VICTIM:
        _be_killed(here)
    if rank == 1:
        ones = [torch.ones(2) for _ in range(4)]
        gathered = torch.zeros(4)
        works = {  # name -> (work, the buffer it writes)
            "dp all_reduce": (dist.all_reduce(ones[0], group=dp, async_op=True), ones[0]),
            "dp all_gather": (
                dist.all_gather_into_tensor(gathered, torch.ones(2), group=dp, async_op=True),
                gathered,
            ),
            "sub-mesh": (dist.all_reduce(ones[1], group=both, async_op=True), ones[1]),
            "view": (dist.all_reduce(ones[2], group=ends, async_op=True), ones[2]),
        }
        reduced = funcol.all_reduce(ones[3], "sum", (device_mesh, 0))
        (here / "started").write_text("1")
    _until(lambda: watch.aborted_at(VICTIM) is not None, "the watch to abort the mesh")
    if rank == 1:
        groups = [g for g in mesh._table.groups() if hasattr(g, "settle")]
        _until(lambda: all(w.is_completed() for w, _ in works.values()), "the collectives to end")
        _until(lambda: all(g.settle() for g in groups), "the groups to settle")
        out["reports"] = {name: _report(work, buffer) for name, (work, buffer) in works.items()}
        out["reports"]["completed before"] = _report(kept, done)
        out["torch"] = _said(lambda: reduced.wait().tolist())
    out["lost"] = sorted(watch.lost())
    sub.close()
    view.close()
    mesh.close()
    watch.close()
    return out


def torch_made_groups(rank: int, world: int, folder: str) -> dict[str, Any]:
    """A guarded 2 x 1 x 2 (dp, x, tp) mesh and its DeviceMesh. Before rank 3 is killed,
    torch makes groups for ``_flatten`` (x, tp: ranks [0, 1] and [2, 3]) and for
    ``_unflatten`` (tp into (1, 2)), and each rank takes the tp group's gloo backend
    (``_get_backend``). Rank 1 starts an all_reduce on its flatten group that rank 0
    never joins; the test process then kills rank 3.

    Once its watch has aborted the mesh, rank 1 reports how its blocked all_reduce
    ended (or that it was still blocked 20 s later); ranks 0 and 1 run an all_reduce
    on the unflatten group and one through the backend they kept; rank 2 one on its
    flatten group (with the dead rank 3).
    """
    import torch
    import torch.distributed as dist

    from scopedmesh.mesh import ProcessGroupMesh

    here = Path(folder)
    store = _c10d.default_store()
    watch = LivenessWatch(interval=0.02, timeout=60)
    mesh = watch.guard(ProcessGroupMesh(2, 1, 2, names=("dp", "x", "tp"), timeout=60))
    device_mesh = mesh.to_device_mesh("cpu")
    flat = device_mesh["x", "tp"]._flatten("xtp").get_group()
    unflat = device_mesh["tp"]._unflatten(0, (1, 2), ("u1", "u2"))["u2"].get_group()
    backend = mesh.get_group_along_axis("tp")._get_backend(torch.device("cpu"))
    out: dict[str, Any] = {"rank": rank, "flat_type": type(flat).__name__}
    before = torch.ones(1)
    dist.all_reduce(before, group=flat)
    dist.all_reduce(before, group=unflat)
    backend.allreduce([before]).wait()
    out["before"] = before.item()  # 1 -> 2 -> 4 -> 8: every path worked
    _meet(store, "abort/formed", world)
    if rank == VICTIM:
        _be_killed(here)
    if rank == 1:
        blocked = dist.all_reduce(torch.ones(1), group=flat, async_op=True)
        (here / "started").write_text("1")
    _until(lambda: watch.aborted_at(VICTIM) is not None, "the watch to abort the mesh")
    if rank == 1:
        try:
            _until(blocked.is_completed, "the blocked all_reduce to end", timeout=20.0)
            out["blocked"] = _said(blocked.wait)
        except TimeoutError:
            out["blocked"] = "still blocked 20 s after the abort"
            return out  # closing would wait for it
    if rank in (0, 1):
        out["unflatten later"] = _said(lambda: dist.all_reduce(torch.ones(1), group=unflat))
        out["backend later"] = _said(lambda: backend.allreduce([torch.ones(1)]).wait())
    if rank == 2:
        out["flatten later"] = _said(lambda: dist.all_reduce(torch.ones(1), group=flat))
    out["lost"] = sorted(watch.lost())
    mesh.close()
    watch.close()
    return out


def closable_flatten_and_backend(rank: int, world: int) -> dict[str, Any]:
    """Without a death: what torch makes for a scoped DeviceMesh, and what ``_get_backend``
    hands out, before and after the mesh closes (2 ranks, a 1 x 2 mesh)."""
    import torch
    import torch.distributed as dist

    from scopedmesh.mesh import ProcessGroupMesh

    out: dict[str, Any] = {}
    with ProcessGroupMesh(1, 2, names=("a", "b")) as mesh:
        device_mesh = mesh.to_device_mesh("cpu")
        flat = device_mesh["a", "b"]._flatten("ab").get_group()
        unflat = device_mesh["b"]._unflatten(0, (1, 2), ("u1", "u2"))["u2"].get_group()
        out["types"] = [type(flat).__name__, type(unflat).__name__]
        total = torch.ones(1)
        dist.all_reduce(total, group=flat)
        dist.all_reduce(total, group=unflat)
        backend = mesh.get_group_along_axis("b")._get_backend(torch.device("cpu"))
        work = backend.allreduce([total])
        out["work"] = type(work).__name__
        work.wait()
        out["total"] = total.item()  # 1 -> 2 -> 4 -> 8
        out["timeout"] = backend.options._timeout.total_seconds()
        out["no cuda"] = _said(
            lambda: mesh.get_group_along_axis("b")._get_backend(torch.device("cuda"))
        )
    out["backend after"] = _said(lambda: backend.allreduce([torch.ones(1)]))
    out["flat after"] = _said(lambda: dist.all_reduce(torch.ones(1), group=flat))
    out["work after"] = [_said(work.wait), _said(work.is_success)]
    return out


def interrupted_in_flight(rank: int, world: int) -> dict[str, Any]:
    """Two ranks, no watch: rank 1's all_reduce is in flight (rank 0 never joins) when both
    interrupt their group; rank 0's closes at once, so rank 1's fails, and its group is
    settled. Rank 1 reports its handle, and one kept from a completed all_reduce."""
    import torch
    import torch.distributed as dist

    from scopedmesh.mesh import ProcessGroupMesh

    store = _c10d.default_store()
    out: dict[str, Any] = {}
    with ProcessGroupMesh(2, names=("tp",), timeout=60) as mesh:
        group = mesh.get_group_along_axis("tp")
        done = torch.ones(1)
        kept = dist.all_reduce(done, group=group, async_op=True)
        _until(kept.is_completed, "the first all_reduce to complete")
        if rank == 1:
            cut = dist.all_reduce(torch.ones(1), group=group, async_op=True)
            future = cut.get_future()  # taken while in flight, as DDP does
            out["held"] = not group.interrupt("when the test interrupted it")
        _meet(store, "inflight/started", world)
        if rank == 0:
            group.interrupt("when the test interrupted it")
        else:
            _until(cut.is_completed, "the cut-short all_reduce to end")
            _until(group.settle, "the group to settle")
            out["cut"] = _report(cut, torch.zeros(1))
            out["cut future taken before"] = _said(future.wait)
            out["kept"] = _report(kept, done)
    return out


def closed_with_a_collective_in_flight(rank: int, world: int) -> dict[str, Any]:
    """Two ranks, no watch: rank 1 starts an all_reduce rank 0 has not joined, aborts its
    mesh and closes it (as a heal's re-form closes an aborted mesh whose vote is still in
    flight in gloo); rank 0 joins only once rank 1's close has returned, so a close that waited
    for the collective would wait for the group's 60 s timeout and rank 0's join would
    fail. Rank 1 reports how its handle ended and waits for its sockets to close."""
    import torch
    import torch.distributed as dist

    from scopedmesh.mesh import ProcessGroupMesh

    store = _c10d.default_store()
    out: dict[str, Any] = {}
    mesh = ProcessGroupMesh(2, names=("tp",), timeout=60)
    handle = mesh.get_group_along_axis("tp")
    if rank == 1:
        open_fds = len(os.listdir("/proc/self/fd"))
        cut = dist.all_reduce(torch.ones(1), group=handle, async_op=True)
        mesh.abort("when the test aborted it")  # a death's abort: the busy group is held
        mesh.close()
        store.set("closed/returned", "1")
        out["cut"] = _said(cut.wait)
        _until(lambda: len(os.listdir("/proc/self/fd")) < open_fds, "the group's sockets to close")
        out["later"] = _said(lambda: dist.all_reduce(torch.ones(1), group=handle))
    else:
        store.wait(["closed/returned"], timedelta(seconds=60))
        out["joined"] = _said(lambda: dist.all_reduce(torch.ones(1), group=handle))
        mesh.close()
    return out


def point_to_point_through_c10d(rank: int, world: int) -> dict[str, Any]:
    """Two ranks, a 2-rank mesh: a ``dist.send``/``recv`` pair, then ``torch.ops.c10d``'s
    ``send``, ``recv_`` and ``recv_any_source_`` on the group once the mesh is aborted and
    once it is closed (issue 37, item 1). Each answer is the error's type, or what the work
    said and the buffer after it (7.0 if nothing was written)."""
    import torch
    import torch.distributed as dist

    from scopedmesh.mesh import ProcessGroupMesh

    peer = 1 - rank
    ops = torch.ops.c10d

    def attempts(group: Any) -> dict[str, str]:
        said: dict[str, str] = {}
        boxed = group.boxed()
        for name, call in {
            "send": lambda x: ops.send([x], boxed, peer, 0),
            "recv_": lambda x: ops.recv_([x], boxed, peer, 0),
            "recv_any_source_": lambda x: ops.recv_any_source_([x], boxed, 0),
        }.items():
            x = torch.full((1,), 7.0)
            try:
                work = call(x)
            except RuntimeError as error:
                said[name] = f"raised {type(error).__name__}"
                continue
            said[name] = f"{_said(work.wait)}, buffer {x.item()}"
        return said

    out: dict[str, Any] = {}
    with ProcessGroupMesh(2, names=("tp",), timeout=60) as mesh:
        group = mesh.get_group_along_axis("tp")
        x = torch.full((1,), float(rank))
        if rank == 0:
            dist.send(x, 1, group=group)
        else:
            dist.recv(x, 0, group=group)
        out["received"] = x.item()  # rank 1: 0.0, what rank 0 sent
        mesh.abort("when the test aborted it")
        out["aborted"] = attempts(group)
    out["closed"] = attempts(group)
    return out


def shut_while_the_group_lives(rank: int, world: int) -> dict[str, Any]:
    """Four ranks, no watch: ranks 1 to 3 start an all_reduce rank 0 never joins; rank 0
    interrupts its idle group while still holding gloo's group (so gloo's destructor does
    not run), and waits up to 20 s for its peers' all_reduces to fail. Each peer that
    fails interrupts its own group (as a watch's abort would), so a failure reaches the
    peers that waited on it. Rank 0 reports what it recorded and whether they failed."""
    import torch
    import torch.distributed as dist

    from scopedmesh.mesh import ProcessGroupMesh

    store = _c10d.default_store()
    out: dict[str, Any] = {}
    with ProcessGroupMesh(world, names=("dp",), timeout=60) as mesh:
        group = mesh.get_group_along_axis("dp")
        dist.all_reduce(torch.ones(1), group=group)  # every pair connected and used once
        if rank == 0:
            out["connections"] = len(group._connections)
            alive = group._inner  # gloo's group outlives the interrupt: only a shut closes it
            _meet(store, "shut/started", world)
            time.sleep(0.05)  # the peers' all_reduces are waiting for this rank
            out["idle"] = group.interrupt("when the test interrupted it")
            try:
                _until(lambda: int(store.add("shut/failed", 0)) == world - 1, "peers", 20.0)
                out["peers failed while gloo's group lived"] = True
            except TimeoutError:
                out["peers failed while gloo's group lived"] = False
            del alive
        else:
            work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
            _meet(store, "shut/started", world)
            out["wait"] = _said(work.wait)
            group.interrupt("when its all_reduce failed")
            store.add("shut/failed", 1)
    return out


def gloo_destructors_on_threads(rank: int, world: int) -> dict[str, Any]:
    """Four ranks, no watch, a 2 x 2 (dp, tp) mesh with three gloo groups per rank. gloo's
    destructor of each group is held on its thread until this worker lets it go, so what
    waits for it is seen. (1) A close starts every group's destructor before it waits for
    any. (2) After an abort, a heal's re-form returns with the destructors still running:
    the healed mesh inherits them, and its close waits for them."""
    import threading

    import torch
    import torch.distributed as dist

    from scopedmesh.c10d import closable
    from scopedmesh.fault.heal import reform
    from scopedmesh.mesh import ProcessGroupMesh

    let_go = threading.Event()
    started: list[threading.Thread] = []
    real = closable._drop_on_a_thread

    def held(box: list[Any]) -> threading.Thread:
        def drop() -> None:
            let_go.wait(60)
            box.clear()

        thread = threading.Thread(target=drop, name="scopedmesh-gloo-close")
        started.append(thread)
        thread.start()
        return thread

    def mesh_in_use() -> Any:
        mesh = ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=60)
        for axes in ("dp", "tp", ("dp", "tp")):
            dist.all_reduce(torch.ones(1), group=mesh.get_group_along_axis(axes))
        return mesh

    def within(condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    out: dict[str, Any] = {}
    closable._drop_on_a_thread = held  # type: ignore[assignment]
    try:
        mesh = mesh_in_use()
        closer = threading.Thread(target=mesh.close)
        closer.start()
        out["close started all 3 before any ended"] = within(lambda: len(started) == 3, 5.0)
        closer.join(0.3)
        out["close waited"] = closer.is_alive()
        let_go.set()
        closer.join(60)
        out["closed"] = not closer.is_alive() and mesh.closed
        _meet(_c10d.default_store(), "drops/first", world)

        let_go.clear()
        started.clear()
        mesh = mesh_in_use()
        mesh.abort("when the test aborted it")
        healed = reform(mesh, lost=[], axis="dp")
        out["re-form returned, destructors running"] = sum(t.is_alive() for t in started)
        out["inherited"] = sum(t in healed._table.inherited for t in started)
        closer = threading.Thread(target=healed.close)
        closer.start()
        closer.join(0.3)
        out["healed close waited"] = closer.is_alive()
        let_go.set()
        closer.join(60)
        out["all ended"] = not closer.is_alive() and not any(t.is_alive() for t in started)
        _meet(_c10d.default_store(), "drops/second", world)

        # (3) A re-form whose new mesh cannot be made: nobody inherits the destructors,
        # so the re-form waits for them before it raises.
        let_go.clear()
        started.clear()
        mesh = mesh_in_use()
        mesh.abort("when the test aborted it")
        make = ProcessGroupMesh.__dict__["from_layout"]

        def refuse(cls: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no new mesh (the test)")

        raised: list[BaseException] = []

        def re_form() -> None:
            try:
                reform(mesh, lost=[], axis="dp")
            except RuntimeError as error:
                raised.append(error)

        ProcessGroupMesh.from_layout = classmethod(refuse)  # type: ignore[assignment]
        try:
            former = threading.Thread(target=re_form)
            former.start()
            former.join(0.3)
            out["failed re-form waited"] = former.is_alive()
            let_go.set()
            former.join(60)
        finally:
            ProcessGroupMesh.from_layout = make
        out["failed re-form raised"] = [str(e) for e in raised]
        out["failed re-form left none"] = not any(t.is_alive() for t in started)
    finally:
        closable._drop_on_a_thread = real
        let_go.set()
    return out
