"""The job's store: hosted by the launcher (it outlives every replica), reached by workers.

>>> store = host_job_store("127.0.0.1", 0, timeout=10.0)
>>> connect_store("127.0.0.1", store.port, timeout=10.0).set("key", "value")
>>> store.get("key")
b'value'
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["connect_store", "host_job_store"]


def host_job_store(host: str, port: int, timeout: float) -> Any:
    """A ``TCPStore`` server on ``port`` (0: a free one; ``.port`` says which), hosted by
    the calling process, which must outlive every worker that uses it; ``timeout``
    (seconds) bounds its waits. No worker hosts it: one that exits must not take it away.
    """
    return dist.TCPStore(  # type: ignore[attr-defined]  # public; not in torch's stub exports
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def connect_store(host: str, port: int, timeout: float) -> Any:
    """A ``TCPStore`` client of ``host:port``; TimeoutError naming the address if it cannot
    be reached within ``timeout`` seconds (which also bounds its later waits)."""
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]  # public; not in torch's stub exports
            host, port, is_master=False, timeout=timedelta(seconds=timeout)
        )
    except (RuntimeError, OSError) as error:  # DistNetworkError, DistStoreError: RuntimeErrors
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TimeoutError(
            f"the job store at {host}:{port} could not be reached within {timeout:g} s ({first})"
        ) from error
