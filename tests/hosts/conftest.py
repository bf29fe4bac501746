"""tests/hosts holds scripts for the two-host harness (``bash .ci/two_hosts``), not tests.

They need root, network namespaces and the environment the harness sets, so pytest
collects nothing here, not even their doctests (``--doctest-modules`` would import them).
"""

collect_ignore_glob = ["*.py"]
