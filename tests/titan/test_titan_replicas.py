"""torchtitan on Replicas (issue 39): 3 replicas x 2 gloo ranks of llama3's debug model,
FSDP2 inside each replica over ``ScopedParallelDims``, a replica SIGKILLed from here at a
random moment and restarted (``examples/titan_replicas.py`` is the job and its launcher).

Done means: the job is back to 3 replicas; the ranks of each coordinate hold
bit-identical weights and optimizer state in every replica; the losses and the final
weights equal a one-process, unsharded replay of the membership schedule the job went
through, within float32's reordering (FSDP2's reduce-scatter, gloo's sum over the
replicas and the half batches sum in another order than one process does), and a
replay of any other schedule is far outside that bound.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="needs the extra: pip install 'scopedmesh[torchtitan]'")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import titan_replicas as example  # the ranks import it by this name too

REPLICAS, LOCAL = 3, 2
BOUND = 400.0  # seconds: a generous "never hang" bound for the job, not a performance figure
# float32 summed in another order: measured max |loss - replay| 7e-5 (relative 2e-5) over
# 22 steps, |weight - replay| 5e-4 (AdamW turns tiny gradient differences into lr-sized
# steps). A replay that leaves one replica out of one step differs by more than this.
LOSS_RTOL, WEIGHT_ATOL = 1e-4, 3e-3


def _wrong(history: list[tuple[int, tuple[int, ...], float]]) -> list[Any]:
    """``history`` with every step at full shape: the schedule the job did not follow."""
    return [(s, tuple(range(REPLICAS)), x) for s, _, x in history]


def test_a_killed_torchtitan_replica_rejoins_equal_to_a_one_process_replay() -> None:
    out = example.run(REPLICAS, LOCAL, after=4, warm_steps=3, bound=BOUND, rng=random.Random())
    results, victim = out["results"], out["victim"]
    facts = example.check(out, REPLICAS, LOCAL, do_replay=True)
    assert facts["ranks"] == [(r, c) for r in range(REPLICAS) for c in range(LOCAL)]
    assert facts["restarted"] == [victim[0]], (facts["restarted"], out["failures"][-2:])
    assert facts["whole"], {k: r["replicas"] for k, r in results.items()}
    # Bit-identical: the sha256 of each rank's local shards of the weights and AdamW's state.
    assert facts["same_state"], {k: r["digest"][:12] for k, r in results.items()}
    assert facts["weights_bitwise"]  # and the gathered weights, tensor by tensor
    assert facts["same_history"]
    assert facts["steps"] == list(range(len(facts["steps"])))  # no step twice, none lost
    runs = [members for members, _ in facts["schedule"]]
    full = tuple(range(REPLICAS))
    assert runs[-1] == full, facts["schedule"]
    # Before the kill, the full job; then (unless the heal itself admitted the restarted
    # replica) the survivors alone; then the full job again.
    survivors = tuple(r for r in full if r != victim[0])
    assert runs in ([full, survivors, full], [full]), facts["schedule"]
    if runs == [full, survivors, full]:  # admitted a step after the heal: a catch-up
        caught_up = {
            epoch
            for result in results.values()
            for epoch, role, nbytes, _ in result["transfers"]
            if role == "received" and nbytes > 0
        }
        assert caught_up, [r["transfers"] for r in results.values()]
    # The losses and the final weights of a one-process replay of that schedule.
    recorded, replayed = torch.tensor(facts["recorded"]), torch.tensor(facts["replayed"])
    torch.testing.assert_close(recorded, replayed, rtol=LOSS_RTOL, atol=0)
    assert facts["weight_diff"] <= WEIGHT_ATOL, facts["weight_diff"]
    if runs != [full]:  # the bound tells schedules apart
        wrong, _ = example.replay(_wrong(results[(0, 0)]["history"]), LOCAL)
        assert (recorded - torch.tensor(wrong)).abs().max() > LOSS_RTOL * recorded.abs().max()
    print(
        f"\nRELIABILITY titan replicas: killed {victim}, schedule {facts['schedule']}, "
        f"max |loss - replay| {facts['loss_diff']:.2g}, |weight - replay| {facts['weight_diff']:.2g}"
    )
