"""torchtitan's own parallelization (``parallelize_llama``: TP, FSDP2, HSDP) on scoped meshes.

One 4-rank gloo world serves the module (``reuse=True``: torchtitan is imported
once per rank), and one 8-rank test covers HSDP + TP. The model is llama3's
debug model cut to 2 layers, trained 2 steps on a fixed batch; every layout
starts from the same weights (made in one process), so its losses are compared
with torchtitan's own ``ParallelDims.build_mesh()`` (same code, same test,
within 1e-6 relative) and with a one-process reference.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="needs the extra: pip install 'scopedmesh[torchtitan]'")

import _train
from hypothesis import given, settings
from hypothesis import strategies as hs

pytestmark = pytest.mark.world(4, reuse=True, timeout=300)

STEPS = 2


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The losses of the same training in one process, without parallelism."""
    return _train.train(None, steps=STEPS)


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def _register_fake() -> None:
    """torch registers its "fake" backend (torchtitan's unused axes) on this import."""
    import torch.testing._internal.distributed.fake_pg as fake_pg

    assert fake_pg.FakeProcessGroup is not None


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 1)], ids=["fsdp2-tp2", "hsdp2x2"])
def test_losses_match_torchtitans_own_meshes(
    world: Any, layout: tuple[int, int, int], reference: list[float]
) -> None:
    _register_fake()
    out = _train.compare(world.world_size, layout, steps=STEPS)
    assert close(out["ours"], out["theirs"], 1e-6), (out["ours"], out["theirs"])
    assert close(out["ours"], reference, 1e-5), (out["ours"], reference)
    ours, theirs = out["ours_groups"], out["theirs_groups"]
    # One communicator per rank set, whichever mesh asks: torchtitan's own build_mesh
    # makes a group per mesh dimension, several over one set (and reuses WORLD for its
    # world mesh, where scoped meshes make one group over every rank, like any other set).
    assert ours["real"] == len(ours["rank_sets"]), out
    every_rank = tuple(range(world.world_size))
    assert set(ours["rank_sets"]) == set(theirs["rank_sets"]) | {every_rank}, out
    assert theirs["real"] > len(theirs["rank_sets"]), out
    assert out["ours_trained"]["groups"] == out["theirs_trained"]["groups"] == 0, out
    assert out["ours_left"]["groups"] == 0, out  # the block left nothing


def test_a_sweep_of_blocks_leaves_no_group_between_blocks(world: Any) -> None:
    from scopedmesh import ProcessGroupMesh
    from scopedmesh.interop.torchtitan import ScopedParallelDims

    _register_fake()
    start = _train.live()
    seen = []
    for dp_replicate, dp_shard, tp in [(1, 2, 2), (1, 4, 1), (2, 2, 1), (1, 2, 2)]:
        with ProcessGroupMesh(world.world_size, names=("world",)) as mesh:
            with ScopedParallelDims(
                mesh,
                dp_replicate=dp_replicate,
                dp_shard=dp_shard,
                tp=tp,
                spmd_backend="partial_dtensor",
            ) as dims:
                losses = _train.train(dims, steps=STEPS)
                inside = _train.census(_train.live() - start)
        assert _train.live() == start  # nothing left between blocks
        assert inside["real"] == len(inside["rank_sets"])  # one communicator per rank set
        assert all(loss == loss for loss in losses)  # finite, trained
        seen.append(inside)
    assert seen[0] == seen[3]  # the same layout again: the same groups, made afresh


LAYOUTS_4 = [(1, 4, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2), (4, 1, 1), (1, 1, 4)]


@settings(max_examples=3, deadline=None)
@given(layout=hs.sampled_from(LAYOUTS_4))
def test_drawn_layouts_train_like_one_process(
    world: Any, layout: tuple[int, int, int], reference: list[float]
) -> None:
    from scopedmesh import ProcessGroupMesh
    from scopedmesh.interop.torchtitan import ScopedParallelDims

    _register_fake()
    start = _train.live()
    dp_replicate, dp_shard, tp = layout
    with ProcessGroupMesh(world.world_size, names=("world",)) as mesh:
        with ScopedParallelDims(
            mesh,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            spmd_backend="partial_dtensor",
        ) as dims:
            losses = _train.train(dims, steps=STEPS)
    assert close(losses, reference, 1e-5), (layout, losses, reference)
    assert _train.live() == start


def test_two_models_on_two_meshes_open_at_once(world: Any, reference: list[float]) -> None:
    """Two meshes over the same ranks, two FSDP2 + TP models, steps interleaved.

    FSDP2 builds each sharded parameter's (fsdp, tp) mesh with torch's
    ``DeviceMesh._concatenate``, as torch's own class; it keeps the first mesh's
    ``_preserve_rank_order``, which a scoped DeviceMesh tags with its incarnation
    (docs/lifetime.md), so the two models' such meshes are unequal and DTensor
    never hands one model's parameter the other's mesh. Each model trains exactly
    as alone (same rank sets, so the same numbers), every DTensor runs on its own
    mesh's groups, and closing one model first leaves the other training.
    """
    from contextlib import ExitStack

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from scopedmesh import ProcessGroupMesh
    from scopedmesh.interop.torchtitan import ScopedParallelDims

    _register_fake()
    start = _train.live()
    kw: dict[str, Any] = dict(dp_shard=2, tp=2, spmd_backend="partial_dtensor")
    with ExitStack() as b_stack:
        with ExitStack() as a_stack:
            mesh_a = a_stack.enter_context(ProcessGroupMesh(world.world_size, names=("world",)))
            dims_a = a_stack.enter_context(ScopedParallelDims(mesh_a, **kw))
            mesh_b = b_stack.enter_context(ProcessGroupMesh(world.world_size, names=("world",)))
            dims_b = b_stack.enter_context(ScopedParallelDims(mesh_b, **kw))
            runs = [_train.Run(dims_a), _train.Run(dims_b)]
            for _ in range(STEPS):
                for run in runs:
                    run.step()
            assert close(runs[0].losses, reference, 1e-5), runs[0].losses
            assert runs[0].losses == runs[1].losses
            names = [_train.group_names(dims) for dims in (dims_a, dims_b)]
            assert not names[0] & names[1]
            for run, own in zip(runs, names):
                tensors = run.dtensors()
                assert tensors and all(isinstance(t, DTensor) for t in tensors)
                crossed = [t for t in tensors if not set(t.device_mesh._dim_group_names) <= own]
                assert not crossed, f"{len(crossed)} DTensors carry the other model's mesh"
            params = [r.model.layers["0"].attention.wo.weight.device_mesh for r in runs]
            assert type(params[0]) is DeviceMesh  # torch's own class, from _concatenate
            assert params[0] != params[1] and hash(params[0]) != hash(params[1])
        runs[1].step()  # model A and its mesh are closed: model B goes on
        assert runs[1].losses[-1] == runs[1].losses[-1]
    assert _train.live() == start
