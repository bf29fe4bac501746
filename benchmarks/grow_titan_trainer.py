"""torchtitan's own Trainer as replicas, measured: ``python -m benchmarks.grow_titan_trainer
[--kills 2] [--steps 30] [--overlap]`` (needs torchtitan 0.3.0).

Runs ``python -m torchtitan.train --module scopedmesh.interop.titan_configs --config
llama3_debugmodel --scopedmesh.enable`` under ``scopedmesh replicas`` (3 replicas x 2
gloo ranks, FSDP2 inside each; the toy tokenizer and text set; 16-token sequences, 4
per replica per step).

- **step time, sums after vs in the backward pass**: one run without a kill each way
  (``--scopedmesh.overlap`` off, then on), the median time between committed steps
  from the 4th on, and the steps per second, side by side in one invocation;
- **per kill** (``--kills``): once the job is whole and 3 steps in, a random worker is
  SIGKILLed at a random moment from outside and the launcher restarts its replica:
  death -> the survivors' first reduced step; death -> the first step all 3
  contributed to (n/a: the replica came back only during the last step's wait);
  whether every registered part ended byte-identical in the 3 replicas.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "titan"))
import _titan_job as job  # the lane test's helpers: the command, reports, workers

REPLICAS, LOCAL = 3, 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(steps: int, overlap: bool, kill: bool, rng: random.Random) -> dict[str, Any]:
    """One job; its reports, the kill's time and victim (if any), and its wall time."""
    from scopedmesh import job_view
    from scopedmesh.interop.titan_assets import write_assets
    from scopedmesh.launch.store import connect_store

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_assets(root / "assets")
        extra = ["--scopedmesh.finish_wait", "120"] + (["--scopedmesh.overlap"] if overlap else [])
        args = job.trainer_args(root / "assets", root / "out", steps, *extra)
        port = _port()
        command = [
            sys.executable, "-m", "scopedmesh", "replicas", "--replicas", str(REPLICAS),
            "--nproc-per-replica", str(LOCAL), "--job-store", f"127.0.0.1:{port}",
            "--host-job-store", "--timeout", "600", "--", "-m", "torchtitan.train", *args,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="FATAL")
        started = time.time()
        with open(root / "launcher.log", "wb") as sink:
            launcher = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
        killed, victim = None, None
        try:
            if kill:
                store = connect_store("127.0.0.1", port, 120.0)
                while True:
                    view = job_view(store)
                    if view is not None and view.decision.size == REPLICAS and view.step >= 3:
                        break
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 1.0))
                pids = job.workers(launcher.pid)
                victim = rng.choice(sorted(pids))
                job.kill(pids[victim])
                killed = time.time()
            rc = launcher.wait(600)
        finally:
            if launcher.poll() is None:
                launcher.terminate()
                launcher.wait(30)
        if rc != 0:
            raise RuntimeError((root / "launcher.log").read_text()[-3000:])
        return {
            "reports": job.reports(root / "out" / "report"),
            "killed": killed,
            "victim": victim,
            "wall": time.time() - started,
        }


def median_step(reports: list[dict[str, Any]]) -> float:
    times = max((r["step_times"] for r in reports), key=len)
    return statistics.median(b - a for a, b in itertools.pairwise(times[3:]))


def equal(reports: list[dict[str, Any]]) -> bool:
    return all(
        r["parts"] == next(o for o in reports if o["coordinate"] == r["coordinate"])["parts"]
        for r in reports
    )


def kill_figures(out: dict[str, Any]) -> dict[str, Any]:
    killed, victim = out["killed"], out["victim"]
    survivor = next(r for r in out["reports"] if r["replica"] != victim[0] and r["coordinate"] == 0)
    commits = list(zip(survivor["step_times"], (tuple(m) for _, m, _ in survivor["history"])))
    after = [(t, m) for t, m in commits if t > killed]
    reduced = next((t for t, m in after if len(m) < REPLICAS), None)
    full = next((t for t, m in after if len(m) == REPLICAS), None)
    return {
        "victim": victim,
        "death_to_reduced": None if reduced is None else reduced - killed,
        "death_to_full": None if full is None else full - killed,
        "schedule": job.schedule(job.history(out["reports"])),
        "equal": equal(out["reports"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--kills", type=int, default=0, help="runs with a SIGKILL each")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--overlap", action="store_true", help="the kill runs overlap too")
    args = parser.parse_args()
    rng = random.Random()
    load = os.getloadavg()
    print(
        f"grow_titan_trainer: {REPLICAS} replicas x {LOCAL} ranks (FSDP2), torchtitan's Trainer "
        f"under scopedmesh replicas, gloo, {args.steps} steps; load {load[0]:.1f}/{load[1]:.1f}"
    )
    for overlap in (False, True):
        out = run(args.steps, overlap, False, rng)
        step = median_step(out["reports"])
        print(
            f"sums {'in the backward pass' if overlap else 'after the backward pass'}: "
            f"median step {step:.3f} s ({1 / step:.2f} steps/s), equal {equal(out['reports'])}, "
            f"job {out['wall']:.1f} s"
        )
    for kill in range(args.kills):
        f = kill_figures(run(args.steps, args.overlap, True, rng))
        shown = {k: (f"{v:.3f} s" if isinstance(v, float) else v) for k, v in f.items()}
        print(f"kill {kill + 1}: {shown}")
    load = os.getloadavg()
    print(f"load {load[0]:.1f}/{load[1]:.1f} after")


if __name__ == "__main__":
    main()
