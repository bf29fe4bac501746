"""A dp x pp x tp mesh across torchrun nodes, checked against ``scopedmesh plan``.

Run by ``examples/launch_two_nodes.py`` (two torchrun agents on one machine, as
two nodes), or on a real cluster, one command a node:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --rdzv-id job1 examples/multinode.py

Every rank checks, and rank 0 prints a line per rank:

1. its node as torchrun says (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)
   is the node ``scopedmesh plan ... --nproc-per-node N`` gives its rank;
2. along every axis the plan calls intra-node, every group's members share one
   real ``GROUP_RANK`` (all-gathered as tensors), and the plan's node count of
   each of its groups is the real one;
3. an all_reduce along each axis sums the ranks the layout lists;
4. :func:`~scopedmesh.node_aware_mesh` built from torchrun's environment with
   ``dp`` and ``tp`` kept inside a node: their groups share one real ``GROUP_RANK``.

With ``--hold S`` it then all-reduces along every axis for S seconds, so that a
test can kill a peer mid-run: the survivors print ``lost a peer`` and exit 1. A
worker ends with its agent (Linux), so killing an agent is a node lost.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from scopedmesh import ProcessGroupMesh, node_aware_mesh
from scopedmesh.layout import MeshLayout
from scopedmesh.plan import make_plan

NAMES = ("dp", "pp", "tp")
INTRA = ("dp", "tp")  # what the node-aware mesh keeps inside a node


def say(line: str) -> None:
    """Print ``line`` in one write: lines of ranks that share a pipe never interleave."""
    os.write(1, (line + "\n").encode())


def gather(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), by one all_gather of tensors."""
    mine = torch.tensor(values, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [[int(v) for v in t.tolist()] for t in every]


def real_nodes_of(groups: tuple[tuple[int, ...], ...], node: list[int]) -> list[int]:
    """How many real nodes each group spans."""
    return [len({node[r] for r in group}) for group in groups]


def check(shape: tuple[int, ...], timeout: float) -> list[int]:
    """The checks 1-4 above; this rank's facts as ints (rank 0 prints them)."""
    rank = dist.get_rank()
    group_rank = int(os.environ["GROUP_RANK"])
    local_rank, nproc = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])

    plan = make_plan(shape, names=NAMES, nproc=nproc, rank=rank)  # = scopedmesh plan --json
    assert plan.rank is not None and plan.rank.node is not None
    if (plan.rank.node, rank % nproc) != (group_rank, local_rank):
        raise RuntimeError(
            f"rank {rank}: the plan puts it on node {plan.rank.node} as local rank "
            f"{rank % nproc}, torchrun on GROUP_RANK {group_rank} LOCAL_RANK {local_rank}"
        )
    node = [row[0] for row in gather([group_rank])]  # every rank's real node
    layout = MeshLayout(shape, names=NAMES)
    for axis in plan.axes:
        groups = layout.groups(axis.axes)
        spans = real_nodes_of(groups, node)
        assert axis.nodes is not None
        if axis.nodes.placement == "intra-node" and max(spans) != 1:
            raise RuntimeError(f"{axis.label}: the plan says intra-node, real nodes {spans}")
        if axis.nodes.span is not None and axis.nodes.span != (min(spans), max(spans)):
            raise RuntimeError(f"{axis.label}: plan spans {axis.nodes.span}, real {spans}")

    sums = []
    with ProcessGroupMesh(*shape, names=NAMES, timeout=timeout) as mesh:
        coord = mesh.coordinate()
        for name in NAMES:
            t = torch.tensor([rank])
            dist.all_reduce(t, group=mesh.get_group_along_axis(name))
            if int(t.item()) != sum(layout.group(coord, name)):
                raise RuntimeError(f"rank {rank}: {name} sum {t.item()} is wrong")
            sums.append(int(t.item()))

    on_one_node = []
    with node_aware_mesh(*shape, names=NAMES, intra_node=INTRA, timeout=timeout) as aware:
        for name in NAMES:
            group = aware.get_group_along_axis(name)
            lowest, highest = torch.tensor([-group_rank]), torch.tensor([group_rank])
            dist.all_reduce(lowest, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
            one = -int(lowest.item()) == int(highest.item()) == group_rank
            if name in INTRA and not one:
                raise RuntimeError(f"rank {rank}: node-aware {name} group crosses nodes")
            on_one_node.append(int(one))
    return [rank, group_rank, local_rank, nproc, *coord, *sums, *on_one_node]


def hold(shape: tuple[int, ...], seconds: float, timeout: float) -> None:
    """All-reduce along every axis until ``seconds`` have passed (a peer may be killed)."""
    rank = dist.get_rank()
    step = 0
    try:
        with ProcessGroupMesh(*shape, names=NAMES, timeout=timeout) as mesh:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for name in NAMES:
                    dist.all_reduce(torch.ones(1), group=mesh.get_group_along_axis(name))
                dist.all_reduce(torch.ones(1))
                step += 1
                if step == 1:  # every group is formed: a test may kill this process now
                    say(f"rank {rank} pid {os.getpid()} holding")
                time.sleep(0.05)
    except Exception as error:  # a peer died: say so, in one line, and fail
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        say(f"rank {rank}: lost a peer at step {step}: {type(error).__name__}: {first}")
        os._exit(1)  # skip destroying WORLD, whose peers are gone


def die_with_agent() -> None:
    """On Linux, end this worker when its torchrun agent dies.

    torchrun starts workers in sessions of their own, so a worker outlives a
    killed agent (and its peers, still connected to it, never notice).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 2, 2], metavar=("DP", "PP", "TP"))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    parser.add_argument("--hold", type=float, default=0.0, help="then all-reduce for S seconds")
    args = parser.parse_args()
    shape = tuple(args.shape)

    die_with_agent()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    facts = check(shape, args.timeout)
    table = [torch.empty(len(facts), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(table, torch.tensor(facts))  # tensors only: no numpy needed
    if dist.get_rank() == 0:
        for row in table:
            rank, group_rank, local_rank, nproc, dp, pp, tp, *rest = (int(v) for v in row)
            sums, one = rest[:3], rest[3:]
            say(
                f"rank {rank}: node {group_rank} local {local_rank}/{nproc} = plan; "
                f"(dp, pp, tp) = ({dp}, {pp}, {tp}); sums "
                + " ".join(f"{n}={s}" for n, s in zip(NAMES, sums))
                + "; node-aware on one node: "
                + " ".join(f"{n}={'yes' if o else 'no'}" for n, o in zip(NAMES, one))
            )
        say(f"two-node check passed on {dist.get_world_size()} ranks")
    if args.hold:
        hold(shape, args.hold, args.timeout)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
