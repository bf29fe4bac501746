"""Quickstart: a (dp, pp, tp) mesh, one all_reduce per axis, and a nested scope.

    torchrun --standalone --nproc_per_node=8 examples/quickstart.py
    torchrun --standalone --nproc_per_node=4 examples/quickstart.py --shape 1 2 2

Each rank sums the global ranks of its group along every axis; rank 0 prints a line per rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from scopedmesh import ProcessGroupMesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 2, 2], metavar=("DP", "PP", "TP"))
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    rank = dist.get_rank()

    def rank_sum(group: dist.ProcessGroup | None) -> int:
        """The sum of the global ranks in `group`, by all_reduce."""
        t = torch.tensor([rank], device=device)
        dist.all_reduce(t, group=group)
        return int(t.item())

    with ProcessGroupMesh(*args.shape, names=("dp", "pp", "tp")) as mesh:
        tp = mesh.get_group_along_axis("tp")  # made on first use, cached
        sums = {axis: rank_sum(mesh.get_group_along_axis(axis)) for axis in ("dp", "pp", "tp")}
        with mesh.submesh("pp", "tp") as stage:  # nested scope over this rank's (pp, tp) plane
            assert stage.get_group_along_axis("tp") is tp  # shared cache: no duplicate group
            plane = stage.get_group_along_axis(("pp", "tp"))  # made and owned by the sub-mesh
            sums["pp*tp"] = rank_sum(plane)
        # the plane's group is destroyed here; tp lives on with the mesh
        coordinate = mesh.coordinate()
    # every group the mesh made is destroyed here; nothing else is touched

    sums["world"] = rank_sum(None)  # WORLD still works

    # Rank 0 prints a line per rank, in rank order (tensors only: no numpy needed).
    facts = torch.tensor([*coordinate, *sums.values(), int(mesh.closed)], device=device)
    table = [torch.empty_like(facts) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(facts, table, dst=0)
    if table is not None:
        for r, row in enumerate(table):
            values = [int(v) for v in row.tolist()]
            where = ", ".join(f"{axis}={c}" for axis, c in zip(("dp", "pp", "tp"), values))
            text = " ".join(f"{axis}={total}" for axis, total in zip(sums, values[3:-1]))
            print(f"rank {r} ({where}): rank sums {text}; mesh closed={bool(values[-1])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
