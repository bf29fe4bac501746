"""Bad input (tests/world/test_bad_input.py): outcomes, tallies, junk values, mesh fuzzing."""

from __future__ import annotations

import gc
import inspect
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from _workers_common import NAMES, destroy_all_but_world, live
from probes import ALLOWED, MESSAGE_LIMIT, nasty_values

from scopedmesh.mesh import ProcessGroupMesh


def outcome_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any, str]:
    """``("ok", result, "")``, ``("rejected", TypeName, message)`` or ``("violation", ...)``.

    A violation is an exception outside :data:`ALLOWED`, or one with an empty message.
    """
    try:
        result = fn(*args, **kwargs)
    except ALLOWED as exc:
        message = str(exc).strip("'\" ")
        if not message:
            return ("violation", type(exc).__name__, "empty message")
        return ("rejected", type(exc).__name__, message)
    except Exception as exc:
        return ("violation", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    return ("ok", result, "")


class Tally:
    """Counts of outcomes per entry point, and the first violations in full."""

    def __init__(self) -> None:
        self.tried = 0
        self.rejected = 0
        self.accepted = 0
        self.by_type: dict[str, int] = {}
        self.violations: dict[str, str] = {}

    def add(self, entry: str, outcome: tuple[str, Any, str], inputs: str) -> Any:
        self.tried += 1
        kind, value, message = outcome
        if kind == "ok":
            self.accepted += 1
            return value
        if kind == "rejected":
            self.rejected += 1
            self.by_type[value] = self.by_type.get(value, 0) + 1
            return None
        key = f"{entry}: {value}"
        self.violations.setdefault(key, f"{inputs}\n{message}")
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "tried": self.tried,
            "rejected": self.rejected,
            "accepted": self.accepted,
            "by_type": self.by_type,
            "violations": self.violations,
        }


def public_methods(cls: type) -> list[str]:
    """The public methods of ``cls``, plus ``__getitem__``; scope methods left out."""
    skip = {"close", "destroy_mesh_process_groups"}
    names = [
        n
        for n, v in vars(cls).items()
        if (not n.startswith("_") or n == "__getitem__")
        and n not in skip
        and (inspect.isfunction(v) or isinstance(v, staticmethod))
    ]
    return sorted(names)


def arity(cls: type, name: str) -> tuple[int, int, list[str], bool]:
    """(required positional, total positional, keyword-only names, has *args) of a method."""
    fn = inspect.unwrap(getattr(cls, name))
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    star = any(p.kind == p.VAR_POSITIONAL for p in params)
    return required, len(positional), keywords, star


