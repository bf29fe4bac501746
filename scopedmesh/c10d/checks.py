"""Checks of the mesh's torch-facing arguments: backend names, timeouts, rank lists and tags.

>>> check_timeout(1.5)
datetime.timedelta(seconds=1, microseconds=500000)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

from scopedmesh.c10d.groups import unusable_backend
from scopedmesh.errors import shown
from scopedmesh.layout.ints import is_int

__all__ = [
    "MAX_TIMEOUT",
    "TAG_LIMIT",
    "check_backend",
    "check_tag",
    "check_timeout",
    "sorted_ranks",
]

MAX_TIMEOUT = timedelta(microseconds=2**63 - 1)  # about 292,000 years
TAG_LIMIT = 200  # characters of an agreement's tag, which becomes part of its store keys


def check_backend(backend: object, argument: str) -> str | None:
    """``backend`` as torch's canonical name, or None; an error if this build lacks it."""
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            f"{argument} must be a backend name such as 'gloo' or 'nccl', got {shown(backend)}"
        )
    try:
        name = str(dist.Backend(backend))
    except ValueError:
        raise ValueError(
            f"{argument} {shown(backend)} is not a torch.distributed backend; "
            "use e.g. 'gloo', 'nccl' or 'fake'"
        ) from None
    # dist.Backend() takes any name; an unknown or unbuilt one fails later, inside torch.
    missing = [
        p for p in (q.split(":")[-1] for q in name.split(",")) if not dist.is_backend_available(p)
    ]
    if missing:
        raise ValueError(
            f"{argument} {shown(backend)} is not available in this torch build ({shown(missing[0])} is "
            "unknown or not compiled in); use e.g. 'gloo', or 'nccl' on a CUDA build"
        )
    problem = unusable_backend(name)
    if problem is not None:  # e.g. NCCL in a CUDA build on a host without a GPU
        raise ValueError(f"{argument} {shown(backend)} cannot form a group on this host: {problem}")
    return name


def check_timeout(timeout: object, argument: str = "timeout") -> timedelta:
    """``timeout`` (a ``timedelta`` or a number of seconds) as a positive ``timedelta``.

    The one check of every public ``timeout``: finite, positive, and at most
    :data:`MAX_TIMEOUT`. ``None`` is not a timeout: a caller for whom it means
    "the default" says so before calling. Messages name ``argument``.

    >>> check_timeout(timedelta(minutes=2))
    datetime.timedelta(seconds=120)
    >>> check_timeout(float("inf"), "wait")
    Traceback (most recent call last):
    ValueError: wait must be a finite number of seconds, got inf
    """
    if isinstance(timeout, timedelta):
        result = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if isinstance(timeout, float) and not math.isfinite(timeout):
            raise ValueError(f"{argument} must be a finite number of seconds, got {shown(timeout)}")
        if timeout <= 0:
            raise ValueError(f"{argument} must be positive, got {shown(timeout)}")
        try:
            result = timedelta(seconds=timeout)
        except OverflowError:  # more days than timedelta holds
            result = timedelta.max
    else:
        raise TypeError(
            f"{argument} must be a timedelta or a number of seconds, got {shown(timeout)}"
        )
    if result <= timedelta(0):  # a negative timedelta, or seconds below a microsecond
        raise ValueError(f"{argument} must be positive, got {shown(timeout)}")
    if result > MAX_TIMEOUT:
        raise ValueError(
            f"{argument} must be at most {MAX_TIMEOUT} (torch counts it in int64 microseconds), "
            f"got {shown(timeout)}"
        )
    return result


def sorted_ranks(ranks: object) -> list[int]:
    """``ranks`` as sorted distinct ranks, or a TypeError/ValueError saying why not.

    >>> sorted_ranks([3, 1, 3])
    [1, 3]
    """
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be an iterable of int ranks, got {shown(ranks)}")
    members: set[int] = set()
    for r in ranks:
        if not is_int(r):
            raise TypeError(f"ranks must hold int ranks, got {shown(r)}")
        if r < 0:
            raise ValueError(f"ranks must be ranks of WORLD (>= 0), got {shown(r)}")
        members.add(r)
    return sorted(members)


def check_tag(tag: object) -> None:
    """A tag becomes part of store keys: a short printable str without '/', checked first.

    >>> check_tag("a/b")
    Traceback (most recent call last):
        ...
    ValueError: tag must be 1 to 200 printable characters without '/', got 'a/b'
    """
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, got {shown(tag)}")
    if not tag or len(tag) > TAG_LIMIT or "/" in tag or not tag.isprintable():
        raise ValueError(
            f"tag must be 1 to {TAG_LIMIT} printable characters without '/', got {shown(tag)}"
        )
