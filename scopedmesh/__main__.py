"""``python -m scopedmesh plan ...``: see :mod:`scopedmesh.plan.cli`."""

from scopedmesh.plan.cli import main

if __name__ == "__main__":  # not when pytest --doctest-modules imports this file
    raise SystemExit(main())
