"""``scopedmesh replicas``'s arguments and ``job_from_environment``: fast, no agent started."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scopedmesh.__main__ import main as scopedmesh
from scopedmesh.launch import JobEnvironment, job_from_environment
from scopedmesh.launch.agents import ReplicaAgents
from scopedmesh.launch.cli import parse
from scopedmesh.launch.environment import (
    BACKEND_VARIABLE,
    JOB_STORE_VARIABLE,
    REPLICA_VARIABLE,
    REPLICAS_VARIABLE,
    worker_environment,
)
from scopedmesh.launch.store import host_job_store

SCRIPT = str(Path(__file__).resolve())  # any file that exists
BASE = ["--replicas", "3", "--nproc-per-replica", "2"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert scopedmesh(["replicas", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("scopedmesh replicas: error: "), err
    return err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (BASE, "give the training command after --"),
        ([*BASE, "--"], "the training command after -- is empty"),
        ([*BASE, "--", "-m"], "-m needs a module name"),
        ([*BASE, "--", "-m", "--steps"], "-m needs a module name"),
        ([*BASE, "--", "--steps", "3"], "must be a script or -m MODULE, got '--steps'"),
        ([*BASE, "--", "no/such/train.py"], "the script 'no/such/train.py' does not exist"),
        (["--nproc-per-replica", "2", "--", SCRIPT], "--replicas"),
        (["--replicas", "3", "--", SCRIPT], "--nproc-per-replica"),
        (["--replicas", "0", "--nproc-per-replica", "2", "--", SCRIPT], "--replicas must be 1 to"),
        (["--replicas", "two", "--nproc-per-replica", "2", "--", SCRIPT], "invalid int value"),
        (["--replicas", "2", "--nproc-per-replica", "0", "--", SCRIPT], "--nproc-per-replica must"),
        ([*BASE, "--max-restarts", "-1", "--", SCRIPT], "--max-restarts must be >= 0"),
        ([*BASE, "--backend", "mpi", "--", SCRIPT], "--backend must be one of gloo, nccl"),
        ([*BASE, "--timeout", "0", "--", SCRIPT], "--timeout must be a finite number"),
        ([*BASE, "--timeout", "nan", "--", SCRIPT], "--timeout must be a finite number"),
        ([*BASE, "--host-replicas", "0,3", "--", SCRIPT], "replica 3 is not in the job"),
        ([*BASE, "--host-replicas", "0,0", "--", SCRIPT], "names a replica twice"),
        ([*BASE, "--host-replicas", "a", "--", SCRIPT], "must be replica indices like 0,1"),
        ([*BASE, "--host-replicas", "", "--", SCRIPT], "must be replica indices like 0,1"),
        ([*BASE, "--job-store", "10.0.0.1", "--", SCRIPT], "--job-store must be HOST:PORT"),
        ([*BASE, "--job-store", "h:0", "--", SCRIPT], "--job-store must be HOST:PORT"),
        ([*BASE, "--job-store", "h:70000", "--", SCRIPT], "--job-store must be HOST:PORT"),
        ([*BASE, "--job-store", ":29400", "--", SCRIPT], "--job-store must be HOST:PORT"),
        ([*BASE, "--nproc", "2", "--", SCRIPT], "unrecognized arguments: --nproc 2"),
        ([*BASE, "--frobnicate", "--", SCRIPT], "unrecognized arguments: --frobnicate"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert says in _error(capsys, argv)


def test_the_command_after_the_separator_is_kept_verbatim() -> None:
    options = parse([*BASE, "--", SCRIPT, "--", "--replicas", "9"])
    assert options.command == (SCRIPT, "--", "--replicas", "9")
    assert (options.replicas, options.nproc) == (3, 2)
    module = parse([*BASE, "--", "-m", "package.train", "--lr", "1e-3"])
    assert module.command == ("-m", "package.train", "--lr", "1e-3")


def test_defaults_host_every_replica_and_the_store_here() -> None:
    options = parse([*BASE, "--", SCRIPT])
    assert options.host_replicas == (0, 1, 2)
    assert options.job_store is None and options.host_job_store
    assert (options.max_restarts, options.backend, options.timeout) == (3, "gloo", None)


def test_one_command_per_host() -> None:
    job = ["--replicas", "4", "--nproc-per-replica", "8", "--job-store", "10.0.0.1:29400"]
    first = parse([*job, "--host-replicas", "0,1", "--host-job-store", "--", SCRIPT])
    second = parse([*job, "--host-replicas", "2,3", "--", SCRIPT])
    assert (first.host_replicas, first.job_store, first.host_job_store) == (
        (0, 1),
        ("10.0.0.1", 29400),
        True,
    )
    assert (second.host_replicas, second.host_job_store) == ((2, 3), False)


def test_help_lists_both_commands_and_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert scopedmesh(["--help"]) == 0
    out = capsys.readouterr().out
    assert "plan" in out and "replicas" in out
    assert scopedmesh(["replicas", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--replicas", "--nproc-per-replica", "--host-replicas", "--job-store"):
        assert option in out
    assert "--host-job-store" in out and "--max-restarts" in out and "--timeout" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "the following arguments are required: COMMAND (choose from 'plan', 'replicas')"),
        (["foo"], "invalid choice: 'foo' (choose from 'plan', 'replicas')"),
        (["--json"], "invalid choice: '--json'"),
    ],
)
def test_an_unknown_command_names_both(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert scopedmesh(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("scopedmesh: error: ") and says in err and err.count("\n") == 1


def test_plan_still_answers_through_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert scopedmesh(["plan", "2", "3", "--names", "pp", "tp", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["shape"], document["world"]) == ([2, 3], 6)


def test_agent_command_is_one_torchrun_world_per_replica() -> None:
    agents = ReplicaAgents(
        ["-m", "pkg.train"], replicas=3, nproc=2, host_replicas=[1], address="h:1", max_restarts=5
    )
    command = agents.agent_command()
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    flags = dict(zip(command[3:-2:2], command[4:-2:2]))
    assert flags["--nnodes"] == "1" and flags["--nproc-per-node"] == "2"
    assert flags["--max-restarts"] == "5" and flags["--rdzv-backend"] == "c10d"
    assert flags["--rdzv-endpoint"] == "127.0.0.1:0"  # its store binds a port of its own
    assert command[-2:] == ["-m", "pkg.train"]


# ---------------------------------------------------------------- the worker's side


def _environ(
    port: int, replica: str = "1", replicas: str = "3", backend: str = "gloo"
) -> dict[str, str]:
    return {
        JOB_STORE_VARIABLE: f"127.0.0.1:{port}",
        REPLICA_VARIABLE: replica,
        REPLICAS_VARIABLE: replicas,
        BACKEND_VARIABLE: backend,
    }


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({JOB_STORE_VARIABLE: None}, "SCOPEDMESH_JOB_STORE is not set"),
        ({JOB_STORE_VARIABLE: "localhost"}, "SCOPEDMESH_JOB_STORE must be HOST:PORT"),
        ({REPLICA_VARIABLE: None}, "SCOPEDMESH_REPLICA is not set"),
        ({REPLICAS_VARIABLE: None}, "SCOPEDMESH_REPLICAS is not set"),
        ({REPLICA_VARIABLE: "3"}, "SCOPEDMESH_REPLICA must be an integer from 0 to 2, got '3'"),
        ({REPLICA_VARIABLE: "-1"}, "SCOPEDMESH_REPLICA must be an integer from 0 to 2"),
        ({REPLICAS_VARIABLE: "0"}, "SCOPEDMESH_REPLICAS must be an integer >= 1, got '0'"),
        ({REPLICAS_VARIABLE: "three"}, "SCOPEDMESH_REPLICAS must be an integer >= 1"),
        (
            {BACKEND_VARIABLE: "mpi"},
            "SCOPEDMESH_BACKEND must be one of ('gloo', 'nccl'), got 'mpi'",
        ),
        ({BACKEND_VARIABLE: None}, "SCOPEDMESH_BACKEND must be one of"),
    ],
)
def test_a_missing_or_malformed_variable_is_named(change: dict[str, str | None], says: str) -> None:
    environ = _environ(1)
    for name, value in change.items():
        if value is None:
            del environ[name]
        else:
            environ[name] = value
    with pytest.raises(ValueError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        job_from_environment(timeout=1.0, environ=environ)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan")])
def test_a_bad_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be finite and > 0"):
        job_from_environment(timeout=timeout, environ=_environ(1))
    with pytest.raises(TypeError, match="timeout must be a number"):
        job_from_environment(timeout="1", environ=_environ(1))  # type: ignore[arg-type]


def test_a_store_nobody_hosts_is_a_timeout_naming_its_address() -> None:
    with socket.socket() as sock:  # bound, never listening: connects are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(TimeoutError, match=f"the job store at 127.0.0.1:{port} could not"):
            job_from_environment(timeout=0.5, environ=_environ(port))


@pytest.fixture(scope="module")
def job_store() -> object:
    return host_job_store("127.0.0.1", 0, timeout=10.0)


@settings(max_examples=20, deadline=None)
@given(
    replicas=st.integers(1, 64),
    data=st.data(),
    backend=st.sampled_from(["gloo", "nccl"]),
)
def test_what_the_launcher_sets_is_what_the_worker_reads(
    job_store: object, replicas: int, data: st.DataObject, backend: str
) -> None:
    replica = data.draw(st.integers(0, replicas - 1))
    address = f"127.0.0.1:{job_store.port}"  # type: ignore[attr-defined]
    environ = worker_environment(address, replica=replica, replicas=replicas, backend=backend)
    job = job_from_environment(timeout=5.0, environ=environ)
    assert isinstance(job, JobEnvironment)
    assert (job.address, job.replica, job.replicas, job.backend) == (
        address,
        replica,
        replicas,
        backend,
    )
    job.store.set(f"seen/{replica}", backend)  # the client reaches the hosted store
    assert job_store.get(f"seen/{replica}") == backend.encode()  # type: ignore[attr-defined]
