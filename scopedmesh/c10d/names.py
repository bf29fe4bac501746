"""Names and rank maps of group incarnations: pure arithmetic, no torch.

>>> group_name((0, 1), "gloo", 3)
'scopedmesh-40e50a5e73f9591580d9-3'
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence

from scopedmesh.layout.ints import as_range

__all__ = ["DESCRIPTION_LIMIT", "RankMap", "canonical_ranks", "group_description", "group_name"]

DESCRIPTION_LIMIT = 200  # characters of a group description torch keeps and logs


class RankMap(Mapping[int, int]):
    """Global rank -> group rank for evenly spaced ranks, in O(1) memory.

    torch keeps this map per group (``_world.pg_group_ranks``) and reads it with
    ``in``, ``[]``, ``keys()``, ``items()`` and ``len()``; a dict would cost
    O(group size) for every group.

    >>> rank_map = RankMap(range(4, 20, 4))
    >>> rank_map[12], 13 in rank_map, list(rank_map.items())
    (2, False, [(4, 0), (8, 1), (12, 2), (16, 3)])
    """

    __slots__ = ("_ranks",)

    def __init__(self, ranks: range) -> None:
        self._ranks = ranks

    def __getitem__(self, rank: int) -> int:
        try:
            return self._ranks.index(rank)
        except ValueError:
            raise KeyError(rank) from None

    def __contains__(self, rank: object) -> bool:
        return rank in self._ranks

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def __repr__(self) -> str:
        return f"RankMap({self._ranks!r})"


def canonical_ranks(ranks: Sequence[int]) -> range | tuple[int, ...]:
    """``ranks`` ascending: a ``range`` when evenly spaced, else a tuple.

    >>> canonical_ranks([6, 2, 4]), canonical_ranks((0, 1, 3))
    (range(2, 8, 2), (0, 1, 3))
    """
    if isinstance(ranks, range) and ranks.step > 0:
        return ranks
    ordered = sorted(ranks)
    return as_range(ordered) or tuple(ordered)


def group_name(ranks: Sequence[int], backend: str, generation: int) -> str:
    """The name of one incarnation of the group over ``ranks`` on ``backend``."""
    spaced = canonical_ranks(ranks)
    if isinstance(spaced, range):
        step = spaced.step if len(spaced) > 1 else 1
        members = f"{spaced.start}+{step}*{len(spaced)}"
    else:
        members = ",".join(map(str, spaced))
    text = f"{backend}|{members}"
    digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:20]
    return f"scopedmesh-{digest}-{generation}"


def group_description(axes: Sequence[str], indices: object = None) -> str:
    """The description torch's tools show for a mesh's group (flight recorder, logs): its axes.

    ``indices`` are the positions chosen along the axes, as given to
    ``get_group_along_axis`` (one sequence, or one per axis). Axis names can be
    any length, so the text is cut at ``DESCRIPTION_LIMIT`` characters.

    >>> group_description(("dp", "tp")), group_description(("pp",), [0, -1])
    ('scopedmesh:dp,tp', 'scopedmesh:pp[0,-1]')
    >>> len(group_description(("x" * 10_000,))) == DESCRIPTION_LIMIT
    True
    """
    if indices is None:
        text = ",".join(axes)
    else:
        per_axis = [indices] if len(axes) == 1 else list(indices)  # type: ignore[call-overload]
        text = ",".join(
            f"{axis}[{','.join(str(i) for i in chosen)}]" for axis, chosen in zip(axes, per_axis)
        )
    text = f"scopedmesh:{text}"
    return text if len(text) <= DESCRIPTION_LIMIT else text[: DESCRIPTION_LIMIT - 1] + "…"
