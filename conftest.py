"""Collection rules for the whole tree (pytest's rootdir conftest).

``scopedmesh/interop/torchtitan.py`` imports torchtitan, an extra: without it,
the doctest collection of ``scopedmesh/`` leaves that module out (its tests in
``tests/titan/`` skip with the reason).
"""

import importlib.util

collect_ignore = (
    [] if importlib.util.find_spec("torchtitan") else ["scopedmesh/interop/torchtitan.py"]
)
