"""Grow back, measured: ``python -m benchmarks.grow [--replicas 4 --local 1 --kills 5]``.

``--backend nccl`` (a GPU host): the dp groups on NCCL, the weights and gradients
on each rank's GPU (two replicas on one GPU present a host id each:
``benchmarks.heal_nccl.place``); the catch-up sends the source's CUDA tensors
straight over NCCL. ``--backend gloo --device cuda``: the same CUDA state over
gloo, each tensor staged through host memory: the transfer column of the two
runs compares the two paths.

A :class:`~scopedmesh.testing.replicas.ReplicaJob` (the job's store in this
process, each replica its own gloo world, restarted when one of its ranks dies)
trains with :class:`~scopedmesh.fault.replicas.Replicas`: a 4 MiB all-reduce per
step (``--numel`` floats) and a ``--pace`` sleep. Each time the job is at full
shape, a random rank of a random replica other than 0 is SIGKILLed at a random
moment; the job restarts that replica ``--restart-delay`` seconds later (1 s,
as the torchft comparison does; 0: at once). Per kill it prints:

- **death -> reduced**: from the kill to the survivors' first agreed step without
  the dead replica (n/a: the restarted replica was admitted by the heal itself,
  so no step ran without it);
- **start -> full**: from the restarted process's start (the launcher's fork)
  to the first agreed step to which every replica contributed (the joiner's
  catch-up step, where it contributes nothing, does not count; torchft's
  healing step does not either); in brackets: from the moment its training
  function began, i.e. without interpreter and import time;
- **admitted** (when the joiner's report survives): from the restart to the end of
  its admission (the new epoch formed; its state arrives during the next step);
- **stall**: the survivors' step that admitted the joiner, minus their median
  step (both from agreed steps' end times);
- **transfer**: the bytes the source sent the joiner, and the time of the
  send (inside the admission's first step, before its all-reduce, since issue
  37; from the boundary's snapshot until the last byte left before it), or a
  broadcast's time after a heal.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.heal_nccl import RANK_ENV, place
from scopedmesh import Decision, job_view
from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.fault.replicas import Replicas
from scopedmesh.testing.replicas import ReplicaJob

KEYS = ReplicaKeys()
STOP, STEP = "bench/stop", "bench/step"  # the launcher's stop step; the source's step


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def rank_main(
    replica: int,
    coordinate: int,
    port: int,
    replicas: int,
    numel: int,
    pace: float,
    backend: str = "gloo",
    device_type: str = "cpu",
) -> dict[str, Any]:
    """One rank: train until the launcher's stop step; report agreed steps' end times."""
    started = time.time()
    torch.set_num_threads(1)  # as benchmarks/grow_torchft.py's replicas: the same workload
    device = torch.device("cpu")
    if device_type == "cuda":  # this slot's GPU and, on one GPU, its own NCCL host id
        device = place(replica * dist.get_world_size() + coordinate)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    weights = torch.nn.Parameter(torch.zeros(numel, device=device), requires_grad=False)
    progress = Progress()  # no torch.optim: its first step imports torch._dynamo (seconds)
    state = {"weights": torch.nn.ParameterList([weights]), "progress": progress}
    commits: list[tuple[float, int, int, int]] = []  # (time, epoch, size, contributors)
    with Replicas(
        store, replica=replica, replicas=replicas, state=state, timeout=60, backend=backend
    ) as grow:
        while True:
            stop = read(store, STOP)
            if stop is not None and progress.step >= int(stop) and grow.size == replicas:
                break
            decision = grow.boundary()
            grad = torch.full_like(weights, float(replica + 1))
            if grow.all_reduce_([grad]):
                weights.sub_(grad, alpha=0.1)
                progress.step += 1
                commits.append((time.time(), decision.epoch, decision.size, len(grow.contributors)))
                if decision.source == replica and coordinate == 0:
                    store.set(STEP, str(progress.step))
            time.sleep(pace)
        transfers = [(t.epoch, t.role, t.nbytes, t.seconds) for t in grow.transfers]
        entered = list(grow.entered)
    return {"started": started, "commits": commits, "transfers": transfers, "entered": entered}


def _decision(job: ReplicaJob) -> Decision | None:
    view = job_view(job.store)  # the public launcher's view
    return None if view is None else view.decision


def _whole(job: ReplicaJob, replicas: int, replica: int, token: str | None) -> bool:
    """The job is at full shape with a new incarnation of ``replica`` (not ``token``)."""
    decision = _decision(job)
    if decision is None or decision.size != replicas:
        return False
    return token is None or decision.token(replica) != token


def _wait(job: ReplicaJob, condition: Any, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        job.poll()
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {limit:g} s for {what}; failures: {job.failures[-2:]}")
        time.sleep(0.005)


def run(
    replicas: int,
    local: int,
    kills: int,
    numel: int,
    pace: float,
    delay: float,
    backend: str = "gloo",
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Start the job, kill ``kills`` times (each once the job is whole), collect reports."""
    job = ReplicaJob(
        rank_main,
        replicas=replicas,
        local=local,
        args=(replicas, numel, pace, backend, device),
        restart_delay=delay,
        max_restarts=kills + 2,  # every kill restarts a replica
    )
    job.start()
    rng, events = random.Random(), []
    try:
        token: tuple[int, str | None] = (0, None)  # the last victim and its incarnation
        for _ in range(kills):
            _wait(job, lambda t=token: _whole(job, replicas, *t), 300, "the full shape")
            time.sleep(rng.uniform(0.5, 1.5))
            victim = (rng.randrange(1, replicas), rng.randrange(local))
            decision = _decision(job)
            token = (victim[0], decision.token(victim[0]) if decision else None)
            before = len(job.restarts)
            job.kill(*victim)
            killed = time.time()
            _wait(job, lambda n=before: len(job.restarts) > n, 60, "the restart")
            events.append({"victim": victim, "killed": killed, "restarted": job.restarts[-1][1]})
        _wait(job, lambda: _whole(job, replicas, *token), 300, "the full shape")
        job.store.set(STOP, str(int(read(job.store, STEP) or 0) + 20))
        _wait(job, lambda: job.done, 300, "every rank to finish")
        return [_figures(event, job.results, replicas) for event in events]
    finally:
        job.stop()


