"""Suite-wide settings: hypothesis judges results, never timings.

A per-example deadline is a timed assertion, and so is the health check for
slow input generation; on a loaded machine both fail correct code. The other
health checks (too much filtering, too large data) stay on.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("scopedmesh", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("scopedmesh")
