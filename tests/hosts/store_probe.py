"""Which TCPStore requests end, and how, when the store's host is partitioned away?

Run by the harness: ``bash .ci/two_hosts .venv/bin/python tests/hosts/store_probe.py
[--window SECONDS]``. Host A serves a TCPStore; host B opens one client per request
kind (``timeout`` 5 s each) and, after a silent partition, sends each its request in
a thread of its own, plus one new client. Host B prints one JSON line: per request,
how it ended (returned, or the exception) and after how many seconds, or that it
was still blocked when the window closed. Host A serves until B is done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from _hosts import wait_file

CUT_OFF = 3
TIMEOUT = timedelta(seconds=5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=30.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "Failed to initialize NumPy")
    import torch.distributed as dist

    shared = Path(os.environ["TWO_HOSTS_DIR"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ["HOST_INDEX"] == "0":
        server = dist.TCPStore(address, port, is_master=True, wait_for_workers=False)
        server.set("existing", "1")
        (shared / "serving").touch()
        wait_file(shared / "clients-ready", 30)
        Path(os.environ["PARTITION_REQUEST"]).touch()
        wait_file(shared / "probe-done", args.window + 30)
        return 0

    wait_file(shared / "serving", 30)

    def client() -> Any:
        return dist.TCPStore(address, port, is_master=False, timeout=TIMEOUT)

    requests: dict[str, Any] = {
        "add": lambda s: s.add("counter", 1),
        "set": lambda s: s.set("key", "value"),
        "get (existing key)": lambda s: s.get("existing"),
        "get (missing key)": lambda s: s.get("missing"),
        "wait (missing key, 3 s)": lambda s: s.wait(["missing"], timedelta(seconds=3)),
        "check": lambda s: s.check(["existing"]),
        "compare_set": lambda s: s.compare_set("existing", "1", "2"),
    }
    clients = {name: client() for name in requests}
    for store in clients.values():
        store.check(["existing"])  # every connection carries one request before the cut
    (shared / "clients-ready").touch()
    wait_file(Path(os.environ["PARTITION_DONE"]), 30)
    cut = time.monotonic()
    outcome: dict[str, str] = {}

    def run(name: str, request: Any) -> None:
        try:
            store = clients[name] if name in clients else client()
            value = request(store)
            result = f"returned {value!r}"
        except Exception as error:
            result = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        outcome[name] = f"{result} after {time.monotonic() - cut:.1f} s"

    jobs = {**requests, "new client (connect)": lambda s: s.check(["existing"])}
    for name, request in jobs.items():
        threading.Thread(target=run, args=(name, request), daemon=True).start()
    deadline = cut + args.window
    while len(outcome) < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.05)
    report = {name: outcome.get(name, f"still blocked after {args.window:g} s") for name in jobs}
    os.write(1, (json.dumps({"store timeout": "5 s", "after the cut": report}) + "\n").encode())
    (shared / "probe-done").touch()
    os._exit(CUT_OFF)  # blocked requests hold threads in C++: do not wait for them


if __name__ == "__main__":
    sys.exit(main())
