"""Probes the tests share, whatever their folder: what torch was asked to build, what a call raised,
and the nasty arguments the fuzz tests throw at every public entry.

``record_new_groups`` wraps torch's private group constructor (where ``new_group``
ends), so a test can count the groups a mesh formed and see their members.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed import distributed_c10d as c10d


@contextlib.contextmanager
def record_new_groups() -> Iterator[list[dict[str, Any]]]:
    """Record every call of torch's group constructor (what new_group ends in).

    The wrapper is ``functools.wraps`` of torch's helper, as torch's own logging
    wrappers are, so scopedmesh judges the real helper's parameters (whatever this
    torch calls them) when it decides whether its private path applies.
    """
    calls: list[dict[str, Any]] = []
    original = c10d._new_process_group_helper
    signature = inspect.signature(inspect.unwrap(original))

    @functools.wraps(original)
    def _new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        calls.append(
            {
                "ranks": list(bound["global_ranks_in_group"]),
                "name": str(bound["group_name"]),
                "backend": str(bound["backend"]),
                "timeout": bound.get("timeout"),
                # torch 2.6+ calls it backend_options, torch 2.4 pg_options
                "backend_options": bound.get("backend_options", bound.get("pg_options")),
            }
        )
        return original(*args, **kwargs)

    c10d._new_process_group_helper = _new_process_group_helper
    try:
        yield calls
    finally:
        c10d._new_process_group_helper = original


def error_text(call: Callable[[], object]) -> str | None:
    """``"TypeName: message"`` of what ``call`` raises, or None if it returns."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


# What bad input may raise (a subclass counts), and how long its message may be: a
# message shows a bad argument, never all of it.
ALLOWED = (TypeError, ValueError, KeyError, IndexError)
MESSAGE_LIMIT = 5_000  # characters


def _self_containing() -> list[Any]:
    looped: list[Any] = [1]
    looped.append(looped)
    return looped


def _deep(depth: int) -> list[Any]:
    value: list[Any] = [0]
    for _ in range(depth):
        value = [value]
    return value


def nasty_values() -> list[Any]:
    """Arguments no caller should pass (huge, non-finite, wrong types, nested), fresh each call."""
    return [
        None,
        True,
        2.0,
        float("nan"),
        float("inf"),
        -float("inf"),
        10**100,
        -(10**100),
        2**63,
        -1,
        0,
        "",
        "x" * 1_000_000,
        "\x00",
        "\udcff",
        b"dp",
        object(),
        {},
        {"dp": 1},
        set(),
        {1, 2},
        [],
        [[1, [2]]],
        [10**100, 2],
        (2, float("nan")),
        (x for x in range(3)),
        _self_containing(),
        _deep(10_000),
        [None] * 3,
        ["dp", "dp"],
        range(10**6),
        slice(None),
        Ellipsis,
    ]
