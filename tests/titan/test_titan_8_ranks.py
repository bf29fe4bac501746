"""HSDP + TP (dp_replicate 2 x dp_shard 2 x tp 2) on 8 gloo ranks, against torchtitan's own meshes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="needs the extra: pip install 'scopedmesh[torchtitan]'")

import _train


@pytest.mark.world(8, timeout=400)
def test_hsdp_and_tp_on_8_ranks_match_torchtitans_own_meshes(world: Any) -> None:
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers "fake"

    assert fake_pg.FakeProcessGroup is not None
    out = _train.compare(world.world_size, (2, 2, 2), steps=2)
    ours, theirs = out["ours"], out["theirs"]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    groups = out["ours_groups"]
    assert groups["real"] == len(groups["rank_sets"]), out  # one communicator per rank set
    every_rank = tuple(range(8))
    assert set(groups["rank_sets"]) == set(out["theirs_groups"]["rank_sets"]) | {every_rank}, out
    assert out["theirs_groups"]["real"] > len(out["theirs_groups"]["rank_sets"]), out
    assert out["ours_left"]["groups"] == 0, out
