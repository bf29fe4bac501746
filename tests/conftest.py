"""Suite-wide settings: hypothesis judges results, never timings.

A per-example deadline is a timed assertion; on a loaded machine it fails
correct code. Health checks for slow generation stay on.
"""

from hypothesis import settings

settings.register_profile("scopedmesh", deadline=None)
settings.load_profile("scopedmesh")
