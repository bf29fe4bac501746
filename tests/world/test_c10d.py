"""scopedmesh.c10d.groups and the torch hazards of DESIGN.md, reproduced and then absorbed.

Each hazard is shown twice where torch lets us: once failing through public
torch.distributed, once passing through the mesh. One gloo world of 4 ranks
(tests/world/_workers_c10d.py: ``c10d_world``) runs every phase; the last phase kills
rank 3. A few pins of the private path run in this process, without a world.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import _workers_c10d as workers
import pytest
import torch
import torch.distributed as dist
from _workers_mesh import DIED, entries, facts, last_words
from torch.distributed import distributed_c10d as c10d
from torch.distributed.c10d_logger import _time_logger

from scopedmesh.c10d import groups as _c10d
from scopedmesh.testing import run_world

WORLD = 4
RELEASE = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
# How public member-only groups are named, by release (measured: COMPATIBILITY.md).
# Up to 2.13 the hash covers the ranks and the number of groups alive, so a group
# re-created over the same ranks gets its old name back (hazards 1 and 6). From 2.14
# it covers _world.group_count, a counter that only grows: names are never reused.
PUBLIC_NAMES_REUSED = RELEASE <= (2, 13)
# Non-members of a public member-only group get None up to 2.13, NON_GROUP_MEMBER from 2.14.
PUBLIC_NON_MEMBER_IS_NONE = RELEASE <= (2, 13)
PAIRS = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
# What gloo says when a group re-created under its old name meets the old incarnation's
# rendezvous keys (which of these depends on timing).
GLOO_STALE = re.compile(
    r"Connect timeout|connectFullMesh|Connection reset by peer|Connection closed by peer"
    r"|Timed out waiting \d+ms for recv"
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any] | None]:
    save_dir = tmp_path_factory.mktemp("c10d_reports")
    results = run_world(
        workers.c10d_world,
        WORLD,
        args=(str(save_dir),),
        timeout=400.0,
        allow_exit={workers.DEAD_RANK},
    )
    assert results[workers.DEAD_RANK] is None  # it died (os._exit) in the last phase
    return last_words(results, save_dir)  # its reports of the phases before


def phase(world: list[dict[str, Any] | None], name: str) -> list[dict[str, Any]]:
    return facts(world, name)


# ------------------------------------------------- hazard 1: re-creating a group


def test_public_new_group_recreation_fails_when_skewed(world: list[dict[str, Any] | None]) -> None:
    recipes = [f["public_recipe"] for f in phase(world, "public_hazards_and_pins")[:2]]
    for rank, recipe in enumerate(recipes):
        assert recipe["sums"][:1] == [1], rank  # the first incarnation works, same timeout
        if PUBLIC_NAMES_REUSED:  # torch <= 2.13: the hazard holds
            assert recipe["failed"] is True, f"rank {rank}: public recipe survived: {recipe}"
            assert recipe["cycle"] >= 1, recipe  # it is re-creation that fails
            assert GLOO_STALE.search(recipe["error"]), recipe["error"]
            assert len(set(recipe["names"])) == 1, recipe["names"]  # one name, reused
        else:  # torch >= 2.14: every incarnation gets a new name, the recipe survives
            assert recipe["failed"] is False, f"rank {rank}: {recipe}"
            assert recipe["sums"] == [1] * workers.PUBLIC_CYCLES
            assert len(set(recipe["names"])) == workers.PUBLIC_CYCLES, recipe["names"]
    # Members agree on every name they both made (a rank may fail one stage before its peer).
    common = min(len(recipe["names"]) for recipe in recipes)
    assert recipes[0]["names"][:common] == recipes[1]["names"][:common]
    if PUBLIC_NAMES_REUSED:
        _check_stale_rendezvous(*recipes)


def _dial_order(port: int) -> int:
    """The order gloo compares listening ports in: ``sin_port`` read raw, network byte order."""
    return int.from_bytes(port.to_bytes(2, "big"), sys.byteorder)


def _check_stale_rendezvous(first: dict[str, Any], second: dict[str, Any]) -> None:
    """Each re-creation met rank 1's stale address; it survived iff the ports fell the one way.

    Gloo decides who dials by comparing listening ports. Rank 0, re-creating first, compares
    its new port with the one in rank 1's stale key: above it, it dials the old incarnation;
    below it, it waits, and rank 1 (reading rank 0's fresh key) dials only if its own new port
    is above rank 0's, else both wait. So a re-creation survives iff rank 0's new port is
    below both of rank 1's, and the recipe runs until one does not.
    """
    failed_at = min(first["cycle"], second["cycle"])
    for cycle in range(1, failed_at + 1):
        new_0, old_1 = first["ports"][cycle], second["ports"][cycle - 1]
        new_1 = second["ports"][cycle] if cycle < len(second["ports"]) else None
        evidence = f"cycle {cycle}: ports {first['ports']}, {second['ports']}, {first['stale']}"
        assert None not in (new_0, old_1, new_1), evidence  # torch 2.13's rendezvous keys
        assert first["stale"][cycle - 1] == old_1, evidence  # rank 0 met the stale key
        order_0 = _dial_order(new_0)
        harmless = order_0 < _dial_order(old_1) and order_0 < _dial_order(new_1)
        assert harmless is (cycle < failed_at), evidence  # survivals, then the failure


def test_mesh_open_close_recreation_survives_the_same_skew(
    world: list[dict[str, Any] | None],
) -> None:
    results = phase(world, "mesh_recipes")
    for rank, f in enumerate(results):
        run = f["open_close"]
        assert run["sums"] == [sum(PAIRS[rank])] * 10, rank
        generations = run["generations"]
        assert generations == list(range(generations[0], generations[0] + 10))
        peer = PAIRS[rank][1 - PAIRS[rank].index(rank)]
        assert results[peer]["open_close"]["generations"] == generations  # members agree
        assert f["live"] == 1


def test_submesh_recreation_survives_the_same_skew(world: list[dict[str, Any] | None]) -> None:
    for rank, f in enumerate(phase(world, "mesh_recipes")):
        run = f["submesh"]
        assert run["sums"] == [sum(PAIRS[rank])] * 6, rank
        assert run["generations"] == list(range(run["generations"][0], run["generations"][0] + 6))
        dp_sum = {0: 2, 2: 2, 1: 4, 3: 4}[rank]  # dp groups of a 2 x 2 mesh: [0, 2], [1, 3]
        assert run["dp"] == (True, dp_sum)  # the parent's group outlives every sub-mesh


def test_two_meshes_over_the_same_ranks_survive_the_same_skew(
    world: list[dict[str, Any] | None],
) -> None:
    for rank, f in enumerate(phase(world, "mesh_recipes")):
        run = f["two_meshes"]
        assert run["sums"] == [sum(PAIRS[rank])] * 16, rank
        assert run["distinct_names"] is True


# ------------------------------------------------- hazard 6: duplicate names


def test_public_duplicates_then_recreate_raises(world: list[dict[str, Any] | None]) -> None:
    for f in phase(world, "public_hazards_and_pins")[2:]:
        run = f["duplicates_public"]
        assert run["sums"][:2] == [5, 5]  # two live groups over [2, 3] both work...
        if PUBLIC_NAMES_REUSED:  # torch <= 2.13: ...until the older goes and it is made again
            assert run["again"] == (
                "ValueError: The specified group name has already been created, "
                "please use a different group name"
            )
            assert len(run["names"]) == 2
        else:  # torch >= 2.14: the third group gets a name of its own and works
            assert run["again"] is None
            assert run["sums"] == [5, 5, 5]
            assert len(set(run["names"])) == 3
        assert run["live"] == 1


def test_mesh_duplicates_then_recreate_works(world: list[dict[str, Any] | None]) -> None:
    for f in phase(world, "public_hazards_and_pins")[2:]:
        run = f["duplicates_mesh"]
        assert run["sums"] == [5, 5, 5, 5]
        assert len(set(run["names"])) == 3
        assert run["live"] == 1


# ------------------------------------------------- hazard 2: close() with a dead peer


def test_close_returns_promptly_after_a_peer_died(world: list[dict[str, Any] | None]) -> None:
    dead = world[workers.DEAD_RANK]
    assert dead is not None and dead[DIED] is True  # rank 3 died (os._exit) in the scope
    assert "peer_death" not in dead
    survivors = phase(world, "peer_death")
    assert len(survivors) == 3
    for rank, f in enumerate(survivors):
        expected = {0: [2, 1], 1: [4, 1, 6], 2: [2, 5, 6]}[rank]  # dp, tp, then [1, 2, 3]
        assert f["sums"] == expected
        assert f["peer_gone"] is True  # close() ran after the peer's process had ended
        assert f["live_open"] == len(expected) + 1
        assert f["elapsed"] < 10.0  # a bound on "never hangs", not a speed test
        assert f["live"] == 1  # everything but WORLD destroyed, locally


# ------------------------------------------------- hazard 3: non-members


def test_non_members_get_none(world: list[dict[str, Any] | None]) -> None:
    for rank, f in zip((2, 3), phase(world, "public_hazards_and_pins")[2:]):
        run = f["non_members"]
        if PUBLIC_NON_MEMBER_IS_NONE:  # torch <= 2.13's own answer, pinned
            assert run["public_repr"] == "None"
            assert (run["public_is_none"], run["public_is_sentinel"]) == (True, False)
        else:  # torch >= 2.14
            assert run["public_repr"] == repr(dist.GroupMember.NON_GROUP_MEMBER)
            assert (run["public_is_none"], run["public_is_sentinel"]) == (False, True)
        # The mesh's own answer is None on every release.
        assert run["helper"] == "None"
        assert run["indices_first"] == ([2] if rank == 2 else None)
        assert run["indices_last"] == ([3] if rank == 3 else None)
        assert run["indices_first_again_same"] is True
        assert run["indices_last_again_same"] is True
        assert run["sentinel_mapped"] == "None"  # NON_GROUP_MEMBER (2.14+) becomes None
        assert run["live"] == 1


# ------------------------------------------------- a backend the host cannot run


def test_nccl_without_a_gpu_is_rejected_up_front(world: list[dict[str, Any] | None]) -> None:
    for f in phase(world, "public_hazards_and_pins")[2:]:
        run = f["gpu_less_nccl"]
        for where in ("constructor", "per_call", "helper"):
            assert run[where] is not None, where
            assert run[where].startswith("ValueError: "), run[where]
            assert "'nccl' needs a CUDA device" in run[where], run[where]
            assert "never requested" not in run[where]
        assert run["constructor"].startswith("ValueError: backend 'nccl' cannot form a group")
        assert run["per_call"].startswith("ValueError: backend 'nccl' cannot form a group")
        assert run["live"] == 1


def test_unusable_backend_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("nccl", "NCCL", "cuda:nccl", "cpu:gloo,cuda:nccl"):
        assert "needs a CUDA device" in (_c10d.unusable_backend(backend) or ""), backend
    for backend in ("gloo", "cpu:gloo", "fake", "mpi"):
        assert _c10d.unusable_backend(backend) is None, backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _c10d.unusable_backend("cpu:gloo,cuda:nccl") is None


# ------------------------------------------------- hazard 4: double destroy


def test_double_destroy_is_skipped(world: list[dict[str, Any] | None]) -> None:
    for f in phase(world, "public_hazards_and_pins")[2:]:
        run = f["double_destroy"]
        assert run["works"] == 5
        assert (run["first"], run["second"]) == (True, False)
        assert run["torch_again"] == "ValueError: Invalid process group specified"  # the hazard
        assert run["destroy_world"] is False  # WORLD is never destroyed
        assert run["world_live"] is True
        assert run["live"] == 1


# ------------------------------------------------- hazard 5: order


def test_opposite_order_raises_group_formation_error_naming_axis_and_ranks(
    world: list[dict[str, Any] | None],
) -> None:
    results = phase(world, "order")
    assert len(results) == WORLD
    for rank, f in enumerate(results):
        assert f["error"] is not None, f"rank {rank} formed its group: no deadlock?"
        assert f["is_runtime_error"] is True
        if rank == 0:  # asked for tp first
            assert "along axis 'tp' over ranks [0, 1]" in f["error"]
        else:  # asked for (dp, tp) first
            assert "along axes ('dp', 'tp') over ranks [0, 1, 2, 3]" in f["error"]
        timed_out = False
        if rank in (0, 1):  # each waits for the other: a certain deadlock, said at once
            assert f["error"].startswith("deadlock in group formation: ranks [")
            assert f"rank {rank} waits for rank {1 - rank} in the gloo group" in f["error"]
        else:  # ranks 2 and 3 wait for rank 0: told of the deadlock, or of rank 0 at the timeout
            timed_out = "is held by a deadlock in group formation among ranks" not in f["error"]
            assert not timed_out or "within 0:00:06" in f["error"], f["error"]
        if timed_out:  # rank 0's state is known then and leads (in the cycle, or past it)
            assert (
                "rank 0 waits for rank 1 in another group" in f["error"]
                or "rank 0 is alive and outside any group request" in f["error"]
            ), f["error"]
            assert "Likely cause" not in f["error"]  # no generic causes: nothing is unknown
        else:
            assert "in different orders" in f["error"]
        assert f["elapsed"] < 60.0  # it ends: a bound on "never hangs"
        assert f["live"] == 1


def test_groups_form_again_after_a_formation_error(world: list[dict[str, Any] | None]) -> None:
    for rank, f in enumerate(phase(world, "order_recovers")):
        assert f["tp"] == PAIRS[rank]
        assert f["everyone"] == [0, 1, 2, 3]
        assert f["live"] == 1


# ------------------------------------------------- the private path, pinned


def test_private_path_names_count_one_generation_per_incarnation(
    world: list[dict[str, Any] | None],
) -> None:
    results = phase(world, "public_hazards_and_pins")[2:]
    for f in results:
        run = f["names"]
        assert run["supported"] is True
        assert run["names"] == run["expected_names"]
        first = run["generations"][0]
        assert first >= 1
        assert run["generations"] == [first, first + 1, first + 2]
        assert run["live"] == 1
    assert results[0]["names"]["names"] == results[1]["names"]["names"]  # members agree


def test_formation_ends_together_on_every_member(world: list[dict[str, Any] | None]) -> None:
    rank2, rank3 = phase(world, "public_hazards_and_pins")[2:]
    assert rank3["formation_ends_together"]["patched"] is True
    # Rank 3 finished 1.5 s late; rank 2's request returned only after that.
    assert rank2["formation_ends_together"]["peer_done"] is True
    assert rank2["formation_ends_together"]["works"] == 5


def test_fallback_to_public_new_group_warns_and_works(world: list[dict[str, Any] | None]) -> None:
    for rank, f in enumerate(phase(world, "fallback")):
        assert f["everyone"] == [0, 1, 2, 3]
        assert f["dp"] == [[0, 2], [1, 3], [0, 2], [1, 3]][rank]
        assert f["live_open"] == 3
        (warning,) = f["warnings"]  # once, for two groups made
        category, message = warning
        assert category == "RuntimeWarning"
        assert "falls back to public new_group" in message
        assert "Connect timeout" in message
        assert "already been created" in message
        assert all(re.fullmatch(r"[0-9a-f]{40}", name) for name in f["names"])  # torch's names
    assert len({f["made_before"] for f in phase(world, "fallback")}) == 1  # same history


def test_every_phase_restores_the_live_group_count(world: list[dict[str, Any] | None]) -> None:
    for check in workers.C10D_CHECKS:
        for rank, entry in enumerate(entries(world, check.__name__)):
            if entry is None:
                continue
            assert entry["live_before"] == entry["live_after"] == 1, (check.__name__, rank)
            assert entry["warnings"] == [], (check.__name__, rank)


def test_private_path_supported_on_this_torch() -> None:
    assert _c10d.private_path_supported() is True


def test_private_path_supported_through_torchs_own_logging_wrappers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch decorates c10d functions with functools.wraps loggers; one on the helper
    # must not push the mesh onto the hazardous public path.
    wrapped = _time_logger(c10d._new_process_group_helper)
    assert wrapped is not c10d._new_process_group_helper
    monkeypatch.setattr(c10d, "_new_process_group_helper", wrapped)
    assert _c10d.private_path_supported() is True


def test_private_path_refused_when_torch_internals_change(monkeypatch: pytest.MonkeyPatch) -> None:
    def _new_process_group_helper(group_size: int, group_rank: int) -> None:  # too few parameters
        raise AssertionError("never called")

    monkeypatch.setattr(c10d, "_new_process_group_helper", _new_process_group_helper)
    assert _c10d.private_path_supported() is False
    monkeypatch.undo()
    monkeypatch.setattr(c10d, "_world", object())  # a world without pg_map, pg_names, ...
    assert _c10d.private_path_supported() is False


def test_private_path_supported_with_the_older_options_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before torch 2.6 the helper's options parameter was called pg_options.
    def _new_process_group_helper(
        group_size: Any,
        group_rank: Any,
        global_ranks_in_group: Any,
        backend: Any,
        store: Any,
        group_name: Any,
        pg_options: Any = None,
        timeout: Any = None,
        pg_tag: Any = None,
        device_id: Any = None,
        group_desc: Any = None,
    ) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(c10d, "_new_process_group_helper", _new_process_group_helper)
    assert _c10d.private_path_supported() is True


def test_private_path_refused_for_an_unwrappable_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    # A wrapper that hides the helper (no functools.wraps) cannot be judged: refuse it.
    original = c10d._new_process_group_helper

    def _new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    monkeypatch.setattr(c10d, "_new_process_group_helper", _new_process_group_helper)
    assert _c10d.private_path_supported() is False


def test_group_name_format() -> None:
    name = _c10d.group_name([3, 1], "gloo", 7)
    assert re.fullmatch(r"scopedmesh-[0-9a-f]{20}-7", name)
    assert name == _c10d.group_name((1, 3), "gloo", 7)  # the ranks' order does not matter
    assert name != _c10d.group_name([1, 3], "gloo", 8)
    assert name != _c10d.group_name([1, 3], "nccl", 7)
    assert name != _c10d.group_name([1, 2], "gloo", 7)


class _CountingStore:
    """A store shared by threads that stand for members, counting each member's requests."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, [0]

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any) -> Any:
            self.requests[0] += 1
            return getattr(self.store, method)(*args)

        return call


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_formation_barrier_store_requests_and_zero_residue(size: int) -> None:
    """The barrier after formation: ``4n + 1`` store requests for n > 1 members, no key left.

    Each thread stands for one member whose gloo address is already in the store,
    as after connectFullMesh; the barrier releases them together and deletes every
    key of the incarnation (DESIGN hazard 8 and zero residue; the gloo worlds of
    test_heal and test_reliability prove both on real groups).
    """
    import threading
    from datetime import timedelta

    from torch.distributed import HashStore

    store, name = HashStore(), "scopedmesh-test-1"
    for key in _c10d.incarnation_keys(name, size, "gloo"):
        if "//cpu//" in key:
            store.set(key, "address")
    counted = [_CountingStore(store) for _ in range(size)]
    errors: list[BaseException] = []

    def member(group_rank: int) -> None:
        try:
            _c10d._all_formed(  # type: ignore[arg-type]
                counted[group_rank], name, size, group_rank, timedelta(seconds=30), "gloo"
            )
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    requests = sorted(c.requests[0] for c in counted)
    assert sum(requests) == (4 * size + 1 if size > 1 else 1), requests
    assert requests[-1] <= 5, requests  # nobody deletes the others' keys in turn
    assert [k for k in _c10d.incarnation_keys(name, size, "gloo") if store.check([k])] == []
    assert store.num_keys() == 0
