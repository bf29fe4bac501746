"""What a ``@pytest.mark.world`` test is, and how one rank runs it.

The pytest plugin (:mod:`scopedmesh.testing.plugin`) turns a marked test into a
:class:`WorldTask`; every rank of the world loads the test's module from its
file (with pytest's assertion rewriting when available), replaces the plugin's
fixtures with its own :class:`WorldRank` and mesh, and calls the test. Torch
loads only inside :func:`run_task`, on the ranks.

>>> spec = WorldSpec(4, mesh=(2, 2), names=("dp", "tp"))
>>> spec.size, spec.backend, spec.mesh
(4, 'gloo', (2, 2))
>>> WorldRank(1, 4)
WorldRank(rank=1, world_size=4, mesh=None)
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import TYPE_CHECKING, Any

from scopedmesh.errors import shown

if TYPE_CHECKING:
    from scopedmesh.mesh import ProcessGroupMesh

__all__ = [
    "START_METHODS",
    "WARM_MODULES",
    "FixtureSlot",
    "WorldRank",
    "WorldSpec",
    "WorldTask",
    "run_task",
    "spec_from_marker",
    "start_fork_server",
]

DEFAULT_TIMEOUT = 120.0
# How a world's ranks start: forked from a warm server, or spawned as new interpreters.
START_METHODS = ("forkserver", "spawn")
# What the fork server imports before it forks its first rank (a module that is not
# installed is skipped): torch and scopedmesh, plus what a rank needs to load a test
# module (pytest's assertion rewriting, hypothesis).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "scopedmesh",
    "scopedmesh.testing.launcher",
    "scopedmesh.testing.world",
    "_pytest.assertion.rewrite",
    "hypothesis",
)


def start_fork_server() -> None:
    """Start the warm server that world ranks fork from, if it is not running; do not wait.

    Its imports (:data:`WARM_MODULES`) then run while the caller goes on, for
    example while pytest imports the test modules. Idempotent.
    """
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WARM_MODULES))
    multiprocessing.forkserver.ensure_running()


@dataclass(frozen=True)
class WorldSpec:
    """The arguments of ``@pytest.mark.world(size, backend=..., timeout=..., mesh=..., ...)``."""

    size: int
    backend: str = "gloo"
    timeout: float = DEFAULT_TIMEOUT
    mesh: tuple[int, ...] | None = None
    names: tuple[str, ...] | None = None
    reuse: bool = False


@dataclass(frozen=True)
class WorldRank:
    """What the ``world`` fixture gives each rank: its rank, the world size, the open mesh."""

    rank: int
    world_size: int
    mesh: ProcessGroupMesh | None = field(default=None, compare=False)


@dataclass(frozen=True)
class FixtureSlot:
    """Stands in the parent process for a fixture whose value only a rank can make."""

    name: str  # "world" or "mesh"


@dataclass(frozen=True)
class WorldTask:
    """One test to run on every rank: where its function is, and its other fixtures' values."""

    module: str
    path: str
    qualname: str
    kwargs: dict[str, Any]
    spec: WorldSpec


