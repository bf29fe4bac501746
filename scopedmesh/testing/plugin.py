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
of the module skip the ~10 s of imports and rendezvous. It is safe for tests
that leave the world as they found it (groups made through ``with`` meshes,
WORLD not destroyed); a test that fails, hangs or destroys WORLD ends that
world and the next test starts a fresh one.

Loading the plugin imports neither torch nor the launcher.

>>> spec_from_marker((4,), {"mesh": (2, -1), "reuse": True})
WorldSpec(size=4, backend='gloo', timeout=120.0, mesh=(2, -1), names=None, reuse=True)
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from scopedmesh.testing.world import FixtureSlot, WorldSpec, WorldTask, spec_from_marker

__all__ = ["mesh", "world"]

_SPEC = pytest.StashKey[WorldSpec]()
# One ReusedWorld per (module node id, size, backend), kept on the session's config.
_WORLDS = pytest.StashKey[dict[tuple[str, int, str], Any]]()

_MARKER = (
    "world(size, *, backend='gloo', timeout=120, mesh=None, names=None, reuse=False): "
    "run the test on a local world of `size` ranks (scopedmesh); the `world` fixture "
    "gives each rank its rank and world size, the `mesh` fixture an open mesh of shape `mesh`"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER)
    config.stash[_WORLDS] = {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("world")
    if marker is not None:
        item.stash[_SPEC] = spec_from_marker(marker.args, dict(marker.kwargs))


@pytest.fixture
def world(request: pytest.FixtureRequest) -> Any:
    """This rank's :class:`~scopedmesh.testing.world.WorldRank` in a ``@pytest.mark.world`` test."""
    if request.node.get_closest_marker("world") is None:
        raise ValueError("the world fixture needs the test marked @pytest.mark.world(size)")
    return FixtureSlot("world")


@pytest.fixture
def mesh(request: pytest.FixtureRequest) -> Any:
    """The open ``ProcessGroupMesh`` of ``@pytest.mark.world(size, mesh=shape)``, closed after."""
    marker = request.node.get_closest_marker("world")
    if marker is None or marker.kwargs.get("mesh") is None:
        raise ValueError(
            "the mesh fixture needs a mesh shape in the marker, e.g. "
            "@pytest.mark.world(4, mesh=(2, 2), names=('dp', 'tp'))"
        )
    return FixtureSlot("mesh")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.stash.get(_SPEC, None)
    if spec is None:
        return None
    task = _task(pyfuncitem, spec)
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
            )
    except WorldError as error:
        failure = str(error)
    if failure is not None:  # outside the except: the report is the ranks' tracebacks alone
        pytest.fail(failure, pytrace=False)
    return True


def _task(item: pytest.Function, spec: WorldSpec) -> WorldTask:
    module = item.module
    if module is None or getattr(module, "__file__", None) is None:
        raise TypeError(f"{item.nodeid}: a world test must be defined in a module file")
    names = item._fixtureinfo.argnames  # the function's own arguments
    kwargs = {name: item.funcargs[name] for name in names}
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"{item.nodeid}: fixture {name!r} is made in the pytest process and must be "
                f"picklable to reach the ranks: {exc}"
            ) from exc
    return WorldTask(module.__name__, module.__file__, item.function.__qualname__, kwargs, spec)


def _reused(item: pytest.Function, spec: WorldSpec) -> Any:
    from scopedmesh.testing.reuse import ReusedWorld

    worlds = item.config.stash[_WORLDS]
    key = (_module_id(item), spec.size, spec.backend)
    if key not in worlds:
        worlds[key] = ReusedWorld(spec.size, spec.backend)
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
