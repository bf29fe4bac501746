"""The contracts with torch's private internals, one test per row of docs/ARCHITECTURE.md's table.

Each test fails, naming the contract, on a torch release that changes it; the
library's own tests would otherwise fail far from the cause (a formation that
hangs instead of being diagnosed, a DTensor cache that keeps a closed block's
meshes, two scopes' DeviceMeshes that compare equal).
"""

from __future__ import annotations

import gc
import tempfile
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from scopedmesh.c10d import store as _store
from scopedmesh.c10d.device_mesh import dtensor_caches

SHORT = timedelta(milliseconds=50)


def _raised(call: Any) -> BaseException:
    try:
        call()
    except BaseException as error:  # the contract is the type: return whatever it is
        return error
    raise AssertionError("expected the store request to raise")


# ------------------------------------------------------------------ store errors, by type


def test_a_store_waits_timeout_is_a_dist_store_error_and_a_lost_store_a_network_error() -> None:
    """Watch.wait tells a grace slice's timeout from a lost store by these types alone."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))  # type: ignore[attr-defined]
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))  # type: ignore[attr-defined]
    for store in (client, dist.PrefixStore("pin", client), dist.HashStore()):  # type: ignore[attr-defined]
        error = _raised(lambda store=store: store.wait(["absent"], SHORT))
        assert type(error) is dist.DistStoreError, (type(store).__name__, type(error), error)
        assert _store.wait_timed_out(error, 0.0, SHORT.total_seconds())
    # FileStore (file:// init) raises a plain RuntimeError at its timeout: it counts as a
    # timeout only once the whole wait has passed.
    with tempfile.NamedTemporaryFile() as file:
        files = dist.FileStore(file.name, 1)  # type: ignore[attr-defined]
        error = _raised(lambda: files.wait(["absent"], SHORT))
        assert isinstance(error, RuntimeError) and not isinstance(error, dist.DistNetworkError)
        assert _store.wait_timed_out(error, SHORT.total_seconds(), SHORT.total_seconds())
    del server
    gc.collect()
    lost = _raised(lambda: client.wait(["absent"], timedelta(seconds=2)))
    assert isinstance(lost, dist.DistNetworkError), (type(lost), lost)
    assert not _store.wait_timed_out(lost, 2.0, 2.0)  # never mistaken for a timeout


def test_compare_set_reads_an_absent_key_without_creating_it() -> None:
    """store.read: one request that never blocks and writes nothing."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))  # type: ignore[attr-defined]
    assert _store.read(server, "absent") is None
    assert not server.check(["absent"])
    server.set("present", "v")
    assert _store.read(server, "present") == "v"


