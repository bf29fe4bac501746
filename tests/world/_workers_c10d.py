"""Worker functions for tests/world/test_c10d.py: the torch hazards of DESIGN.md, on gloo.

One world of 4 ranks runs the phases below in order (see ``C10D_CHECKS``). The
first phase tries the public fallback while every rank has the same history; in
the second, ranks 0 and 1 reproduce the public re-creation hazard while ranks 2
and 3 run the single-pair checks; the last phase kills rank 3.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _workers_common import wait_gone
from _workers_mesh import Check, members, run_checks, total
from probes import error_text, record_new_groups
from torch.distributed import distributed_c10d as c10d

from scopedmesh.c10d import groups as _c10d
from scopedmesh.errors import GroupFormationError
from scopedmesh.mesh import ProcessGroupMesh

# Seconds the second rank of a pair keeps its old incarnation once its peer's re-creation has
# published its address (``_follow``): the peer reads this rank's key next, so a tenth of a
# second covers that store request even on a loaded machine.
SKEW = 0.1
# The public recipe's group timeout: it fails, so keep it short. A rank left waiting for its
# peer to dial gives up after five times this (gloo's connect wait: 5 s measured for 1 s);
# a 2-rank group forms in about 0.1 s at load 10 on 2 cores.
PUBLIC_TIMEOUT = 1.0
# A re-creation that reads the peer's stale address still survives when the new listening
# ports fall one way (about 1 time in 3: see _public_recipe), so on torch <= 2.13 the recipe
# cycles until the hazard strikes; 15 re-creations all surviving is about 1 in 14 million.
PUBLIC_CYCLES = 16
MESH_TIMEOUT = 30.0
ORDER_TIMEOUT = 6.0  # s: the deadlock is said in about 1 s; a loaded machine needs room
DEAD_RANK = 3
# Public member-only groups get their old name back up to torch 2.13 (test_c10d.py says why).
RELEASE = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
PUBLIC_NAMES_REUSED = RELEASE <= (2, 13)
NAME = re.compile(r"scopedmesh-([0-9a-f]{20})-(\d+)")


def _pair(rank: int) -> tuple[int, int]:
    return (0, 1) if rank < 2 else (2, 3)


def _skew(rank: int) -> None:
    if rank % 2:
        time.sleep(SKEW)


def _lead(rank: int, store: dist.Store, recipe: str, cycle: int) -> None:
    """The first rank of a pair says it is about to re-create (incarnation ``cycle``)."""
    if rank % 2 == 0:
        store.set(f"test-c10d/{recipe}/{rank}/{cycle}", "go")


def _follow(
    rank: int, store: dist.Store, recipe: str, cycle: int, cycles: int, next_name: str | None
) -> None:
    """The second rank keeps incarnation ``cycle`` until its peer is inside the next, then SKEW.

    It waits for the peer's word that it starts re-creating, then for the address the peer
    publishes in the rendezvous of ``next_name`` (the next incarnation's name, where it is
    known; the peer reads this rank's key right after writing its own). So the first rank's
    re-creation always meets the second rank's old incarnation and its rendezvous keys,
    however the machine schedules the two.
    """
    if rank % 2 and cycle + 1 < cycles:
        timeout = timedelta(seconds=MESH_TIMEOUT)
        store.wait([f"test-c10d/{recipe}/{rank - 1}/{cycle + 1}"], timeout)
        if next_name is not None:
            store.wait([_rendezvous_key(next_name, 0)], timeout)
    _skew(rank)


def _rendezvous_key(name: str, group_rank: int) -> str:
    """Where gloo keeps ``group_rank``'s listening address while group ``name`` forms.

    torch 2.13's layout: PrefixStore(f"{name}/") -> PrefixStore("cpu/") -> gloo's
    PrefixStore("0") for device 0 (scopedmesh.c10d.store.incarnation_keys pins it too).
    """
    return f"{name}//cpu//0/{group_rank}"


def _next_name(pair: list[int], group: dist.ProcessGroup) -> str:
    """The private path's name for the incarnation after ``group`` over ``pair``."""
    return _c10d.group_name(pair, "gloo", _generation(group) + 1)


def _generation(group: dist.ProcessGroup) -> int:
    match = NAME.fullmatch(group.group_name)
    if match is None:
        raise AssertionError(f"unexpected group name {group.group_name!r}")
    return int(match.group(2))


# ------------------------------------------------------------------ phase 2


def public_hazards_and_pins(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks 0, 1: the public re-creation recipe. Ranks 2, 3: single-pair checks."""
    if rank < 2:
        return {"public_recipe": _public_recipe(rank)}
    return {
        "duplicates_public": _duplicates_public(rank),
        "duplicates_mesh": _duplicates_mesh(rank),
        "double_destroy": _double_destroy(rank),
        "non_members": _non_members(rank),
        "names": _names(rank),
        "formation_ends_together": _formation_ends_together(rank),
        "gpu_less_nccl": _gpu_less_nccl(rank),
    }


def _public_recipe(rank: int) -> dict[str, Any]:
    """Hazard 1 with public new_group: create [0, 1] -> all_reduce -> destroy, skewed.

    Gloo's rendezvous (gloo/transport/tcp/context.cc, createAndConnectAllPairs) sets this
    rank's listening address under ``str(rank)`` in the group's store prefix, then reads
    every peer's key. Rank 0 deletes its own key of the last incarnation before it
    re-creates, and rank 1 keeps its incarnation until rank 0's new key is there, and
    SKEW more (``_follow``), so rank 0 reads rank 1's stale key. Which side dials is
    decided by comparing listening ports (tcp/device.cc, Device::isInitiator: ``sa->sin_port -
    sb->sin_port``, in network byte order). Rank 0
    dials the stale address when its new port orders above rank 1's old one; otherwise it
    waits, and both wait unless rank 1's new port orders above rank 0's. ``ports`` is the
    port this rank published each cycle; ``stale`` (rank 0) the port in rank 1's key just
    before rank 0 re-created: the test checks that order against the outcome.
    """
    out: dict[str, Any] = {"failed": False, "cycle": None, "stage": None, "error": None}
    sums, names, ports, stale = [], [], [], []
    store = c10d._get_default_store()
    for cycle in range(PUBLIC_CYCLES):
        group = None
        stage = "new_group"
        if rank == 0 and names:
            stale.append(_rendezvous_port(store, names[-1], 1))
            store.delete_key(_rendezvous_key(names[-1], 0))  # rank 1 waits for its new one
            _lead(rank, store, "public", cycle)
        try:
            group = dist.new_group(
                [0, 1], timeout=timedelta(seconds=PUBLIC_TIMEOUT), use_local_synchronization=True
            )
            names.append(group.group_name)
            ports.append(_rendezvous_port(store, group.group_name, rank))
            stage = "all_reduce"
            sums.append(total(group))
            stage = "skew"
            again = group.group_name if PUBLIC_NAMES_REUSED else None  # 2.14+: a new name
            _follow(rank, store, "public", cycle, PUBLIC_CYCLES, again)
            stage = "destroy"
            dist.destroy_process_group(group)
        except Exception as error:
            out.update(
                failed=True, cycle=cycle, stage=stage, error=f"{type(error).__name__}: {error}"
            )
            _lead(rank, store, "public", cycle + 1)  # rank 1 need not wait for it
            if len(ports) < cycle + 1 and names:  # new_group failed: its key is set all the same
                ports.append(_rendezvous_port(store, names[-1], rank))
            if group is not None and _c10d.is_live(group):
                dist.destroy_process_group(group)
            break
    out.update(sums=sums, names=names, ports=ports, stale=stale)
    return out


def _rendezvous_port(store: dist.Store, name: str, rank: int) -> int | None:
    """The listening port ``rank`` published in group ``name``'s gloo rendezvous, or None.

    The key is ``_rendezvous_key``; its value is gloo tcp's ``Rank``: hostname size and
    bytes, address size, then the address, a sockaddr (family, then port in network order).
    """
    key = _rendezvous_key(name, rank)
    try:
        if not store.check([key]):
            return None
        raw = store.get(key)
        (hostname_size,) = struct.unpack_from("=Q", raw, 0)
        (port,) = struct.unpack_from(">H", raw, 8 + hostname_size + 8 + 2)
    except (RuntimeError, struct.error):
        return None
    return int(port)


def _duplicates_public(rank: int) -> dict[str, Any]:
    """Hazard 6 with public new_group: two live groups over [2, 3], destroy the older, again."""
    first = dist.new_group([2, 3], use_local_synchronization=True)
    second = dist.new_group([2, 3], use_local_synchronization=True)
    sums = [total(first), total(second)]
    names = [first.group_name, second.group_name]
    dist.destroy_process_group(first)
    made: list[dist.ProcessGroup] = []
    again = error_text(lambda: made.append(dist.new_group([2, 3], use_local_synchronization=True)))
    for group in made:  # on releases where torch names it afresh, it works: clean it up too
        names.append(group.group_name)
        sums.append(total(group))
        dist.destroy_process_group(group)
    dist.destroy_process_group(second)
    return {"sums": sums, "names": names, "again": again, "live": _c10d.live_group_count()}


def _duplicates_mesh(rank: int) -> dict[str, Any]:
    """Hazard 6 through the mesh: the same steps work."""
    older = ProcessGroupMesh(2, ranks=[2, 3], timeout=MESH_TIMEOUT)
    newer = ProcessGroupMesh(2, ranks=[2, 3], timeout=MESH_TIMEOUT)
    a, b = older.get_group_along_axis(0), newer.get_group_along_axis(0)
    assert a is not None and b is not None
    sums = [total(a), total(b)]
    older.close()
    third = ProcessGroupMesh(2, ranks=[2, 3], timeout=MESH_TIMEOUT)
    c = third.get_group_along_axis(0)
    assert c is not None
    sums += [total(c), total(b)]
    names = [a.group_name, b.group_name, c.group_name]
    newer.close()
    third.close()
    return {"sums": sums, "names": names, "live": _c10d.live_group_count()}


def _double_destroy(rank: int) -> dict[str, Any]:
    """Hazard 4: torch raises on a second destroy; scopedmesh checks liveness first."""
    group = _c10d.new_member_group(
        [2, 3], backend="gloo", timeout=None, pg_options=None, description="double destroy"
    )
    assert group is not None
    works = total(group)
    first = _c10d.destroy(group)
    second = _c10d.destroy(group)
    torch_again = error_text(lambda: dist.destroy_process_group(group))
    world = dist.group.WORLD
    assert world is not None
    return {
        "works": works,
        "first": first,
        "second": second,
        "torch_again": torch_again,
        "destroy_world": _c10d.destroy(world),
        "world_live": _c10d.is_live(world),
        "live": _c10d.live_group_count(),
    }


def _non_members(rank: int) -> dict[str, Any]:
    """Hazard 3: a non-member gets None from every path."""
    out: dict[str, Any] = {}
    public = dist.new_group([0, 1], use_local_synchronization=True)  # local for non-members
    out["public_repr"] = repr(public)
    out["public_is_none"] = public is None
    out["public_is_sentinel"] = (
        isinstance(public, int) and public == dist.GroupMember.NON_GROUP_MEMBER
    )
    out["helper"] = repr(
        _c10d.new_member_group(
            [0, 1], backend="gloo", timeout=None, pg_options=None, description=""
        )
    )
    with ProcessGroupMesh(2, ranks=[2, 3], timeout=MESH_TIMEOUT) as mesh:
        for label, index in (("indices_first", 0), ("indices_last", -1)):
            group = mesh.get_group_along_axis(0, indices_at_axis=[index])  # one rank each
            out[label] = None if group is None else dist.get_process_group_ranks(group)
            out[label + "_again_same"] = (
                mesh.get_group_along_axis(0, indices_at_axis=[index]) is group
            )
    # torch 2.14 answers GroupMember.NON_GROUP_MEMBER: the fallback maps it to None too.
    original_new_group = dist.new_group
    original_supported = _c10d.private_path_supported
    dist.new_group = lambda *args, **kwargs: dist.GroupMember.NON_GROUP_MEMBER
    _c10d.private_path_supported = lambda: False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out["sentinel_mapped"] = repr(
                _c10d.new_member_group(
                    [rank], backend="gloo", timeout=None, pg_options=None, description=""
                )
            )
    finally:
        dist.new_group = original_new_group
        _c10d.private_path_supported = original_supported
    out["live"] = _c10d.live_group_count()
    return out


def _names(rank: int) -> dict[str, Any]:
    """The private path: scopedmesh-<hash>-<generation>, one generation per incarnation."""
    names = []
    for _ in range(3):
        with ProcessGroupMesh(2, ranks=[3, 2], timeout=MESH_TIMEOUT) as mesh:
            group = mesh.get_group_along_axis(0)
            assert group is not None
            names.append(group.group_name)
            total(group)
    generations = [_generation_of(n) for n in names]
    return {
        "supported": _c10d.private_path_supported(),
        "names": names,
        "generations": generations,
        "expected_names": [_c10d.group_name([2, 3], "gloo", g) for g in generations],
        "live": _c10d.live_group_count(),
    }


def _gpu_less_nccl(rank: int) -> dict[str, Any]:
    """NCCL compiled in (a CUDA build) but no GPU: rejected up front, never a formation error.

    Both conditions are simulated, so this holds on CPU builds and on GPU hosts alike.
    """
    original_available = dist.is_backend_available
    original_cuda = torch.cuda.is_available
    dist.is_backend_available = lambda backend: True  # type: ignore[assignment]
    torch.cuda.is_available = lambda: False
    try:
        out = {
            "constructor": error_text(lambda: ProcessGroupMesh(2, ranks=[2, 3], backend="nccl")),
        }
        with ProcessGroupMesh(2, ranks=[2, 3], timeout=MESH_TIMEOUT) as mesh:
            out["per_call"] = error_text(lambda: mesh.get_group_along_axis(0, backend="nccl"))
        out["helper"] = error_text(
            lambda: _c10d.new_member_group(
                [2, 3], backend="nccl", timeout=None, pg_options=None, description=""
            )
        )
    finally:
        dist.is_backend_available = original_available
        torch.cuda.is_available = original_cuda
    out["live"] = _c10d.live_group_count()
    return out


def _generation_of(name: str) -> int:
    match = NAME.fullmatch(name)
    return -1 if match is None else int(match.group(2))


def _formation_ends_together(rank: int) -> dict[str, Any]:
    """A member returns from making a group only once every member has made it.

    gloo can finish the handshake on one side first; rank 3 here finishes 1.5 s
    late (a sleep after torch's constructor returns) and then marks the store.
    Rank 2 looks for the mark as soon as its own request returns.
    """
    store = c10d._get_default_store()
    key = "test-c10d/slow-member-formed"
    original = c10d._new_process_group_helper
    slow = None
    if rank == 3:

        @functools.wraps(original)  # scopedmesh judges the real helper underneath
        def _new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
            made = original(*args, **kwargs)
            time.sleep(1.5)
            c10d._get_default_store().set(key, "1")
            return made

        slow = _new_process_group_helper
        c10d._new_process_group_helper = slow
    try:
        with ProcessGroupMesh(2, ranks=[2, 3], timeout=MESH_TIMEOUT) as mesh:
            group = mesh.get_group_along_axis(0)
            peer_done = store.check([key])
            assert group is not None
            works = total(group)
    finally:
        c10d._new_process_group_helper = original
    return {"peer_done": peer_done, "works": works, "patched": slow is not None}


# ------------------------------------------------------------------ phase 3


def mesh_recipes(rank: int, world_size: int) -> dict[str, Any]:
    """Hazard 1 through the mesh, on both pairs at once: each variant skewed like the recipe."""
    pair = list(_pair(rank))
    out: dict[str, Any] = {}

    # (a) open a mesh over the pair, use its group, close: ten times.
    store = c10d._get_default_store()
    sums, generations = [], []
    for cycle in range(10):
        _lead(rank, store, "open-close", cycle)
        with ProcessGroupMesh(2, ranks=pair, timeout=MESH_TIMEOUT) as mesh:
            group = mesh.get_group_along_axis(0)
            assert group is not None
            sums.append(total(group))
            generations.append(_generation(group))
            _follow(rank, store, "open-close", cycle, 10, _next_name(pair, group))
    out["open_close"] = {"sums": sums, "generations": generations}

    # (b) a sub-mesh re-created inside one parent: its group is made and destroyed each time.
    sums, generations = [], []
    with ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=MESH_TIMEOUT) as parent:
        dp = parent.get_group_along_axis("dp")
        for cycle in range(6):
            _lead(rank, store, "submesh", cycle)
            with parent.submesh("tp") as stage:
                group = stage.get_group_along_axis("tp")
                assert group is not None
                sums.append(total(group))
                generations.append(_generation(group))
                _follow(rank, store, "submesh", cycle, 6, _next_name(pair, group))
        dp_alive = _c10d.is_live(dp)  # type: ignore[arg-type]
        dp_sum = total(dp)  # type: ignore[arg-type]
    out["submesh"] = {"sums": sums, "generations": generations, "dp": (dp_alive, dp_sum)}

    # (c) two meshes over the same ranks, the older closed first and a new one opened.
    sums = []
    names: list[str] = []
    for _ in range(4):
        older = ProcessGroupMesh(2, ranks=pair, timeout=MESH_TIMEOUT)
        newer = ProcessGroupMesh(2, ranks=pair, timeout=MESH_TIMEOUT)
        a, b = older.get_group_along_axis(0), newer.get_group_along_axis(0)
        assert a is not None and b is not None
        sums += [total(a), total(b)]
        _skew(rank)
        older.close()
        third = ProcessGroupMesh(2, ranks=pair, timeout=MESH_TIMEOUT)
        c = third.get_group_along_axis(0)
        assert c is not None
        sums += [total(c), total(b)]
        names += [a.group_name, b.group_name, c.group_name]
        _skew(rank)
        newer.close()
        third.close()
    out["two_meshes"] = {"sums": sums, "distinct_names": len(set(names)) == len(names)}
    out["live"] = _c10d.live_group_count()
    return out


# ------------------------------------------------------------------ phase 1


def fallback(rank: int, world_size: int) -> dict[str, Any]:
    """Without the private path: public new_group, one RuntimeWarning that names the hazard."""
    # Public member-only names hash the number of live groups (torch <= 2.13) or of groups
    # ever made (2.14+): both must agree on every rank, so this phase runs first.
    live = _c10d.live_group_count()
    if live != 1:
        raise AssertionError(f"expected only WORLD alive before the fallback, found {live}")
    made_before = getattr(c10d._world, "group_count", None)
    original = _c10d.private_path_supported
    _c10d.private_path_supported = lambda: False
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            record_new_groups() as calls,
        ):
            warnings.simplefilter("default")  # once per call site, like a user's session
            with ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=MESH_TIMEOUT) as mesh:
                everyone = members(mesh.get_group_along_axis(("dp", "tp")), world_size)
                dp = members(mesh.get_group_along_axis("dp"), world_size)
                live_open = _c10d.live_group_count()
    finally:
        _c10d.private_path_supported = original
    return {
        "everyone": everyone,
        "dp": dp,
        "live_open": live_open,
        "warnings": [(w.category.__name__, str(w.message)) for w in caught],
        "names": [c["name"] for c in calls],
        "made_before": made_before,
    }


# ------------------------------------------------------------------ phase 4


def order(rank: int, world_size: int) -> dict[str, Any]:
    """Hazard 5: ranks 0 and 1 ask for tp [0, 1] and (dp, tp) [0..3] in opposite orders."""
    requests: list[Any] = ["tp", ("dp", "tp")] if rank == 0 else [("dp", "tp"), "tp"]
    out: dict[str, Any] = {"error": None}
    start = time.monotonic()
    with ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=ORDER_TIMEOUT) as mesh:
        for axes in requests:
            try:
                mesh.get_group_along_axis(axes)
            except GroupFormationError as error:
                out["error"] = str(error)
                out["is_runtime_error"] = isinstance(error, RuntimeError)
                break
    out["elapsed"] = time.monotonic() - start
    out["live"] = _c10d.live_group_count()
    return out


def order_recovers(rank: int, world_size: int) -> dict[str, Any]:
    """After the failure, the same groups form again once every member asks in order."""
    with ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=MESH_TIMEOUT) as mesh:
        tp = members(mesh.get_group_along_axis("tp"), world_size)
        everyone = members(mesh.get_group_along_axis(("dp", "tp")), world_size)
    return {"tp": tp, "everyone": everyone, "live": _c10d.live_group_count()}


# ------------------------------------------------------------------ phase 5


def peer_death(rank: int, world_size: int) -> dict[str, Any]:
    """Hazard 2: rank 3 dies inside a scope; the survivors' close() returns promptly."""
    store = c10d._get_default_store()
    mesh = ProcessGroupMesh(2, 2, names=("dp", "tp"), timeout=MESH_TIMEOUT)
    trio = ProcessGroupMesh(3, ranks=[1, 2, 3], timeout=MESH_TIMEOUT) if rank else None
    with mesh:
        sums = [total(mesh.get_group_along_axis(a)) for a in ("dp", "tp")]  # type: ignore[arg-type]
        if trio is not None:
            sums.append(total(trio.get_group_along_axis(0)))  # type: ignore[arg-type]
        if rank == DEAD_RANK:
            store.set("test-c10d/dead-pid", str(os.getpid()))
        dist.barrier()
        if rank == DEAD_RANK:
            os._exit(0)
        pid = int(store.get("test-c10d/dead-pid"))
        gone = wait_gone(pid)
        live_open = _c10d.live_group_count()
        start = time.monotonic()
        if trio is not None:
            trio.close()
        mesh.close()
        elapsed = time.monotonic() - start
    return {
        "sums": sums,
        "peer_gone": gone,
        "live_open": live_open,
        "elapsed": elapsed,
        "live": _c10d.live_group_count(),
    }


C10D_CHECKS: list[Check] = [
    fallback,  # first: public names depend on each rank's history (hazard 7)
    public_hazards_and_pins,
    mesh_recipes,
    order,
    order_recovers,
    peer_death,  # must stay last: rank 3 dies in it
]


def c10d_world(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    return run_checks(rank, world_size, C10D_CHECKS, save_to=f"{save_dir}/rank{rank}.pkl")
