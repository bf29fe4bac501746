"""A pytest plugin: run a test on a local multi-process world with ``@pytest.mark.world(N)``.

Installed with ``pip install scopedmesh[testing]`` (entry point ``pytest11``):

.. code-block:: python

    @pytest.mark.world(4, mesh=(2, 2), names=("dp", "tp"))
    def test_tp_sum(world, mesh):  # runs on ranks 0..3, each in its own process
        x = torch.tensor([float(world.rank)])
        dist.all_reduce(x, group=mesh.get_group_along_axis("tp"))
        assert x.item() == (1.0 if world.rank < 2 else 5.0)

The marker ``world(size, *, backend="gloo", timeout=120, mesh=None, names=None,
reuse=False)`` runs the test function on ``size`` ranks through
:func:`scopedmesh.testing.run_world`; a rank that fails, dies or is still running
after ``timeout`` seconds fails the test with its rank and traceback, and no
process outlives the test. The ``world`` fixture is each rank's
:class:`~scopedmesh.testing.world.WorldRank` (``rank``, ``world_size``,
``mesh``); the ``mesh`` fixture is a ``ProcessGroupMesh`` of shape ``mesh``
opened before the test and closed after it. Other fixtures are made once in the
pytest process and their values pickled to every rank.

``reuse=True`` (opt-in) keeps one world per test module and size: later tests
of the module skip the fork and the rendezvous. It is safe for tests
that leave the world as they found it (groups made through ``with`` meshes,
WORLD not destroyed); a test that fails, hangs or destroys WORLD ends that
world and the next test starts a fresh one.

Ranks fork from a warm server that has imported torch once (see
:func:`scopedmesh.testing.launcher.world_context`), so a world starts in a
fraction of a second; ``pytest --world-start=spawn`` starts each rank as a new
interpreter instead.

A test that is also ``@given(...)`` (hypothesis) runs hypothesis in the pytest
process and every example on all ranks of one live world, in lockstep: the
ranks receive the drawn values, a failure on any rank fails the example (so
hypothesis shrinks it), the report names the rank with its traceback, and a
failed or hung example gets a fresh world for the next one.

Loading the plugin imports neither torch nor the launcher.

>>> spec_from_marker((4,), {"mesh": (2, -1), "reuse": True})
WorldSpec(size=4, backend='gloo', timeout=120.0, mesh=(2, -1), names=None, reuse=True)
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from pathlib import Path
from typing import Any

import pytest

from scopedmesh.testing.world import (
    START_METHODS,
    FixtureSlot,
    WorldSpec,
    WorldTask,
    spec_from_marker,
    start_fork_server,
)

__all__ = ["mesh", "world"]

_SPEC = pytest.StashKey[WorldSpec]()
# One ReusedWorld per (module node id, size, backend), kept on the session's config.
_WORLDS = pytest.StashKey[dict[tuple[str, int, str], Any]]()

_MARKER = (
    "world(size, *, backend='gloo', timeout=120, mesh=None, names=None, reuse=False): "
    "run the test on a local world of `size` ranks (scopedmesh); the `world` fixture "
    "gives each rank its rank and world size, the `mesh` fixture an open mesh of shape `mesh`"
)


# Once one rank has failed an example, the others get this long to report: a rank
# left waiting in a collective for the failed one would otherwise cost every
# shrinking step the full grace of a plain test.
EXAMPLE_GRACE = 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--world-start",
        choices=START_METHODS,
        default="forkserver",
        help="how @pytest.mark.world ranks start: forked from a warm server that has "
        "imported torch (forkserver, the default) or as new interpreters (spawn)",
    )


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    """Start the fork server as soon as a test file that mentions the marker is found.

    The server's torch import then overlaps pytest's own import of the test
    modules. A file that only mentions the marker starts a server no test uses
    (harmless); one that builds the marker some other way just starts it later.
    """
    if file_path.suffix != ".py":
        return
    if parent.config.getoption("world_start", "forkserver") != "forkserver":
        return
    try:
        mentions = "mark.world" in file_path.read_text(errors="ignore")
    except OSError:
        return
    if mentions:
        start_fork_server()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER)
    config.stash[_WORLDS] = {}


@pytest.hookimpl(trylast=True)  # after pytest's own setup: the fixtures are filled
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("world")
    spec = None
    if marker is not None:
        spec = item.stash[_SPEC] = spec_from_marker(marker.args, dict(marker.kwargs))
    if isinstance(item, pytest.Function):
        _check_slots(item, spec)


# Session-scoped: the value is a constant stand-in here; each rank puts its own world
# (and a mesh opened for each test, or each hypothesis example) in its place.
@pytest.fixture(scope="session")
def world() -> Any:
    """This rank's :class:`~scopedmesh.testing.world.WorldRank` in a ``@pytest.mark.world`` test."""
    return FixtureSlot("world")