def fuzz_mesh(rank: int, world_size: int, max_examples: int, seed: int) -> dict[str, Any]:
    """Hypothesis-driven bad input for ProcessGroupMesh in a one-rank world.

    Every constructor argument and every public method get junk mixed with valid
    values; a mesh that gets made is closed, and no group may outlive it.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    tally = Tally()
    leaks: list[str] = []
    baseline = live()
    junk = junk_strategy(st)
    methods = public_methods(ProcessGroupMesh)

    valid_shape = st.sampled_from([(1,), ((1,),), (1, 1), (-1,), ([1, 1],), (1, -1, 1)])
    junk_shape = st.one_of(st.lists(junk, max_size=3).map(tuple), st.tuples(junk))
    bad_backends = st.sampled_from(["nccl", "mpi", "ucc", "xccl", "bogus", "", "gloo,nccl"])
    valid_kwargs: dict[str, Any] = {
        "ranks": st.sampled_from([[0], range(1), (0,)]),
        "backend": st.sampled_from(["gloo", "GLOO", "cpu:gloo"]),
        "timeout": st.sampled_from([5, 2.5, timedelta(seconds=5), 10**6]),
        "pg_options": st.none(),
        "eager": st.booleans(),
    }
    bad_kwargs: dict[str, Any] = {
        "backend": st.one_of(junk, bad_backends),
        "timeout": st.one_of(junk, st.sampled_from([timedelta.max, 10**20, -1, 0])),
    }
    call_st = st.lists(
        st.tuples(st.sampled_from(methods), st.lists(junk, max_size=4), st.integers(0, 4)),
        max_size=6,
    )

    @hseed(seed)
    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data(), calls=call_st)
    def run(data: Any, calls: list[Any]) -> None:
        def corrupt() -> bool:  # one argument in five is bad: most meshes get made
            return bool(data.draw(st.integers(0, 4)) == 0)

        shape = data.draw(junk_shape if corrupt() else valid_shape)
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape
        kwargs: dict[str, Any] = {}
        if data.draw(st.booleans()):
            ndim = len(dims) if isinstance(dims, (list, tuple)) else 1
            names = st.just(("dp", "tp", "pp", "cp")[:ndim])
            kwargs["names"] = data.draw(junk if corrupt() else names)
        for key, valid in valid_kwargs.items():
            if data.draw(st.booleans()):
                kwargs[key] = data.draw(bad_kwargs.get(key, junk) if corrupt() else valid)
        inputs = f"ProcessGroupMesh(*{shape!r}, **{kwargs!r})"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = tally.add(
                "ProcessGroupMesh()", outcome_of(ProcessGroupMesh, *shape, **kwargs), inputs
            )
        if mesh is None:
            gc.collect()
            if live() != baseline:
                leaks.append(f"{inputs} left {live() - baseline} groups")
                destroy_all_but_world()
            return
        valid_pool = data
        with mesh:
            for name, args, valid_count in calls:
                args = _mix_valid(mesh, args, valid_count, valid_pool)
                required, total, _keywords, star = arity(ProcessGroupMesh, name)
                if not star:
                    args = args[:total]
                    if len(args) < required:
                        args += [0] * (required - len(args))
                fn = getattr(mesh, name)
                tally.add(
                    f"ProcessGroupMesh.{name}",
                    outcome_of(fn, *args),
                    f"{inputs}.{name}(*{args!r})",
                )
        if live() != baseline:
            leaks.append(f"{inputs} and {calls!r} left {live() - baseline} groups after close")
            destroy_all_but_world()

    run()
    return {
        "rank": rank,
        **tally.as_dict(),
        "leaks": leaks,
        "final_live": live() - baseline,
        "regressions": _regressions(),
    }


def _regressions() -> dict[str, Any]:
    """Inputs the fuzzing found mishandled, replayed as plain checks (one-rank world)."""

    def kind(fn: Callable[[], object]) -> str:
        outcome = outcome_of(fn)
        return (
            outcome[0] if outcome[0] == "ok" else f"{outcome[0]} {outcome[1]}: {outcome[2][:200]}"
        )

    out: dict[str, Any] = {}
    with ProcessGroupMesh(1, 1, names=NAMES) as mesh:
        mesh.get_group_along_axis(1)
        mesh.get_group_along_axis((0, 1))
        # Cached under 1 and (0, 1): equal-but-wrong keys must still be rejected.
        out["float_axis_after_cache"] = kind(lambda: mesh.get_group_along_axis(1.0))  # type: ignore[arg-type]
        out["bool_in_axes_after_cache"] = kind(lambda: mesh.get_group_along_axis((0, True)))
        out["float_in_axes_after_cache"] = kind(lambda: mesh.get_group_along_axis((0, 1.0)))  # type: ignore[arg-type]
        out["per_call_backend_bogus"] = kind(lambda: mesh.get_group_along_axis(0, backend="bogus"))
        out["per_call_backend_nccl"] = kind(lambda: mesh.get_group_along_axis(0, backend="nccl"))
    for name, kwargs in {
        "backend_bogus": {"backend": "bogus"},
        "backend_nccl": {"backend": "nccl"},
        "backend_mpi": {"backend": "mpi"},
        "timeout_inf": {"timeout": float("inf")},
        "timeout_nan": {"timeout": float("nan")},
        "timeout_huge_number": {"timeout": 10**20},
        "timeout_timedelta_max": {"timeout": timedelta.max},
    }.items():
        out[name] = kind(lambda kwargs=kwargs: ProcessGroupMesh(1, eager=True, **kwargs).close())  # type: ignore[misc]
    out["backend_gloo_qualified"] = kind(
        lambda: ProcessGroupMesh(1, backend="cpu:gloo", eager=True).close()
    )
    out["timeout_200_years"] = kind(
        lambda: ProcessGroupMesh(1, timeout=timedelta(days=73_000), eager=True).close()
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["eager_not_bool"] = kind(lambda: ProcessGroupMesh(1, eager="yes"))  # type: ignore[arg-type]
        gc.collect()
    out["eager_not_bool_warnings"] = [str(w.message) for w in caught]
    return out


def _mix_valid(mesh: ProcessGroupMesh, args: list[Any], count: int, data: Any) -> list[Any]:
    """Replace the first ``count`` junk arguments with values valid for ``mesh``."""
    from hypothesis import strategies as st

    ndim = len(mesh.shape)
    valid = [
        st.integers(-ndim, max(ndim - 1, 0)),
        st.just(tuple(range(ndim))),
        st.just(mesh.coordinate()),
        st.just([0]),
        st.just("gloo"),
        st.just("cpu"),
    ]
    if mesh.names:
        valid.append(st.sampled_from(mesh.names))
        valid.append(st.just(tuple(mesh.names)))
    valid_st = st.one_of(*valid)
    out = list(args)
    for i in range(min(count, len(out))):
        out[i] = data.draw(valid_st)
    return out


def junk_strategy(st: Any) -> Any:
    """Values of every kind a caller might pass by mistake, and some valid ones."""
    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 5),
        st.integers(),
        st.floats(),
        st.text(max_size=3),
        st.binary(max_size=2),
        st.sampled_from(
            ["dp", "tp", "pp", "x", "", "0", "gloo", "nccl", "cpu", "raise", "wrap", "clip"]
        ),
        st.sampled_from([slice(None), slice(0, 1), slice(None, None, 0), slice("a"), Ellipsis]),
        st.sampled_from([float("inf"), float("nan"), -0.0, 10**30, -(10**30), 2**63]),
        st.sampled_from(
            [object(), range(2), range(0), range(5, -1, -1), timedelta(0), timedelta(-1)]
        ),
        st.sampled_from([torch.tensor(1), torch.tensor([0, 1]), 1 + 2j]),
    )
    return st.one_of(
        scalar,
        st.lists(scalar, max_size=3),
        st.lists(st.integers(-2, 4), max_size=4),
        st.lists(st.integers(-2, 4), max_size=3).map(tuple),
        st.lists(st.lists(st.integers(-2, 3), max_size=3), max_size=3),
        st.lists(st.sampled_from(["dp", "tp", "x"]), max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["dp", "tp", 0, 1]), st.integers(-2, 3), max_size=2),
        st.sets(st.integers(0, 3), max_size=3),
    )


# ====================================== the torch-backed free functions, nasty values


def _slots(args: list[Any], kwargs: dict[str, Any]) -> list[int | str]:
    return [*range(len(args)), *kwargs]


def fuzz_torch_entries(rank: int, world_size: int) -> dict[str, Any]:
    """Every torch-backed free function, each argument in turn replaced by each nasty value.

    All ranks make the same calls in the same order (the values are the same), so a
    call that is accepted and communicates meets its peers. Afterwards the store
    and group formation must still work: a rejected argument breaks nothing later.
    """
    import torch.distributed as dist

    from scopedmesh import agree_on_lost, node_aware_mesh, reform, world_nodes
    from scopedmesh.errors import LostRankError
    from scopedmesh.layout import MeshLayout
    from scopedmesh.mesh.interop import layout_of, to_device_mesh

    names = ("dp",)
    made: list[ProcessGroupMesh] = []

    def mesh() -> ProcessGroupMesh:
        made.append(ProcessGroupMesh(world_size, names=names))
        return made[-1]

    with ProcessGroupMesh(world_size, names=names) as keeper:
        device_mesh = keeper.to_device_mesh("cpu")
    calls: dict[str, tuple[Callable[..., Any], Callable[[int], tuple[list[Any], dict[str, Any]]]]]
    calls = {
        "agree_on_lost": (
            agree_on_lost,
            lambda n: ([list(range(world_size)), rank], {"tag": f"fuzz{n}", "timeout": 1}),
        ),
        "reform": (reform, lambda n: ([mesh(), [], "dp"], {})),
        "world_nodes": (
            world_nodes,
            lambda n: ([], {"source": "hostname", "host": "node-a", "timeout": 30}),
        ),
        "node_aware_mesh": (
            node_aware_mesh,
            lambda n: (
                [world_size],
                {"intra_node": "dp", "names": names, "nodes": ["a"] * world_size, "timeout": 30},
            ),
        ),
        "ProcessGroupMesh.from_layout": (
            ProcessGroupMesh.from_layout,
            lambda n: (
                [MeshLayout((world_size,), names=names)],
                {"backend": "gloo", "timeout": 30, "pg_options": None, "eager": False},
            ),
        ),
        "to_device_mesh": (to_device_mesh, lambda n: ([mesh(), "cpu", None], {})),
        "layout_of": (layout_of, lambda n: ([device_mesh], {})),
    }
    tally = Tally()
    long_messages: list[str] = []
    baseline = live()
    n = 0
    for entry, (fn, good) in calls.items():
        for slot in _slots(*good(0)):
            for value in nasty_values():
                n += 1
                args, kwargs = good(n)
                if isinstance(slot, int):
                    args[slot] = value
                else:
                    kwargs[slot] = value
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    outcome = outcome_of(fn, *args, **kwargs)
                    if outcome[0] == "violation" and outcome[1] == LostRankError.__name__:
                        outcome = ("ok", None, "")  # a valid `lost` that drops this rank
                    result = tally.add(entry, outcome, f"{entry} slot {slot}")
                    if outcome[0] == "rejected" and len(outcome[2]) > MESSAGE_LIMIT:
                        long_messages.append(f"{entry} slot {slot}: {len(outcome[2])} characters")
                    if isinstance(result, ProcessGroupMesh):
                        result.close()
                    for m in made:
                        m.close()
                    made.clear()
        gc.collect()
    # Nothing broke for later: the store answers, and a new mesh forms a group that sums.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"after-fuzz/{rank}", "ok")
    after = [store.get(f"after-fuzz/{r}").decode() for r in range(world_size)]
    with ProcessGroupMesh(world_size, names=names) as fresh:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total, group=fresh.get_group_along_axis("dp"))
    return {
        **tally.as_dict(),
        "long_messages": long_messages,
        "left_groups": live() - baseline,
        "store_after": after,
        "sum_after": total.item(),
    }
