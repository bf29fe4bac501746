"""Each NCCL call a heal makes, timed alone in one pair of ranks (a GPU host).

    python -m benchmarks.nccl_calls            # prints each rank's figures (JSON)

Two spawned ranks (on one GPU, each with its own ``NCCL_HOSTID``, the rig of
docs/GPU.md; WORLD gloo) time, in seconds:

* ``form_pair`` / ``form_pair_2`` / ``form_pair_3``: forming a 2-rank NCCL group and
  its first all_reduce (the process's first communicator, then later ones);
  ``form_single``: the same for a 1-rank group; ``first_on_formed_single``: one
  all_reduce on that group once formed;
* ``A_abort_idle_pair``: ``ProcessGroup.abort()`` of an idle pair, the peer alive,
  then ``A_after_abort_single``: one all_reduce on the 1-rank group;
* ``B_*`` (rank 0): a pair with an all_reduce in flight that rank 1 never joins,
  aborted on another thread: ``B_sync_after_abort_start`` until
  ``torch.cuda.synchronize()`` returns (the kernel exited),
  ``B_single_collective_during_abort`` one all_reduce on the 1-rank group meanwhile,
  ``B_abort_thread`` the abort itself;
* ``C_destroy_pair``: ``destroy_process_group`` of a healthy pair;
* ``D_abort_pair_peer_gone`` (rank 0): ``abort()`` of a pair whose peer exited.

docs/GPU.md records a run (H200, torch 2.11, NCCL 2.28.9).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.heal_nccl import RANK_ENV, place


def _child(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK_ENV)
    device = place(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    r: dict[str, float] = {}

    def all_reduce(group: Any) -> None:
        dist.all_reduce(torch.ones(1, device=device), group=group)
        torch.cuda.synchronize()

    def form(ranks: list[int]) -> tuple[Any, float]:
        start = time.perf_counter()
        group = dist.new_group(ranks, backend="nccl")
        if rank in ranks:
            all_reduce(group)
        return group, time.perf_counter() - start

    pair, r["form_pair"] = form([0, 1])
    single0, s0 = form([0])
    single1, s1 = form([1])
    mine = single0 if rank == 0 else single1
    r["form_single"] = s0 if rank == 0 else s1
    start = time.perf_counter()
    all_reduce(mine)
    r["first_on_formed_single"] = time.perf_counter() - start

    dist.barrier()
    start = time.perf_counter()
    pair.abort()
    r["A_abort_idle_pair"] = time.perf_counter() - start
    start = time.perf_counter()
    all_reduce(mine)
    r["A_after_abort_single"] = time.perf_counter() - start

    stuck, r["form_pair_2"] = form([0, 1])
    dist.barrier()
    if rank == 0:
        dist.all_reduce(torch.ones(1, device=device), group=stuck, async_op=True)
        time.sleep(0.2)  # in flight: rank 1 never joins
        took: dict[str, float] = {}

        def abort() -> None:
            begun = time.perf_counter()
            stuck.abort()
            took["abort"] = time.perf_counter() - begun

        start = time.perf_counter()
        thread = threading.Thread(target=abort)
        thread.start()
        torch.cuda.synchronize()
        r["B_sync_after_abort_start"] = time.perf_counter() - start
        begun = time.perf_counter()
        all_reduce(mine)
        r["B_single_collective_during_abort"] = time.perf_counter() - begun
        thread.join()
        r["B_abort_thread"] = took["abort"]
    dist.barrier()

    healthy, r["form_pair_3"] = form([0, 1])
    dist.barrier()
    start = time.perf_counter()
    dist.destroy_process_group(healthy)
    r["C_destroy_pair"] = time.perf_counter() - start

    orphan, _ = form([0, 1])
    dist.barrier()
    if rank == 1:
        Path(out, "rank1.json").write_text(json.dumps(r))
        os._exit(0)  # the peer is gone
    time.sleep(1.0)
    start = time.perf_counter()
    orphan.abort()
    r["D_abort_pair_peer_gone"] = time.perf_counter() - start
    Path(out, "rank0.json").write_text(json.dumps(r))
    os._exit(0)


def main() -> int:
    if not torch.cuda.is_available():
        print("nccl_calls: needs a CUDA device (see docs/GPU.md)", file=sys.stderr)
        return 1
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")  # CUDA: never fork
    with tempfile.TemporaryDirectory() as out:
        ranks = [context.Process(target=_child, args=(r, store.port, out)) for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(100)
            if process.is_alive():
                process.kill()
        for r in range(2):
            path = Path(out, f"rank{r}.json")
            print(r, path.read_text() if path.exists() else "no report", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
