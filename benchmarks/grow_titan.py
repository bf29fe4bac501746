"""torchtitan on Replicas, measured: ``python -m benchmarks.grow_titan [--kills 3] [--tp]``
(needs torchtitan 0.3.0).

Runs ``examples/titan_replicas.py``'s job ``--kills`` times: 3 replicas x 2 gloo ranks
of llama3's debug model, FSDP2 (``--tp``: tensor parallel) inside each replica over
``ScopedParallelDims``, ``Replicas`` across them; once the job is whole and 3 steps
in, a random rank of a random replica is SIGKILLed at a random moment and its
replica restarts at once (a fresh fork of the launcher's warm server: torch
imported, torchtitan not). Per kill, as ``benchmarks.grow`` prints them:

- **death -> reduced**: from the kill to the survivors' first agreed step without
  the dead replica (n/a: the heal itself admitted the restarted replica);
- **start -> full**: from the restarted process's start (the launcher's fork) to
  the first agreed step every replica contributed to; in brackets, from its
  training function's start (torchtitan's import, the model's build and
  parallelization, the scoped meshes) and from its ``Replicas()`` (the library's
  part: join, admission, catch-up, the catch-up step);
- **stall**: the survivors' step that admitted the joiner, minus their median step;
- **equal**: every replica's weights and AdamW state bit-identical per coordinate.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import titan_replicas as example  # the ranks import it by this name too

REPLICAS, LOCAL = 3, 2


def figures(out: dict[str, Any]) -> dict[str, Any]:
    results, victim, killed = out["results"], out["victim"], out["killed"]
    survivor = results[(min(r for r in range(REPLICAS) if r != victim[0]), 0)]["commits"]
    before = [epoch for t, epoch, _, _ in survivor if t <= killed]
    after = [c for c in survivor if c[0] > killed and c[1] > (before[-1] if before else -1)]
    reduced = after[0][0] if after[0][2] < REPLICAS else None
    regrown = next(t for t, _, size, _ in after if size == REPLICAS)
    full = next(t for t, _, _, contributors in after if contributors == REPLICAS)
    times = [t for t, _, _, _ in survivor]
    steps = [b - a for a, b in itertools.pairwise(times)]
    joiner = results[victim]
    restarted = out["restarts"][-1][1]
    return {
        "victim": victim,
        "death_to_reduced": None if reduced is None else reduced - killed,
        "start_to_full": full - restarted,
        "fn_to_full": full - joiner["started"],
        "lib_to_full": full - joiner["constructed"],
        "stall": steps[times.index(regrown) - 1] - statistics.median(steps),
        "median_step": statistics.median(steps),
        "equal": example.check(out, REPLICAS, LOCAL, False)["same_state"],
    }


def _fmt(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="runs, one kill each")
    parser.add_argument("--tp", action="store_true", help="tp=2 inside a replica (else FSDP2)")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # killed peers' gloo errors
    load = os.getloadavg()
    inside = "tp=2" if args.tp else "FSDP2 dp_shard=2"
    print(
        f"grow_titan: {REPLICAS} replicas x {LOCAL} ranks ({inside}), llama3 debug model, gloo, "
        f"{args.kills} kills (a run each), restart at once; load {load[0]:.1f}/{load[1]:.1f}"
    )
    print("kill  victim  death->reduced  start->full (in fn, Replicas())  stall over median  equal")
    rng = random.Random()
    for i in range(1, args.kills + 1):
        row = figures(example.run(REPLICAS, LOCAL, tp=args.tp, after=5, rng=rng))
        print(
            f"{i:4}  {row['victim']}  {_fmt(row['death_to_reduced'])}  "
            f"{_fmt(row['start_to_full'])} ({_fmt(row['fn_to_full'])}, {_fmt(row['lib_to_full'])})  "
            f"{_fmt(row['stall'])} (median step {row['median_step']:.3f} s)  {row['equal']}"
        )
    load = os.getloadavg()
    print(f"load {load[0]:.1f}/{load[1]:.1f} after")


if __name__ == "__main__":
    main()
