"""Node-aware rank tables: keep chosen axes inside a node (pure, standard library only).

Given a mesh shape, the axes whose groups must stay inside a node (say ``tp``)
and the node of every global rank, :func:`node_aware_ranks` returns the
``ranks=`` table for :class:`~scopedmesh.layout.mesh_layout.MeshLayout` or
``ProcessGroupMesh``. The rule, as JAX's ``create_hybrid_device_mesh`` splits a
mesh into a per-node part and an across-node part:

1. Nodes are numbered by their lowest rank; a node's ranks are taken ascending.
   Every node must hold the same number of ranks, ``L``.
2. The intra-node axes form a block of ``B`` positions (the product of their
   sizes); ``B`` must divide ``L``, so a node holds ``L // B`` whole blocks.
3. The other axes keep their C order among themselves; their positions fill
   node 0 first (``L // B`` of them a node), then node 1, and so on.
4. Within a node, the block's positions take the node's ranks in C order of the
   intra-node axes, after the blocks of the earlier outer positions.

So a group along any intra-node axes (one, several or all) lies on one node,
the user's axis order is kept, and every rank computes the same table. When the
intra-node axes are the trailing ones and the launcher numbers ranks node by
node (torchrun does), the table is the default ``range(world)``.

>>> node_aware_ranks((2, 2), [0, 1, 0, 1], "tp", names=("dp", "tp"))  # nodes interleaved
(0, 2, 1, 3)
>>> node_aware_ranks((2, 2, 2), [0] * 4 + [1] * 4, ("dp", "tp"), names=("dp", "pp", "tp"))
(0, 1, 4, 5, 2, 3, 6, 7)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Mapping, Sequence

from scopedmesh.errors import shown
from scopedmesh.layout.ints import is_int
from scopedmesh.layout.mesh_layout import Axes, MeshLayout

__all__ = ["node_aware_ranks", "node_numbers", "nodes_from_env"]

# torchrun's per-worker variables that describe where a worker is.
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def node_numbers(nodes: Sequence[Hashable]) -> tuple[int, ...]:
    """Each rank's node as 0, 1, ...: nodes numbered by their lowest rank.

    ``nodes[r]`` is any label of rank ``r``'s node (an int, a host name ...).

    >>> node_numbers(["b", "a", "b", "a"])
    (0, 1, 0, 1)
    """
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
        raise TypeError(
            f"nodes must be a sequence with one node label per rank, got {shown(nodes)}"
        )
    numbers: dict[Hashable, int] = {}
    try:
        return tuple(numbers.setdefault(label, len(numbers)) for label in nodes)
    except TypeError:
        raise TypeError(f"node labels must be hashable, got {shown(list(nodes))}") from None


def node_aware_ranks(
    shape: Sequence[int],
    nodes: Sequence[Hashable],
    intra_node: Axes | Sequence[str | int] = (),
    *,
    names: Sequence[str] | None = None,
) -> tuple[int, ...]:
    """The rank table (C order over ``shape``) that keeps ``intra_node`` axes inside a node.

    ``nodes[r]`` labels the node of global rank ``r``; ``shape`` may hold one
    ``-1``, inferred from ``len(nodes)``. Raises ``ValueError`` naming the
    numbers when the nodes differ in size or cannot hold the intra-node axes.

    >>> node_aware_ranks((2, 4), ["h1"] * 4 + ["h0"] * 4, "tp", names=("dp", "tp"))
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> node_aware_ranks((-1, 2), [0, 0, 1, 1, 0, 0, 1, 1], 0)  # axis 0 inside a node
    (0, 2, 1, 3, 4, 6, 5, 7)
    >>> node_aware_ranks((4, 2), [0, 0, 1, 1, 2, 2, 3, 3], 0)
    Traceback (most recent call last):
    ...
    ValueError: the intra-node axes (axis0=4) hold 4 ranks but a node holds only 2 ranks; ...
    """
    numbers = node_numbers(nodes)
    sizes = shape if isinstance(shape, Sequence) and all(is_int(n) for n in shape) else None
    if sizes is not None and -1 not in sizes and math.prod(sizes) != len(numbers):
        raise ValueError(
            f"shape {shown(tuple(sizes))} holds {math.prod(sizes)} ranks but nodes lists "
            f"{len(numbers)} ranks"
        )
    layout = MeshLayout(shape, names, range(len(numbers)))
    inner = _intra_axes(layout, intra_node)
    members = _node_members(numbers)
    block = math.prod(layout.shape[a] for a in inner)
    per_node = len(members[0])
    _check_node_holds(layout, inner, block, per_node=per_node)
    fill = per_node // block  # outer positions per node
    outer = [a for a in range(layout.ndim) if a not in inner]
    inner_sizes = [layout.shape[a] for a in inner]
    outer_sizes = [layout.shape[a] for a in outer]
    table = []
    for coord in itertools.product(*map(range, layout.shape)):
        k = _c_index([coord[a] for a in outer], outer_sizes)
        j = _c_index([coord[a] for a in inner], inner_sizes)
        table.append(members[k // fill][(k % fill) * block + j])
    return tuple(table)


def _node_members(numbers: Sequence[int]) -> list[list[int]]:
    """The ranks of each node, ascending; ``ValueError`` unless every node holds as many."""
    members: list[list[int]] = [[] for _ in range(max(numbers, default=-1) + 1)]
    for rank, node in enumerate(numbers):
        members[node].append(rank)
    sizes = [len(m) for m in members]
    if len(set(sizes)) > 1:
        counts = ", ".join(f"{n}: {s}" for n, s in enumerate(sizes))
        raise ValueError(
            f"nodes must hold equal numbers of ranks; ranks per node (numbered by lowest rank) "
            f"are {{{counts}}}"
        )
    return members


def _check_node_holds(
    layout: MeshLayout, inner: Sequence[int], block: int, *, per_node: int
) -> None:
    """``ValueError`` unless a node of ``per_node`` ranks holds whole blocks of the inner axes."""
    if per_node % block:
        labels = layout.names or tuple(f"axis{a}" for a in range(layout.ndim))
        axes = " x ".join(f"{labels[a]}={layout.shape[a]}" for a in inner)
        holds = f"only {per_node} ranks" if per_node < block else f"{per_node} ranks"
        raise ValueError(
            f"the intra-node axes ({axes}) hold {block} ranks but a node holds {holds}; "
            f"a node must hold a multiple of {block} ranks (keep fewer or smaller axes inside "
            f"a node)"
        )


def _intra_axes(layout: MeshLayout, intra_node: object) -> tuple[int, ...]:
    """``intra_node`` as sorted axis indices; an empty sequence is allowed."""
    if isinstance(intra_node, Sequence) and not isinstance(intra_node, str) and not intra_node:
        return ()
    return tuple(sorted(layout.axes_indices(intra_node, argument="intra_node")))  # type: ignore[arg-type]


def _c_index(coord: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coord, sizes):
        index = index * n + c
    return index


def nodes_from_env(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Every rank's node from one torchrun worker's environment, or None outside torchrun.

    torchrun numbers global ranks agent by agent (``RANK`` = the ranks of the
    agents with a lower ``GROUP_RANK`` + ``LOCAL_RANK``). When every agent runs
    ``LOCAL_WORLD_SIZE`` workers, rank ``r`` is on node ``r // LOCAL_WORLD_SIZE``.
    That is checked on this rank's numbers (``RANK = GROUP_RANK *
    LOCAL_WORLD_SIZE + LOCAL_RANK`` and, when set, ``WORLD_SIZE = GROUP_WORLD_SIZE
    * LOCAL_WORLD_SIZE``); an environment that breaks it is a ``ValueError``.

    >>> env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
    ...        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    >>> nodes_from_env(env)
    (0, 0, 0, 0, 1, 1, 1, 1)
    >>> nodes_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    True
    """
    if not all(key in env for key in _TORCHRUN):
        return None
    values: dict[str, int] = {}
    for key in (*_TORCHRUN, "GROUP_WORLD_SIZE"):
        if key not in env:
            continue
        try:
            values[key] = int(env[key])
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {shown(env[key])}") from None
    rank, world, local = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    per_node, group = values["LOCAL_WORLD_SIZE"], values["GROUP_RANK"]
    seen = ", ".join(f"{key}={value}" for key, value in values.items())
    if per_node < 1 or world < 1 or not 0 <= local < per_node or not 0 <= rank < world:
        raise ValueError(f"torchrun's environment is inconsistent: {seen}")
    groups = values.get("GROUP_WORLD_SIZE", world // per_node)
    if rank != group * per_node + local or world % per_node or world != groups * per_node:
        raise ValueError(
            f"torchrun's environment does not describe nodes of equal size numbered in rank "
            f"order ({seen}; expected RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK and "
            f"WORLD_SIZE = GROUP_WORLD_SIZE * LOCAL_WORLD_SIZE); pass each rank's node "
            f"explicitly, or gather host names instead"
        )
    return tuple(r // per_node for r in range(world))
