"""The ``scopedmesh`` command: ``scopedmesh plan ...`` (:mod:`scopedmesh.plan.cli`) and
``scopedmesh replicas ...`` (:mod:`scopedmesh.launch.cli`), also as ``python -m scopedmesh``.

``plan`` never imports torch; ``replicas`` loads it when it starts.

>>> main(["--help"])  # doctest: +ELLIPSIS
usage: scopedmesh COMMAND ...
...
0
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

COMMANDS = ("plan", "replicas")

USAGE = """\
usage: scopedmesh COMMAND ...

commands:
  plan       show a mesh's ranks, groups and node placement (scopedmesh plan --help)
  replicas   run a replicated job: one torchrun agent per replica, restarted when
             one of its ranks dies (scopedmesh replicas --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``scopedmesh COMMAND ...``; return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["replicas"]:
        from scopedmesh.launch.cli import main as replicas

        return replicas(args[1:])
    if args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        return 0
    if not args or args[0] not in COMMANDS:
        problem = (
            "the following arguments are required: COMMAND"
            if not args
            else f"argument COMMAND: invalid choice: {args[0]!r}"
        )
        choices = ", ".join(repr(c) for c in COMMANDS)
        sys.stderr.write(f"scopedmesh: error: {problem} (choose from {choices})\n")
        return 2
    from scopedmesh.plan.cli import main as plan

    return plan(args)


if __name__ == "__main__":  # not when pytest --doctest-modules imports this file
    raise SystemExit(main())
