"""A training loop that grows back, for people without torchtitan: run it under the launcher.

    scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- examples/replicas_loop.py --steps 100

Each replica is a torchrun world of its own (2 gloo ranks here); ``Replicas``
averages each rank's gradients with the same rank of the other replicas and
decides, once per step, whether the step counts. A replica that dies is
restarted by its agent, admitted at a step boundary and caught up from a live
replica. Every worker prints its state's digest at the end: the digests of one
rank are equal in every replica.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from scopedmesh import JobFinishedError, Replicas
from scopedmesh.launch import job_from_environment


class Progress:
    """Registered beside the model: the step, and the membership each step trained with."""

    def __init__(self) -> None:
        self.step, self.sizes = 0, [0]

    def state_dict(self) -> dict[str, object]:
        return {"step": self.step, "sizes": list(self.sizes)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step, self.sizes = int(state["step"]), list(state["sizes"])  # type: ignore[call-overload, arg-type]


def say(line: str) -> None:
    """One line in one write: lines of workers that share a pipe never interleave."""
    os.write(1, (line + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds slept per step")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # this replica's own world
    job = job_from_environment(timeout=60.0)  # the job's store, this replica's index
    coordinate = dist.get_rank()
    tag = f"replica {job.replica} coordinate {coordinate} pid {os.getpid()}"
    say(f"{tag} started (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
    torch.manual_seed(coordinate)
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    progress = Progress()
    state = {"model": model, "optim": optim, "progress": progress}
    try:
        with Replicas(
            job.store, replica=job.replica, replicas=job.replicas, state=state, backend=job.backend
        ) as grow:
            while True:
                decision = grow.boundary()  # admits restarted replicas, catches them up
                # `steps` steps, then on until a step with every replica (at most 20x as many);
                # progress is registered state: every member decides alike
                whole = progress.sizes[-1] == job.replicas or progress.step >= 20 * args.steps
                if progress.step >= args.steps and whole:
                    if grow.finish():  # every replica ends on this step
                        break
                    continue  # a member redid the last step: boundary() re-syncs
                optim.zero_grad()
                seed = job.replica * 7919 + coordinate * 104729 + progress.step  # own data
                x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
                model(x).square().mean().backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                if grow.all_reduce_(grads):  # the verdict: this step counts everywhere
                    optim.step()
                    progress.step += 1
                    progress.sizes.append(decision.size)
                time.sleep(args.pace)
    except JobFinishedError as error:  # restarted after the end: nothing to rejoin
        say(f"{tag} {error}")
        dist.destroy_process_group()
        return
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, buffer)
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()[:16]
    sizes = "".join(str(s) for s in progress.sizes[1:])
    say(f"{tag} done: {progress.step} steps, sizes {sizes} digest {digest}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