def _figures(event: dict[str, Any], results: dict[Any, Any], replicas: int) -> dict[str, Any]:
    victim, killed = event["victim"], event["killed"]
    survivor = results[(0, 0)]["commits"]
    # The survivors' first agreed step in an epoch after the kill's: at the reduced shape,
    # or already at full shape when the restarted replica announced itself before the heal
    # decided. (A step the victim had agreed to before it died still commits in the old
    # epoch, at full shape: it is neither.)
    before = [epoch for t, epoch, _, _ in survivor if t <= killed]
    after = [c for c in survivor if c[0] > killed and c[1] > (before[-1] if before else -1)]
    first = after[0]
    reduced = first[0] if first[2] < replicas else None
    regrown = next((t, epoch) for t, epoch, size, _ in after if size == replicas)
    full = next(t for t, _, _, contributors in after if contributors == replicas)
    times = [t for t, _, _, _ in survivor]
    steps = [b - a for a, b in itertools.pairwise(times)]
    admitted = times.index(regrown[0])
    # The survivors' full steps are the joiner's too (one all-reduce).
    joiner = results.get((victim[0], victim[1]), {})
    first_full = next(
        (t for t, e, _, n in joiner.get("commits", []) if e == regrown[1] and n == replicas), None
    )
    sent = [t for t in results[(0, 0)]["transfers"] if t[0] == regrown[1] and t[1] == "sent"]
    return {
        "death_to_reduced": None if reduced is None else reduced - killed,
        "start_to_full": full - event["restarted"],
        # Only the last incarnation of a replica reports: an earlier joiner's start is gone.
        "fn_to_full": None if first_full is None else first_full - joiner["started"],
        "admitted": next(
            (t - event["restarted"] for e, t, _ in joiner.get("entered", []) if e == regrown[1]),
            None,
        ),
        "stall": steps[admitted - 1] - statistics.median(steps),
        "median_step": statistics.median(steps),
        "bytes": sent[0][2] if sent else None,
        "transfer_s": sent[0][3] if sent else None,
    }


def _fmt(value: float | None, unit: str = "s") -> str:
    return "   n/a" if value is None else f"{value:6.3f} {unit}"


def parser() -> argparse.ArgumentParser:
    """This module's own arguments (``python -m benchmarks.grow``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--local", type=int, default=1)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--numel", type=int, default=1 << 20, help="floats all-reduced per step")
    parser.add_argument("--pace", type=float, default=0.05)
    parser.add_argument(
        "--restart-delay", type=float, default=1.0, help="seconds from a death to the restart"
    )
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo", help="the dp groups' backend"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where the state lives (nccl: cuda; gloo: cpu)"
    )
    return parser


def main(given: argparse.Namespace | None = None) -> int:
    """Run the benchmark; ``given`` is ``python -m benchmarks.heal --grow``'s arguments
    (its ``--kills`` is used, the rest are this module's defaults)."""
    args = parser().parse_args() if given is None else parser().parse_args([])
    if given is not None and given.kills is not None:
        args.kills = given.kills
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl" and device != "cuda":
        raise SystemExit("grow: --backend nccl needs --device cuda (NCCL takes CUDA tensors)")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("grow: --device cuda (and --backend nccl) needs a GPU; torch sees none")
    if device == "cuda":  # before any rank starts: torch reads it when it makes a communicator
        for name, value in RANK_ENV.items():
            os.environ.setdefault(name, value)
    load = os.getloadavg()
    print(
        f"grow: {args.replicas} replicas x {args.local} ranks, {args.backend} on {device}, "
        f"{args.numel * 4 / 2**20:g} MiB all_reduce per step, {args.kills} kills, "
        f"restart {args.restart_delay:g} s after a death; "
        f"load {load[0]:.1f}/{load[1]:.1f}"
    )
    rows = run(
        args.replicas,
        args.local,
        args.kills,
        args.numel,
        args.pace,
        args.restart_delay,
        args.backend,
        device,
    )
    print("kill  death->reduced  start->full (in fn, admitted)  stall over median  transfer")
    for i, row in enumerate(rows, 1):
        nbytes = "n/a" if row["bytes"] is None else f"{row['bytes'] / 2**20:.2f} MiB"
        if row["bytes"] is not None and row["transfer_s"]:
            nbytes += f" ({row['bytes'] / row['transfer_s'] / 2**30:.2f} GiB/s)"
        print(
            f"{i:4}  {_fmt(row['death_to_reduced'])}  {_fmt(row['start_to_full'])} "
            f"({_fmt(row['fn_to_full'])}, {_fmt(row['admitted'])})  {_fmt(row['stall'])} (median step "
            f"{row['median_step']:.3f} s)  {nbytes} in {_fmt(row['transfer_s'])}"
        )
    load = os.getloadavg()
    print(f"load {load[0]:.1f}/{load[1]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
