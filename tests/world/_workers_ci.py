"""The one 4-rank world of tests/world/test_reliability.py's CI run: every section in order.

Spawned ranks import worker functions by name, so they live at module top level.
A world costs seconds to start, so each function runs many checks and returns
plain data (dicts of ints, strings and lists) for the test to assert on; a check
that fails is reported, never swallowed.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _workers_common import error_of, live
from _workers_death import death
from _workers_exceptions import close_fails, collected_while_open, exception_safety, misuse
from _workers_faults import eager_missing_member, global_destroy, hand_destroyed, missing_member
from _workers_independence import independence
from _workers_soak import soak


@contextlib.contextmanager
def _catch(out: dict[str, Any], key: str) -> Iterator[None]:
    """Record an unexpected exception of one section instead of losing the rest."""
    try:
        yield
    except Exception as exc:
        out[key] = {"unexpected": traceback.format_exc(), **error_of(exc)}


def ci_world(
    rank: int,
    world_size: int,
    port: int,
    outdir: str,
    soak_cycles: int,
    schedules: int,
    victim: int,
) -> dict[str, Any]:
    """Every CI check in one 4-rank world (a world costs ~10-30 s to start).

    In order: the soak; the faults, exception-safety and misuse sections; the
    independence schedules; ``dist.destroy_process_group()`` inside a scope and a
    new world on ``port``; and last ``victim`` dies inside a scope. The report is
    rewritten to ``outdir/rank<r>.json`` after every section, since the launcher
    raises for the dead rank and so returns nothing.
    """
    out: dict[str, Any] = {"rank": rank, "baseline": live()}
    path = Path(outdir, f"rank{rank}.json")

    def save() -> None:
        path.write_text(json.dumps(out, default=repr))

    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("soak", lambda: soak(rank, world_size, soak_cycles, 5)),
        ("missing", lambda: missing_member(rank)),
        ("eager_missing", lambda: eager_missing_member(rank)),
        ("hand_destroyed", lambda: hand_destroyed(rank)),
        ("exception", lambda: exception_safety(rank)),
        ("close_fails", lambda: close_fails(rank)),
        ("misuse", lambda: misuse(rank)),
        ("collected", lambda: collected_while_open(rank)),
        ("independence", lambda: independence(rank, world_size, schedules, 12, 0)),
    ]
    for name, section in sections:
        with _catch(out, name):
            out[name] = section()
        out[name + "_live"] = live()
        save()
        dist.barrier()
    with _catch(out, "global_destroy"):
        out["global_destroy"] = global_destroy(rank, world_size, port)
    save()
    with _catch(out, "death"):
        out["death"] = death(rank, world_size, victim)
    save()
    return out
