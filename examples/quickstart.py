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
        where = ", ".join(f"{axis}={mesh.coordinate(axis)}" for axis in ("dp", "pp", "tp"))
    # every group the mesh made is destroyed here; nothing else is touched

    sums["world"] = rank_sum(None)  # WORLD still works
    text = " ".join(f"{axis}={total}" for axis, total in sums.items())
    line = f"rank {rank} ({where}): rank sums {text}; mesh closed={mesh.closed}"

    # Rank 0 prints every rank's line, in rank order.
    lines = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(line, lines, dst=0)
    if rank == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
