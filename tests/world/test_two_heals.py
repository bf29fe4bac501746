"""Two meshes under one watch, one rank SIGKILLed from outside: both heal, each to its own.

A composition users run (two models, or a model and its evaluator, on two meshes
over the same ranks) and a path the single-mesh heal tests do not walk: one
death aborts both meshes; each loop's step fails, agrees and re-forms on its own.
The killed rank's ``dp`` partner sits out of the 2 x 2 mesh but trains on in the
4-rank one. Seeded: the kill's moment comes from the seed, the victim from the case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _workers_two_heals as workers
import pytest

pytestmark = pytest.mark.fault  # a marked lane: .ci/run runs it after the README's command


def _expected(name: str, step: int, ranks: list[int]) -> float:
    """Model "a": every ``dp`` replica of the 2 x 2 mesh adds ``step + 1 + its dp``;
    model "b": every rank adds ``step + 1 + rank``."""
    if name == "a":
        return float(sum(step + 1 + dp for dp in range(len(ranks) // 2)))
    return float(sum(step + 1 + r for r in ranks))


@pytest.mark.parametrize(("victim", "seed"), [(3, 1), (0, 2), (1, 46), (2, 52)])
def test_one_death_heals_both_meshes_of_one_watch(tmp_path: Path, victim: int, seed: int) -> None:
    result = workers.launch_and_kill(str(tmp_path), victim, seed)
    assert result["killed_at"] >= 2, result  # the launcher killed, after 2 steps of each
    assert result["exitcodes"][victim] == -9, result["exitcodes"]
    reports: dict[int, dict[str, Any]] = result["reports"]
    survivors = sorted(set(range(4)) - {victim})
    assert sorted(reports) == survivors, result
    partner = victim ^ 1  # shares the victim's dp slice of the 2 x 2 mesh
    final = {"a": sorted(set(survivors) - {partner}), "b": survivors}
    for rank, out in reports.items():
        assert "unexpected" not in out, f"rank {rank}:\n{out['unexpected']}"
        assert out["sat_out"] == (["a"] if rank == partner else []), (rank, out)
        for name in ("a", "b"):
            committed = out[name]
            steps = [s for s, _, _ in committed]
            assert steps == list(range(len(steps))), (rank, name, committed)  # once each
            if not (name == "a" and rank == partner):
                assert len(steps) == workers.STEPS, (rank, name, committed)
                assert committed[-1][2] == final[name], (rank, name, committed)
            for step, grad, ranks in committed:
                assert ranks in ([0, 1, 2, 3], final[name]), (rank, name, committed)
                assert grad == _expected(name, step, ranks), (rank, name, step, ranks, grad)
            assert out["weights"][name] == sum(g for _, g, _ in committed), (rank, out)
        # The watch counts each mesh's steps apart (the two meshes hold the same ranks).
        assert out["watch_committed"] == len(out["a"]) + len(out["b"]), (rank, out)
    for name in ("a", "b"):  # every member of the healed mesh saw the same history
        histories = [reports[r][name] for r in final[name]]
        assert all(h == histories[0] for h in histories), (name, histories)
        healed_from = [s for s, _, ranks in histories[0] if ranks == final[name]]
        assert healed_from and healed_from[0] >= 1, (name, histories[0])
