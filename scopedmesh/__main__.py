"""``python -m scopedmesh plan ...``: see :mod:`scopedmesh.cli`."""

from scopedmesh.cli import main

raise SystemExit(main())
