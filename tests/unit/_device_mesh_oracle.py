"""Ask torch's DeviceMesh for its groups, one fake world after another (run as a script).

Usage: ``python _device_mesh_oracle.py SHAPES_JSON OUT_JSON``. For every shape and
every rank of its world, this initialises a ``fake`` process group as that rank,
builds ``init_device_mesh("cpu", shape, mesh_dim_names=...)`` and records:

- ``single[d]``: ``get_process_group_ranks(dm.get_group(name_d))`` for this rank;
- ``pairs["i,j"]``: the same for the group of ``dm[(name_i, name_j)]._flatten()``;
- once per shape (from rank 0), ``mesh`` (``dm.mesh``) and the rows of ``dm.mesh``
  along each dim and pair of dims (the dims moved last, then reshaped).

The fake backend does no communication, and ``destroy_process_group()`` lets the
next world start in the same process. Exit status 77: this torch has no fake backend.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any


def probe(shapes: list[list[int]]) -> dict[str, Any]:
    import torch.distributed as dist

    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    except ImportError:
        sys.exit(77)
    from torch.distributed.device_mesh import init_device_mesh

    records: dict[str, Any] = {}
    for shape in shapes:
        world = 1
        for n in shape:
            world *= n
        names = tuple(f"ax{i}" for i in range(len(shape)))
        pairs = list(itertools.combinations(range(len(shape)), 2))
        ranks: list[dict[str, Any]] = []
        record: dict[str, Any] = {"shape": shape, "ranks": ranks}
        for rank in range(world):
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group("fake", store=store, rank=rank, world_size=world)
            try:
                dm = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
                entry: dict[str, Any] = {
                    "rank": rank,
                    "single": [dist.get_process_group_ranks(dm.get_group(n)) for n in names],
                    "pairs": {},
                }
                for i, j in pairs:
                    try:
                        flat = dm[(names[i], names[j])]._flatten(f"{names[i]}_{names[j]}")
                        members = dist.get_process_group_ranks(flat.get_group())
                    except RuntimeError as error:
                        # torch 2.9, after an earlier fake world: the flattened group is
                        # not registered; the test accepts None only there.
                        if "Could not resolve the process group" not in str(error):
                            raise
                        members = None
                    entry["pairs"][f"{i},{j}"] = members
                ranks.append(entry)
                if rank == 0:
                    mesh = dm.mesh
                    record["mesh"] = mesh.flatten().tolist()
                    record["rows"] = [
                        mesh.movedim(d, -1).reshape(-1, shape[d]).tolist()
                        for d in range(len(shape))
                    ]
                    record["pair_rows"] = {
                        f"{i},{j}": mesh.movedim((i, j), (-2, -1))
                        .reshape(-1, shape[i] * shape[j])
                        .tolist()
                        for i, j in pairs
                    }
            finally:
                dist.destroy_process_group()
        records["x".join(map(str, shape))] = record
    return records


def main() -> None:
    shapes = json.loads(sys.argv[1])
    with open(sys.argv[2], "w") as out:
        json.dump(probe(shapes), out)


if __name__ == "__main__":
    main()
