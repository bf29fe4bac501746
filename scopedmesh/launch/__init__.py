"""The launcher of replicated jobs (``scopedmesh replicas``) and its worker side.

``scopedmesh replicas --replicas 3 --nproc-per-replica 2 -- train.py`` hosts the
job's store and runs one torchrun agent per replica (:mod:`scopedmesh.launch.cli`,
:mod:`scopedmesh.launch.agents`); in each worker, :func:`job_from_environment`
connects to the store and says which replica this is (docs/replicas-quickstart.md).

>>> from scopedmesh.launch import job_from_environment, JobEnvironment
"""

from __future__ import annotations

from scopedmesh.launch.environment import JobEnvironment, job_from_environment

__all__ = ["JobEnvironment", "job_from_environment"]
