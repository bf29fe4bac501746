"""torchtitan's own config functions, as :class:`~scopedmesh.interop.titan_trainer.ReplicatedTrainer`'s.

torchtitan's entry point takes ``--module M --config F`` and builds whatever trainer
``M.F()``'s config owns. This module answers any of torchtitan's model config
functions by name (``llama3_debugmodel``, ``llama3_8b``, ``qwen3_...``): the same
config, owned by the replicated trainer, with its ``scopedmesh`` section::

    python -m torchtitan.train --module scopedmesh.interop.titan_configs \\
        --config llama3_debugmodel --scopedmesh.enable

>>> replicated_name("llama3_debugmodel")
'torchtitan.models.llama3.config_registry'
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from scopedmesh.interop.titan_trainer import ReplicatedTrainer

__all__ = ["replicated", "replicated_name"]


def replicated(config: Any) -> ReplicatedTrainer.Config:
    """torchtitan's ``Trainer.Config`` ``config`` as the replicated trainer's (the
    ``scopedmesh`` section at its defaults: off until ``--scopedmesh.enable``)."""
    from torchtitan.trainer import Trainer

    if not isinstance(config, Trainer.Config):
        raise TypeError(f"config must be a torchtitan Trainer.Config, got {type(config).__name__}")
    if isinstance(config, ReplicatedTrainer.Config):
        return config
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    extra = set(values) - {f.name for f in dataclasses.fields(ReplicatedTrainer.Config)}
    if extra:  # a trainer of its own (torchft's): its fields have no home here
        raise ValueError(
            f"config is a {type(config).__qualname__}, with fields {sorted(extra)} that "
            "torchtitan's Trainer does not have; start from a plain Trainer.Config"
        )
    return ReplicatedTrainer.Config(**values)


def replicated_name(name: str) -> str:
    """The torchtitan config registry that defines ``name``: the model whose name is
    the longest prefix of it (``llama3_debugmodel``: ``llama3``)."""
    from torchtitan.models import _supported_models

    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    models = sorted((m for m in _supported_models if name.startswith(f"{m}_")), key=len)
    if not models:
        raise ValueError(
            f"no torchtitan model's config is named {name!r}: a config name starts with "
            f"its model's name, one of {sorted(_supported_models)}"
        )
    return f"torchtitan.models.{models[-1]}.config_registry"


def __getattr__(name: str) -> Callable[[], ReplicatedTrainer.Config]:
    """torchtitan's config function ``name``, returning the replicated trainer's config."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        module = importlib.import_module(replicated_name(name))
    except ValueError as error:
        raise AttributeError(str(error)) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"{module.__name__} has no config function {name!r}")

    def config() -> ReplicatedTrainer.Config:
        return replicated(function())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {name}, for the replicated trainer."
    return config