def spec_from_marker(args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorldSpec:
    """Check the marker's arguments; ``TypeError``/``ValueError`` name the one at fault.

    >>> spec_from_marker((2,), {"timeout": 30}).timeout
    30.0
    >>> spec_from_marker((0,), {})
    Traceback (most recent call last):
    ...
    ValueError: world(size): size must be >= 1, got 0
    """
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise TypeError(
            f"the world marker takes positional and keyword arguments, got {shown(args)}, "
            f"{shown(kwargs)}"
        )
    known = {"backend", "timeout", "mesh", "names", "reuse"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"world(): unknown option {shown(unknown[0])}; options are {sorted(known)}")
    if len(args) != 1:
        raise TypeError(f"world(size) takes one positional argument, the size; got {shown(args)}")
    size = args[0]
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"world(size): size must be an int, got {type(size).__name__}")
    if size < 1:
        raise ValueError(f"world(size): size must be >= 1, got {size}")
    backend = kwargs.get("backend", "gloo")
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            f"world(backend=...): backend must be a non-empty str, got {shown(backend)}"
        )
    timeout = kwargs.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"world(timeout=...): timeout must be seconds, got {shown(timeout)}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"world(timeout=...): timeout must be finite and > 0, got {shown(timeout)}"
        )
    reuse = kwargs.get("reuse", False)
    if not isinstance(reuse, bool):
        raise TypeError(f"world(reuse=...): reuse must be True or False, got {shown(reuse)}")
    mesh = _mesh_shape(kwargs.get("mesh"), size)
    names = kwargs.get("names")
    if names is not None:
        if mesh is None:
            raise ValueError("world(names=...): names need a mesh shape, e.g. mesh=(2, 2)")
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"world(names=...): names must be a sequence of str, got {shown(names)}"
            )
        names = tuple(names)
        if len(names) != len(mesh):
            raise ValueError(f"world(names=...): {len(names)} names for {len(mesh)} mesh axes")
    return WorldSpec(size, backend, float(timeout), mesh, names, reuse)


def _mesh_shape(mesh: object, size: int) -> tuple[int, ...] | None:
    if mesh is None:
        return None
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        mesh = (mesh,)
    if not isinstance(mesh, (tuple, list)) or not mesh:
        raise TypeError(f"world(mesh=...): mesh must be a tuple of axis sizes, got {shown(mesh)}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in mesh):
        raise TypeError(f"world(mesh=...): axis sizes must be ints, got {shown(mesh)}")
    shape = tuple(mesh)
    known = math.prod(n for n in shape if n != -1)
    inferred = shape.count(-1)
    fits = known == size if not inferred else inferred == 1 and known > 0 and size % known == 0
    if not fits or any(n == 0 or n < -1 for n in shape):
        raise ValueError(f"world(mesh=...): a mesh of shape {shape} does not lay out {size} ranks")
    return shape


def run_task(rank: int, world_size: int, task: WorldTask) -> None:
    """Run ``task``'s test on this rank (the body of every rank of a world test).

    For a hypothesis test, ``task.kwargs`` holds one example's values and the
    test's inner function (what ``@given`` wraps) runs with them.
    """
    fn = _test_function(task)
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)
    spec = task.spec
    if spec.mesh is None:
        fn(**_fill(task.kwargs, WorldRank(rank, world_size)))
        return
    from scopedmesh.mesh import ProcessGroupMesh

    with ProcessGroupMesh(*spec.mesh, names=spec.names, timeout=spec.timeout) as mesh:
        fn(**_fill(task.kwargs, WorldRank(rank, world_size, mesh)))


def _fill(kwargs: dict[str, Any], here: WorldRank) -> dict[str, Any]:
    filled = dict(kwargs)
    for name, value in kwargs.items():
        if isinstance(value, FixtureSlot):
            filled[name] = here if value.name == "world" else here.mesh
    return filled


def _test_function(task: WorldTask) -> Any:
    target: Any = _load(task.module, task.path)
    parts = task.qualname.split(".")
    if "<locals>" in parts:
        raise TypeError(f"{task.qualname} is defined inside a function: a world test must not be")
    for i, part in enumerate(parts):
        target = getattr(target, part)
        if isinstance(target, type) and i < len(parts) - 1:
            target = target()  # a test class: its methods run on a fresh instance
    return target


def _load(name: str, path: str) -> ModuleType:
    """The test module as this rank sees it: loaded once from ``path``, asserts rewritten."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load the test module {shown(name)} from {path}")
    module = importlib.util.module_from_spec(spec)
    source = Path(path).read_bytes()
    code = _rewritten(source, path) or compile(source, path, "exec", dont_inherit=True)
    if "." in name:
        importlib.import_module(name.rpartition(".")[0])  # its package, for relative imports
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


def _rewritten(source: bytes, path: str) -> CodeType | None:
    """``source`` compiled with pytest's assertion rewriting, or None where that fails."""
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        return compile(tree, path, "exec", dont_inherit=True)
    except Exception:  # a private pytest API: plain asserts still work without it
        return None
