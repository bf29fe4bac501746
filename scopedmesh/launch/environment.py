"""What ``scopedmesh replicas`` tells each worker, and the worker's side: :func:`job_from_environment`.

Every worker the launcher starts gets, besides torchrun's ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (its replica's own world):

- ``SCOPEDMESH_JOB_STORE=HOST:PORT``: the job's store, which outlives every replica;
- ``SCOPEDMESH_REPLICA``: this replica's index; ``SCOPEDMESH_REPLICAS``: the job's size;
- ``SCOPEDMESH_BACKEND``: ``gloo`` or ``nccl``, for the cross-replica groups.

>>> worker_environment("127.0.0.1:29400", replica=1, replicas=3, backend="gloo")["SCOPEDMESH_REPLICA"]
'1'
>>> job_from_environment(environ={})
Traceback (most recent call last):
...
ValueError: SCOPEDMESH_JOB_STORE is not set: start the workers with `scopedmesh replicas` (or set SCOPEDMESH_JOB_STORE=HOST:PORT, SCOPEDMESH_REPLICA, SCOPEDMESH_REPLICAS and SCOPEDMESH_BACKEND)
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scopedmesh.errors import shown

__all__ = [
    "BACKENDS",
    "BACKEND_VARIABLE",
    "JOB_STORE_VARIABLE",
    "REPLICAS_VARIABLE",
    "REPLICA_VARIABLE",
    "JobEnvironment",
    "job_from_environment",
    "parse_address",
    "worker_environment",
]

JOB_STORE_VARIABLE = "SCOPEDMESH_JOB_STORE"
REPLICA_VARIABLE = "SCOPEDMESH_REPLICA"
REPLICAS_VARIABLE = "SCOPEDMESH_REPLICAS"
BACKEND_VARIABLE = "SCOPEDMESH_BACKEND"
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class JobEnvironment:
    """A worker's view of its replicated job: the job store (a ``TCPStore`` client),
    its replica's index, the job's size, and the backend of the cross-replica groups.

    >>> JobEnvironment(store=None, address="127.0.0.1:29400", replica=0, replicas=3, backend="gloo").replicas
    3
    """

    store: Any
    address: str
    replica: int
    replicas: int
    backend: str


def parse_address(text: object, argument: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; a ValueError naming ``argument`` otherwise.

    >>> parse_address("10.0.0.1:29400", "--job-store")
    ('10.0.0.1', 29400)
    >>> parse_address("10.0.0.1", "--job-store")
    Traceback (most recent call last):
    ...
    ValueError: --job-store must be HOST:PORT (e.g. 10.0.0.1:29400), got '10.0.0.1'
    """
    if not isinstance(text, str):
        raise TypeError(f"{argument} must be a str HOST:PORT, got {shown(text)}")
    host, colon, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29400
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{argument} must be HOST:PORT (e.g. 10.0.0.1:29400), got {shown(text)}")
    return host, int(port)


def worker_environment(
    address: str, *, replica: int, replicas: int, backend: str
) -> dict[str, str]:
    """The variables the launcher gives every worker of ``replica`` (see the module's text)."""
    return {
        JOB_STORE_VARIABLE: address,
        REPLICA_VARIABLE: str(replica),
        REPLICAS_VARIABLE: str(replicas),
        BACKEND_VARIABLE: backend,
    }


def _integer(environ: Mapping[str, str], name: str, low: int, high: int | None = None) -> int:
    text = environ.get(name)
    if text is None:
        raise ValueError(f"{name} is not set: start the workers with `scopedmesh replicas`")
    value = int(text) if text.strip().isdigit() else -1
    if value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise ValueError(f"{name} must be {bound}, got {shown(text)}")
    return value


def job_from_environment(
    timeout: float = 60.0, *, environ: Mapping[str, str] | None = None
) -> JobEnvironment:
    """In a worker started by ``scopedmesh replicas``: connect to the job's store.

    ``timeout`` (seconds) bounds the connection and every later wait on the store.
    ``environ`` defaults to ``os.environ``. A variable that is missing or malformed
    raises ValueError naming it; a store that cannot be reached within ``timeout``
    raises TimeoutError naming its address.

        job = job_from_environment(timeout=60.0)
        grow = Replicas(job.store, replica=job.replica, replicas=job.replicas,
                        state=state, backend=job.backend)
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {shown(timeout)}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be finite and > 0 seconds, got {shown(timeout)}")
    environ = os.environ if environ is None else environ
    address = environ.get(JOB_STORE_VARIABLE)
    if address is None:
        raise ValueError(
            f"{JOB_STORE_VARIABLE} is not set: start the workers with `scopedmesh replicas` "
            f"(or set {JOB_STORE_VARIABLE}=HOST:PORT, {REPLICA_VARIABLE}, {REPLICAS_VARIABLE} "
            f"and {BACKEND_VARIABLE})"
        )
    host, port = parse_address(address, JOB_STORE_VARIABLE)
    replicas = _integer(environ, REPLICAS_VARIABLE, 1)
    replica = _integer(environ, REPLICA_VARIABLE, 0, replicas - 1)
    backend = environ.get(BACKEND_VARIABLE)
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE} must be one of {BACKENDS}, got {shown(backend)}")
    from scopedmesh.launch.store import connect_store  # torch: loaded here, not at import

    store = connect_store(host, port, timeout)
    return JobEnvironment(store, address, replica, replicas, backend)