@pytest.fixture(scope="session")
def mesh() -> Any:
    """The open ``ProcessGroupMesh`` of ``@pytest.mark.world(size, mesh=shape)``, closed after."""
    return FixtureSlot("mesh")


def _check_slots(item: pytest.Function, spec: WorldSpec | None) -> None:
    """Refuse the plugin's fixtures in a test that cannot fill them."""
    slots = {v.name for v in item.funcargs.values() if isinstance(v, FixtureSlot)}
    if slots and spec is None:
        raise ValueError(
            f"the {sorted(slots)[0]} fixture needs the test marked @pytest.mark.world(size)"
        )
    if "mesh" in slots and spec is not None and spec.mesh is None:
        raise ValueError(
            "the mesh fixture needs a mesh shape in the marker, e.g. "
            "@pytest.mark.world(4, mesh=(2, 2), names=('dp', 'tp'))"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.stash.get(_SPEC, None)
    if spec is None:
        return None
    task = _task(pyfuncitem, spec)
    if hasattr(pyfuncitem.obj, "hypothesis"):
        _run_examples(pyfuncitem, spec, task)
        return True
    from scopedmesh.testing.launcher import WorldError, run_world
    from scopedmesh.testing.world import run_task

    failure = None
    try:
        if spec.reuse:
            _reused(pyfuncitem, spec).run(run_task, (task,), spec.timeout)
        else:
            run_world(
                run_task,
                spec.size,
                args=(task,),
                backend=spec.backend,
                timeout=spec.timeout,
                init_timeout=spec.timeout,
                start_method=_start_method(pyfuncitem),
            )
    except WorldError as error:
        failure = str(error)
    if failure is not None:  # outside the except: the report is the ranks' tracebacks alone
        pytest.fail(failure, pytrace=False)
    return True


def _run_examples(item: pytest.Function, spec: WorldSpec, task: WorldTask) -> None:
    """Run a ``@given`` world test: hypothesis here, each example on every rank of one world."""
    from scopedmesh.testing.launcher import WorldError
    from scopedmesh.testing.reuse import ReusedWorld
    from scopedmesh.testing.world import run_task

    if spec.reuse:
        world = _reused(item, spec)
    else:
        world = ReusedWorld(spec.size, spec.backend, _start_method(item))

    hypothesis = item.obj.hypothesis
    inner = hypothesis.inner_test

    @functools.wraps(inner)  # hypothesis names the test in its report by this function
    def run_example(**kwargs: Any) -> None:
        __tracebackhide__ = True
        example = dataclasses.replace(task, kwargs=kwargs)
        _check_picklable(item, kwargs, "the example's values")
        try:
            world.run(run_task, (example,), spec.timeout, grace=EXAMPLE_GRACE)
        except WorldError as error:  # raised here, so the report is the ranks' tracebacks
            raise WorldError(str(error), error.failures, error.still_running) from None
        finally:
            # A failed or hung example ended the world: start the next one now, so the
            # next example's time (hypothesis's deadline) is its own.
            world.start(spec.timeout)

    hypothesis.inner_test = run_example
    try:
        world.start(spec.timeout)
        item.obj(**task.kwargs)
    finally:
        hypothesis.inner_test = inner
        if not spec.reuse:
            world.close()


def _start_method(item: pytest.Item) -> str:
    method: str = item.config.getoption("world_start", "forkserver")
    return method


def _check_picklable(item: pytest.Item, values: dict[str, Any], what: str) -> None:
    for name, value in values.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"{item.nodeid}: {what} {name!r} must be picklable to reach the ranks: {exc}"
            ) from exc


def _task(item: pytest.Function, spec: WorldSpec) -> WorldTask:
    module = item.module
    if module is None or getattr(module, "__file__", None) is None:
        raise TypeError(f"{item.nodeid}: a world test must be defined in a module file")
    names = item._fixtureinfo.argnames  # the function's own arguments
    kwargs = {name: item.funcargs[name] for name in names}
    _check_picklable(item, kwargs, "fixture (made in the pytest process)")
    function = item.function
    function = getattr(getattr(function, "hypothesis", None), "inner_test", function)
    return WorldTask(module.__name__, module.__file__, function.__qualname__, kwargs, spec)


def _reused(item: pytest.Function, spec: WorldSpec) -> Any:
    from scopedmesh.testing.reuse import ReusedWorld

    worlds = item.config.stash[_WORLDS]
    key = (_module_id(item), spec.size, spec.backend)
    if key not in worlds:
        worlds[key] = ReusedWorld(spec.size, spec.backend, _start_method(item))
    return worlds[key]


def _module_id(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close a module's reused worlds after its last test."""
    worlds = item.config.stash.get(_WORLDS, {})
    here = _module_id(item)
    if nextitem is not None and _module_id(nextitem) == here:
        return
    for key in [k for k in worlds if k[0] == here]:
        worlds.pop(key).close()


def pytest_unconfigure(config: pytest.Config) -> None:
    worlds = config.stash.get(_WORLDS, {})
    while worlds:
        worlds.popitem()[1].close()
