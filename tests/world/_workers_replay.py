"""The fixed-seed bad-input corpus of tests/world/test_bad_input.py.

Run as a script, the module replays a fixed-seed corpus of bad inputs in a
one-rank gloo world and prints a JSON summary; the tests run it under
``python -O``, where ``assert`` statements vanish::

    python -O tests/world/_workers_replay.py replay --seed 0 --count 3000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from _workers_bad_input import Tally, outcome_of, public_methods
from _workers_common import destroy_all_but_world, live

from scopedmesh.mesh import ProcessGroupMesh

# A fixed pool: the corpus draws from it with random.Random(seed), so a seed names a corpus.
POOL: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 10**20, -(10**20), 2**63, 1.0, 1.5, -0.0,
    float("nan"), float("inf"), 1j, "", "dp", "tp", "pp", "x", "0", "gloo", "nccl", "mpi",
    "cuda", "cpu", "raise", "wrap", "clip", b"dp", [], [0], [0, 0], [1, 0], [-1], [0, 1, 2],
    [[0]], [[0, 1], [1]], [["dp"]], (), (0,), (1,), (0, 1), (-1,), (1, 1), (-1, -1), ("dp",),
    ("dp", "dp"), ("dp", "tp"), (0, "dp"), (True,), (1.0,), (None,), {"dp": 0}, {}, {0: 0},
    {"zz": 1}, {0, 1}, slice(None), slice(0, 0), slice(None, None, 0), slice(0.5), Ellipsis,
    (Ellipsis, Ellipsis), range(1), range(0), range(3, -1, -1), timedelta(0),
    timedelta(seconds=-1), timedelta.max, object(), print, ProcessGroupMesh,
]  # fmt: skip


def corpus(seed: int, count: int) -> Iterator[tuple[str, list[Any]]]:
    """``count`` (entry point, arguments) pairs drawn from :data:`POOL` with ``seed``."""
    from scopedmesh.layout import MeshLayout

    rng = random.Random(seed)
    layout_methods = public_methods(MeshLayout)
    mesh_methods = public_methods(ProcessGroupMesh)
    entries = (
        ["MeshLayout"] * 3
        + [f"MeshLayout.{m}" for m in layout_methods]
        + ["ProcessGroupMesh"] * 3
        + [f"ProcessGroupMesh.{m}" for m in mesh_methods]
        + ["cli"] * 3
        + ["layout_of", "to_device_mesh"]
    )
    for _ in range(count):
        entry = rng.choice(entries)
        args = [rng.choice(POOL) for _ in range(rng.randrange(0, 5))]
        yield entry, args


CLI_TOKENS = [
    "plan", "2", "3", "-1", "0", "1", "64", "2147483648", "99999999999999999999", "-5", "x",
    "", " ", "--names", "dp", "tp", "dp,tp", "dp,dp", "--world", "--axis", "--rank",
    "--nproc-per-node", "--json", "--full", "--help", "--bogus", "--", "-", ",", "1.5",
    "tp,x", "--names=", "--world=8", "--axis=0,1", "\u00e9", "\x00",
]  # fmt: skip


def cli_argv(rng: random.Random) -> list[str]:
    """A ``plan`` command line: well formed, or (half the time) with bad values or tokens."""
    bad = rng.random() < 0.5
    sizes = [rng.choice(["1", "2", "3", "4", "8"]) for _ in range(rng.randint(1, 3))]
    world = str(math.prod(int(n) for n in sizes))
    if rng.random() < 0.3:
        sizes[rng.randrange(len(sizes))] = "-1"
    argv = ["plan", *sizes]
    last = int(world) - 1
    options = {
        "--names": (["dp", "pp", "tp"][: len(sizes)], ["dp", "x", "y", "z"][: len(sizes) + 1]),
        "--world": ([world], [rng.choice(["0", "x", "7", "-8"])]),
        "--axis": (
            [rng.choice(["0", "-1", f"0,{len(sizes) - 1}"])],
            [rng.choice(["5", "dp,dp", "", "q"])],
        ),
        "--rank": ([str(rng.randint(0, last))], [rng.choice(["-1", str(last + 1), "x"])]),
        "--nproc-per-node": ([rng.choice(["1", "2", "4", "8"])], [rng.choice(["0", "-2", "x"])]),
        "--json": ([], []),
        "--full": ([], []),
    }
    for option, (good, poor) in options.items():
        if rng.random() < 0.4 or (option == "--world" and "-1" in sizes):
            argv += [option, *(poor if bad and rng.random() < 0.3 else good)]
    for _ in range(rng.choice([0, 1, 2, 3]) if bad else 0):
        token = rng.choice(CLI_TOKENS)
        at = rng.randrange(len(argv) + 1)
        kind = rng.choice(["insert", "replace", "delete"])
        if kind == "insert" or at == len(argv):
            argv.insert(at, token)
        elif kind == "replace":
            argv[at] = token
        else:
            del argv[at]
    if "--full" in argv and any(len(t) > 2 and t.lstrip("-").isdigit() for t in argv):
        argv.remove("--full")  # --full on a huge world lists every rank: asked for, not bad
    return argv


def replay(seed: int, count: int) -> dict[str, Any]:
    """Run the corpus against a one-rank gloo world; needs no pytest and no hypothesis."""
    from scopedmesh.layout import MeshLayout
    from scopedmesh.mesh.interop import layout_of, to_device_mesh
    from scopedmesh.plan.cli import main
    from scopedmesh.testing import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    tally = Tally()
    rng = random.Random(seed ^ 0x5EED)
    baseline = live()
    leaks = 0
    layout = MeshLayout((2, 3), names=("dp", "tp"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for entry, args in corpus(seed, count):
                inputs = f"{entry}(*{args!r})"
                if entry == "MeshLayout":
                    tally.add(entry, outcome_of(MeshLayout, *args[:3]), inputs)
                elif entry.startswith("MeshLayout."):
                    method = getattr(layout, entry.split(".", 1)[1])
                    tally.add(entry, outcome_of(method, *args), inputs)
                elif entry == "ProcessGroupMesh":
                    positional = args[: rng.randrange(0, 3)]
                    kwargs = {
                        k: rng.choice(POOL)
                        for k in ("names", "ranks", "backend", "timeout", "pg_options", "eager")
                        if rng.random() < 0.3
                    }
                    mesh = tally.add(
                        entry,
                        outcome_of(ProcessGroupMesh, *positional, **kwargs),
                        f"ProcessGroupMesh(*{positional!r}, **{kwargs!r})",
                    )
                    if mesh is not None:
                        mesh.close()
                elif entry.startswith("ProcessGroupMesh."):
                    with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
                        method = getattr(mesh, entry.split(".", 1)[1])
                        tally.add(entry, outcome_of(method, *args), inputs)
                elif entry == "cli":
                    argv = cli_argv(rng)
                    tally.add(entry, cli_outcome(main, argv), f"main({argv!r})")
                elif entry == "layout_of":
                    tally.add(entry, outcome_of(layout_of, *args[:1]), inputs)
                else:
                    with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
                        tally.add(entry, outcome_of(to_device_mesh, mesh, *args[:2]), inputs)
                if live() != baseline:
                    leaks += 1
                    destroy_all_but_world()
    finally:
        dist.destroy_process_group()
    return {
        "optimize": sys.flags.optimize,
        "asserts_run": _asserts_run(),
        "seed": seed,
        "leaks": leaks,
        **tally.as_dict(),
    }


def _asserts_run() -> bool:
    try:
        assert False  # noqa: B011 -- tells whether this interpreter runs asserts
    except AssertionError:
        return True
    return False


def cli_outcome(main: Callable[[list[str]], int], argv: list[str]) -> tuple[str, Any, str]:
    """Run the CLI: it must return 0, 1 or 2, and explain a 2 on stderr in one line."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    except BaseException as exc:
        return ("violation", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    if status == 2:
        text = err.getvalue()
        if not text.strip() or "error:" not in text or "Traceback" in text:
            return ("violation", "bad usage message", repr(text))
        return ("rejected", "usage error (exit 2)", text.strip())
    if status == 0:
        return ("ok", status, "")
    return ("violation", f"exit status {status!r}", err.getvalue())


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    play = commands.add_parser("replay", help="replay the fixed-seed bad-input corpus")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--count", type=int, default=3000)
    args = parser.parse_args(argv)
    print(json.dumps(replay(args.seed, args.count)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
