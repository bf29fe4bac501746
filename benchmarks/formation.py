"""The store requests of one mesh formation at 1,024 members, per member and per group.

    python -m benchmarks.formation            # the table, then a run with the grace raised
    python -m benchmarks.formation --counts   # the table only (exact counts, 10 to 30 s)
    python -m benchmarks.formation --json     # the counts as JSON (what the tests read)

1,024 members of one formation, each a thread of this process, form the groups of
two meshes: ``ProcessGroupMesh(1024)`` (one group of 1,024, the mesh's first), then
``ProcessGroupMesh(32, 32)``: axis 1 (32 groups of 32, the mesh's first groups),
axis 0 (32 groups of 32, later groups) and both axes (one group of 1,024, a later
group), then close it. Each member's store requests are counted by a
:class:`~benchmarks.store.CountingStore` of its own, per step; a group's count is the
sum over its members.

**Real:** scopedmesh, unchanged: ``ProcessGroupMesh`` and its group table (the
process record at the mesh's making), ``new_member_group`` (the generation counter's
``add``, torch's private ``_new_process_group_helper``, the formation barrier of
``scopedmesh.c10d.barrier``), ``close``. torch's group construction,
registry and destruction, per member. One torch ``HashStore`` that every member's
requests reach (the counts do not depend on the kind of store; a ``TCPStore`` would
need a connection per member, and the server's reverse DNS lookup of each,
docs/measured.md "The 5 s outliers").

**Stood in for:**

* *The process.* 1,024 torch processes do not fit in 24 GiB (about 200 MB each), so
  each member is a thread. torch keeps its world per process (``_world``); torch's
  own harness for threaded worlds makes it per thread
  (``torch.testing._internal.distributed.multi_threaded_pg._install_threaded_pg``
  and the C++ group registry's thread-isolation mode, as torch's
  ``MultiThreadedTestCase`` runs its DTensor tests). scopedmesh reads the world only
  through torch, so it sees one rank per thread.
* *The backend.* Groups are torch's ``FakeProcessGroup`` (no communication, no store
  request), registered under another name, :data:`STANDIN`: scopedmesh's shortcut
  for torch's ``fake`` backend (no generation counter, no barrier: nothing
  rendezvous) goes by name, and must not apply. So gloo's rendezvous is not counted
  here (each member sets its address, then waits for and reads every member's:
  ``1 + 2n`` requests, tests/world/test_store_load.py at 8 ranks), nor the ``delete``
  of its gloo address each member makes after the barrier (scopedmesh's, +1 a
  member on gloo only: 6n + 1 and 5n + 1 per group there, 5n + 1 and 4n + 1 here).
* *The grace.* It plays no part in the barrier: a waiting member makes one
  ``wait`` for the group's whole timeout, ended by the release (or an abort),
  however long the last member takes. The counts are taken at the default grace
  (0.5 s), where 1,024 threads on 2 cores reach the barrier over seconds, as a
  real job's members may; the run printed second raises the grace to the
  timeout and must count the same.

Each member's own thread holds its counter: no count is shared between threads. One
branch differs from a process per member, with no request either way: seeing 1,025
threads, each formation asks to clone the store client (``StoreUse``); the counting
store cannot clone, so the formation shares it, as a member alone in its process does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from benchmarks.store import CountingStore, _counting_world

MEMBERS = 1024
SQUARE = (32, 32)
STANDIN = "storeless"  # torch's FakeProcessGroup under a name scopedmesh does not shortcut
TIMEOUT = 120.0  # seconds: each formation's timeout (and the raised grace of the second run)
REPO = Path(__file__).resolve().parents[1]
# The steps each member takes, in order: (label, what it forms).
STEPS = (
    ("line", "ProcessGroupMesh(1024): its first group, axis 0 (the mesh's making counted in)"),
    ("line_close", "its close"),
    ("square_axis1", "ProcessGroupMesh(32, 32): its first groups, axis 1 (the making counted in)"),
    ("square_axis0", "axis 0: later groups"),
    ("square_both", "both axes: a later group"),
    ("square_close", "its close"),
)


class _Member:
    """One member's counts, step by step: each step's requests by ``"owner kind"``."""

    def __init__(self, store: CountingStore) -> None:
        self.store = store
        self.mark = Counter(store.requests)
        self.steps: dict[str, dict[str, Any]] = {}

    def step(self, label: str, ranks: list[int] | None = None) -> None:
        delta = self.store.requests - self.mark
        self.mark = Counter(self.store.requests)
        kinds = {f"{owner} {kind}": n for (owner, kind), n in sorted(delta.items())}
        self.steps[label] = {"ranks": ranks or [], "kinds": kinds}


def _formations(store: CountingStore, grace: float | None) -> dict[str, dict[str, Any]]:
    """This member's steps (:data:`STEPS`), each counted from the end of the one before."""
    from scopedmesh import ProcessGroupMesh

    def ranks(mesh: ProcessGroupMesh, axes: int | tuple[int, ...]) -> list[int]:
        group = mesh.get_group_along_axis(axes)
        if group is None:  # every rank is a member of its group along whole axes
            raise RuntimeError(f"rank {mesh.rank} got no group along {axes}")
        return mesh.get_ranks_in_group(group)

    member = _Member(store)
    with ProcessGroupMesh(MEMBERS, timeout=TIMEOUT, grace=grace) as line:
        member.step("line", ranks(line, 0))
    member.step("line_close")
    with ProcessGroupMesh(*SQUARE, timeout=TIMEOUT, grace=grace) as square:
        for label, axes in (("square_axis1", 1), ("square_axis0", 0), ("square_both", (0, 1))):
            member.step(label, ranks(square, axes))
    member.step("square_close")
    return member.steps


