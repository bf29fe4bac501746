"""Benchmarks of scopedmesh against DeviceMesh and a naive baseline: ``python -m benchmarks.run``."""
