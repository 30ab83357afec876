"""autoshard: automatic parallelism for PyTorch training.

The runtime's names (``parallelize``, ``save``, ...) are imported on first use: planning
(``autoshard plan``) does not need the runtime, nor the parts of torch.distributed it
imports.
"""

import importlib
from typing import Any

from autoshard import (
    command,  # (first: the command's start, before torch)
    data,
)
from autoshard.cost import PRESETS, ClusterSpec
from autoshard.graph import CaptureError, capture_modes
from autoshard.layout import Factored, Layout, LayoutError
from autoshard.mesh import MeshError, init_mesh
from autoshard.ops import StrategyError
from autoshard.options import Options
from autoshard.precision import Precision
from autoshard.redistribution import (
    RedistributionPlan,
    Step,
    gather_tensor,
    redistribute,
    redistribution_plan,
    shard_tensor,
)
from autoshard.search import Plan, PlanningError, plan

command.resume()  # (the import's end: the command's collector on again)

#: names of the runtime, imported from it on first use (``__getattr__``)
_RUNTIME = (
    "CheckpointDamaged",
    "CheckpointError",
    "GradScaler",
    "NonFiniteGradientError",
    "ParallelModule",
    "PlanMismatchError",
    "clip_grad_norm_",
    "latest",
    "load",
    "materialize",
    "meta_init",
    "parallelize",
    "save",
    "shard_inputs",
    "single_device",
)


def __getattr__(name: str) -> Any:
    if name == "runtime":
        return importlib.import_module("autoshard.runtime")
    if name == "ps":  # parameter servers, imported when first named
        return importlib.import_module("autoshard.ps")
    if name in _RUNTIME:
        value = getattr(importlib.import_module("autoshard.runtime"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_RUNTIME))


__all__ = [
    "PRESETS",
    "CaptureError",
    "CheckpointDamaged",
    "CheckpointError",
    "ClusterSpec",
    "Factored",
    "GradScaler",
    "Layout",
    "LayoutError",
    "MeshError",
    "NonFiniteGradientError",
    "ParallelModule",
    "Plan",
    "PlanMismatchError",
    "PlanningError",
    "Options",
    "Precision",
    "RedistributionPlan",
    "Step",
    "StrategyError",
    "capture_modes",
    "clip_grad_norm_",
    "data",
    "gather_tensor",
    "init_mesh",
    "latest",
    "load",
    "materialize",
    "meta_init",
    "parallelize",
    "plan",
    "redistribute",
    "redistribution_plan",
    "save",
    "shard_inputs",
    "shard_tensor",
    "single_device",
]