def _member(
    rank: int,
    world: c10d.Store,
    grace: float | None,
    results: dict[int, dict[str, dict[str, Any]]],
    errors: list[str],
) -> None:
    try:
        dist.init_process_group(STANDIN, store=world, rank=rank, world_size=MEMBERS)
        results[rank] = _formations(_counting_world(), grace)
    except BaseException as error:  # reported by the caller, with the rank
        errors.append(f"rank {rank}: {type(error).__name__}: {error}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _register_standin() -> None:
    # Here, not at import: torch's testing modules register backends as they load.
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg

    if not hasattr(dist.Backend, STANDIN.upper()):
        dist.Backend.register_backend(STANDIN, _create_fake_pg, extended_api=True, devices=["cpu"])


def run_members(grace: float | None = None) -> dict[int, dict[str, dict[str, Any]]]:
    """Every member's steps: 1,024 threads, each one rank of a threaded torch world.

    ``grace``: the meshes' grace in seconds (None: scopedmesh's default, 0.5 s).
    """
    from torch.testing._internal.distributed import multi_threaded_pg

    _register_standin()
    isolation = torch._C._distributed_c10d._set_thread_isolation_mode  # type: ignore[attr-defined]
    world = dist.HashStore()  # type: ignore[attr-defined]
    results: dict[int, dict[str, dict[str, Any]]] = {}
    errors: list[str] = []
    stack = threading.stack_size(1 << 19)  # 1,024 threads: half a MiB of stack each
    switch = sys.getswitchinterval()
    # 1,024 threads that block in the store and wake: with Python's 5 ms interval most of
    # the run is spent handing the GIL round (kernel time); the counts do not depend on it.
    sys.setswitchinterval(0.05)
    isolation(True)
    multi_threaded_pg._install_threaded_pg()  # type: ignore[no-untyped-call]
    threads: list[threading.Thread] = []
    try:
        threads += [
            threading.Thread(
                target=_member, args=(rank, world, grace, results, errors), daemon=True
            )
            for rank in range(MEMBERS)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 4 * TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        multi_threaded_pg._uninstall_threaded_pg()  # type: ignore[no-untyped-call]
        isolation(False)
        threading.stack_size(stack)
        sys.setswitchinterval(switch)
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if errors or hung:
        raise RuntimeError(f"members failed: {errors[:4]}; still running: {hung[:16]}")
    return results


def summarize(results: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per step: group size, groups, distinct own totals per group, members by own count,
    requests by kind (all members), the most ``wait`` requests of one member, and the
    backend's requests (all members)."""
    table: dict[str, dict[str, Any]] = {}
    for label, _ in STEPS:
        per_group: Counter[tuple[int, ...]] = Counter()
        per_member: Counter[int] = Counter()
        kinds: Counter[str] = Counter()
        most_waits = 0
        for steps in results.values():
            step = steps[label]
            own = sum(n for kind, n in step["kinds"].items() if kind.startswith("own "))
            if step["ranks"]:
                per_group[tuple(step["ranks"])] += own
            per_member[own] += 1
            kinds.update(step["kinds"])
            most_waits = max(most_waits, step["kinds"].get("own wait", 0))
        table[label] = {
            "group_size": len(next(iter(per_group))) if per_group else 0,
            "groups": len(per_group),
            "per_group": sorted(set(per_group.values())),
            "per_member": {str(n): members for n, members in sorted(per_member.items())},
            "kinds": dict(sorted(kinds.items())),
            "most_waits": most_waits,
            "backend": sum(n for kind, n in kinds.items() if kind.startswith("backend ")),
        }
    return table


def measure(grace: float | None = None) -> dict[str, dict[str, Any]]:
    """:func:`summarize` of one run of :func:`run_members`, in this process."""
    return summarize(run_members(grace))


def counts() -> dict[str, dict[str, Any]]:
    """:func:`measure` in a fresh interpreter (``--json``): the threaded world it installs
    replaces torch's world for the whole process, so it stays out of the caller's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.formation", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -m benchmarks.formation --json failed:\n{done.stderr}")
    result: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _formula(total: int, n: int) -> str:
    """``total`` as ``q n + r`` for groups of ``n`` members.

    >>> _formula(5121, 1024), _formula(129, 32)
    ('5n + 1', '4n + 1')
    """
    return f"{total // n}n + {total % n}" if n else str(total)


def render(table: dict[str, dict[str, Any]]) -> str:
    """The table of :func:`measure`, as markdown."""
    lines = [
        f"store requests of one formation, {MEMBERS:,} members (threads), backend stood in "
        "(makes none)",
        "| step | members per group | groups | scopedmesh's own per group | members by own "
        "requests | requests by kind, all members | backend |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, what in STEPS:
        row = table[label]
        n = row["group_size"]
        per_group = ", ".join(f"{t:,} = {_formula(t, n)}" for t in row["per_group"]) or "-"
        members = ", ".join(f"{c}: {m:,}" for c, m in row["per_member"].items())
        kinds = ", ".join(f"{k.split()[1]} {v:,}" for k, v in row["kinds"].items()) or "none"
        lines.append(
            f"| {what} | {n or '-'} | {row['groups'] or '-'} | {per_group} | {members} | "
            f"{kinds} | {row['backend']} |"
        )
    return "\n".join(lines)


def _gloo_note(n: int = MEMBERS) -> str:
    """What gloo would add, from the per-member formulas measured at 8 ranks (not measured here).

    >>> print(_gloo_note(2))  # doctest: +ELLIPSIS
    on gloo, per member of a 2-member group: +1 (scopedmesh deletes its address) and gloo's rendezvous 1 + 2n = 5...
    """
    rendezvous = 1 + 2 * n
    return (
        f"on gloo, per member of a {n:,}-member group: +1 (scopedmesh deletes its address) and "
        f"gloo's rendezvous 1 + 2n = {rendezvous:,}; per group {n * rendezvous:,} "
        "(from tests/world/test_store_load.py's formulas at 8 ranks; not measured here)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.formation")
    parser.add_argument("--counts", action="store_true", help="the exact counts only")
    parser.add_argument("--json", action="store_true", help="the exact counts as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.json:
        print(json.dumps(measure()))
        return
    start = time.perf_counter()
    table = measure()
    print(render(table))
    print(
        f"({time.perf_counter() - start:.1f} s at the default grace, 0.5 s; {MEMBERS:,} threads "
        f"on this machine's {os.cpu_count()} cores reach the barrier over seconds)"
    )
    print(_gloo_note())
    if args.counts:
        return
    start = time.perf_counter()
    raised = measure(grace=TIMEOUT)
    seconds = time.perf_counter() - start
    for label in ("line", "square_axis1"):
        waits = table[label]["kinds"].get("own wait", 0)
        again = raised[label]["kinds"].get("own wait", 0)
        print(
            f"{label}: {waits:,} waits at the default grace, {again:,} with the grace raised to "
            f"the timeout ({seconds:.1f} s run); at most {table[label]['most_waits']} a member"
        )


if __name__ == "__main__":
    main()