def test_tcp_store_clones_a_client() -> None:
    """StoreUse.formation_store clones torch's client for a formation under threads."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))  # type: ignore[attr-defined]
    clone = server.clone()
    assert clone is not server
    clone.set("through-the-clone", "1")
    assert server.get("through-the-clone") == b"1"


# ------------------------------------------------------------------ torch's process-group registry


def test_torchs_group_registry_and_helper_are_as_groups_py_uses_them() -> None:
    from scopedmesh.c10d import groups as _c10d

    world = c10d._world
    for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag"):
        assert isinstance(getattr(world, name), dict), name
    assert isinstance(world.tags_to_pg, dict)
    for name in ("_get_default_store", "_get_default_group", "_get_default_timeout"):
        assert callable(getattr(c10d, name)), name
    assert _c10d.private_path_supported(), _c10d._helper_parameters()


# ------------------------------------------------------------------ gloo's rendezvous


def rendezvous_calls(rank: int, world_size: int) -> dict[str, Any]:
    """Record what gloo asks of the formation watch while a group forms over every rank."""
    from scopedmesh import ProcessGroupMesh
    from scopedmesh.c10d import diagnosis

    waits: list[list[str]] = []
    sets: list[str] = []
    gets: list[str] = []
    wait, set_, get = diagnosis.Watch.wait, diagnosis.WatchedStore.set, diagnosis.WatchedStore.get

    def recording_wait(self: Any, keys: list[str], timeout: Any) -> None:
        if not self.done:
            waits.append(list(keys))
        wait(self, keys, timeout)

    def recording_set(self: Any, key: str, value: Any) -> None:
        sets.append(key)
        set_(self, key, value)

    def recording_get(self: Any, key: str) -> bytes:
        gets.append(key)
        return get(self, key)

    diagnosis.Watch.wait = recording_wait  # type: ignore[method-assign]
    diagnosis.WatchedStore.set = recording_set  # type: ignore[method-assign]
    diagnosis.WatchedStore.get = recording_get  # type: ignore[method-assign]
    try:
        with ProcessGroupMesh(world_size, names=("x",), timeout=60) as mesh:
            group = mesh.get_group_along_axis("x")
            name = group.group_name
    finally:
        diagnosis.Watch.wait, diagnosis.WatchedStore.set, diagnosis.WatchedStore.get = (  # type: ignore[method-assign]
            wait,
            set_,
            get,
        )
    return {"waits": waits, "sets": sets, "gets": gets, "name": name}


def test_gloo_waits_on_the_formation_store_for_every_peers_address() -> None:
    """The diagnosis sees a formation only through ``wait``: gloo must call it on our store,
    for each peer's address (``<name>//cpu//0/<group rank>``), before it reads the address.
    A release that reads with ``get`` or ``multi_get`` alone would bypass the diagnosis."""
    from scopedmesh.testing import run_world

    size = 3
    for rank, calls in enumerate(run_world(rendezvous_calls, size, timeout=120)):
        peers = [_store.gloo_address_key(calls["name"], k) for k in range(size) if k != rank]
        own = _store.gloo_address_key(calls["name"], rank)
        waited = [key for keys in calls["waits"] for key in keys]
        assert set(peers) <= set(waited), calls  # gloo waited for each peer, through us
        assert own in calls["sets"], calls  # and wrote its own address through us
        for key in calls["gets"]:
            assert key in waited, (key, calls)  # nothing read that was not waited for first


# ------------------------------------------------------------------ DeviceMesh and DTensor


@pytest.mark.world(1)
def test_device_mesh_equality_and_hash_include_thread_id(world: Any) -> None:
    """ScopedDeviceMesh tells scopes apart through ``_thread_id``: torch's ``__eq__`` and
    ``__hash__`` must read it (its compile guard too: test_dtensor_scope's compiled test)."""
    from torch.distributed.device_mesh import DeviceMesh

    from scopedmesh import ProcessGroupMesh
    from scopedmesh.c10d.device_mesh import ScopedDeviceMesh

    whole = c10d.GroupMember.WORLD
    plain = DeviceMesh.from_group(whole, "cpu")
    other = DeviceMesh.from_group(whole, "cpu")
    assert plain == other and hash(plain) == hash(other)
    marked = DeviceMesh.from_group(whole, "cpu")
    marked._thread_id = 12345  # before its first hash: torch caches the hash
    assert marked != plain, "DeviceMesh.__eq__ no longer reads _thread_id"
    assert hash(marked) != hash(plain), "DeviceMesh.__hash__ no longer reads _thread_id"
    assert "_thread_id" in vars(DeviceMesh) or "_thread_id" in DeviceMesh.__annotations__
    meshes = []
    for _ in range(2):
        with ProcessGroupMesh(1, names=("x",)) as mesh:
            dm = mesh.to_device_mesh("cpu")
            assert isinstance(dm, ScopedDeviceMesh)
            assert isinstance(dm.__dict__.get("_dim_group_names"), list)  # torch's attribute
            meshes.append(dm)
    assert meshes[0] != meshes[1] and hash(meshes[0]) != hash(meshes[1])


def _has_rank_order_field() -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return "_preserve_rank_order" in getattr(DeviceMesh, "__annotations__", {})


@pytest.mark.skipif(
    not _has_rank_order_field(),
    reason="this torch's DeviceMesh has no _preserve_rank_order field (added after 2.13)",
)
@pytest.mark.world(1)
def test_concatenate_copies_the_first_meshs_rank_order_which_equality_reads(world: Any) -> None:
    """``DeviceMesh._concatenate`` (FSDP2's HSDP and FSDP2 + TP meshes) builds torch's own
    class; ScopedDeviceMesh tells such meshes apart only because it copies the first
    mesh's ``_preserve_rank_order`` and ``__eq__``/``__hash__`` read that field (its
    compile guard too: test_dtensor_scope's compiled test)."""
    from torch.distributed.device_mesh import DeviceMesh

    from scopedmesh import ProcessGroupMesh
    from scopedmesh.c10d.device_mesh import RankOrder

    whole = c10d.GroupMember.WORLD
    plain = DeviceMesh.from_group(whole, "cpu")
    marked = DeviceMesh.from_group(whole, "cpu")
    marked._preserve_rank_order = RankOrder(False, 12345)  # before its first hash
    assert marked != plain, "DeviceMesh.__eq__ no longer reads _preserve_rank_order"
    assert hash(marked) != hash(plain), "DeviceMesh.__hash__ no longer reads _preserve_rank_order"
    joined = []
    for _ in range(2):
        with ProcessGroupMesh(1, 1, names=("a", "b")) as mesh:
            dm = mesh.to_device_mesh("cpu")
            first = dm["a"]
            one = DeviceMesh._concatenate([first, dm["b"]])
            assert type(one) is DeviceMesh
            assert isinstance(one.__dict__["_preserve_rank_order"], RankOrder)
            assert one._preserve_rank_order == first._preserve_rank_order, "no longer copied"
            assert not one._preserve_rank_order  # torch's flag, False by default
            joined.append(one)
    assert joined[0] != joined[1] and hash(joined[0]) != hash(joined[1])


# The DTensor caches forget_closed_meshes clears, by name, and the releases that have
# each. Names that a release lacks are skipped there; a release that renames or drops one
# it should have fails here instead of keeping closed blocks' meshes.
CACHES_SINCE: dict[str, tuple[int, int]] = {
    "torch._C._clear_DTensor_sharding_propagator_cache": (2, 10),
    "ShardingPropagator.propagate_op_sharding": (2, 9),
    "ShardingPropagator._propagate_tensor_meta_cached": (2, 10),
    "_redistribute._gen_transform_infos": (2, 9),
    "_redistribute._planner_cache": (2, 10),
    "_collective_utils.MeshTopoInfo.build_from_mesh": (2, 9),
}
CACHES_UNTIL: dict[str, tuple[int, int]] = {  # torch 2.9's mesh-keyed maps
    "_mesh_resources.child_to_root_mapping": (2, 9),
    "_mesh_resources.root_to_flatten_mapping": (2, 9),
    "_mesh_resources.flatten_name_to_root_dims": (2, 9),
}


def test_dtensor_caches_are_found_by_name() -> None:
    import torch.distributed.tensor  # loaded, as DTensor users have it

    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    found = {name for name, cache in dtensor_caches().items() if cache is not None}
    expected = {name for name, since in CACHES_SINCE.items() if release >= since}
    expected |= {name for name, until in CACHES_UNTIL.items() if release <= until}
    assert expected <= found, f"torch {torch.__version__} lacks {sorted(expected - found)}"
