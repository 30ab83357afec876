"""autoshard: automatic parallelism for PyTorch training."""

from autoshard import data
from autoshard.cost import PRESETS, ClusterSpec
from autoshard.graph import CaptureError, capture_modes
from autoshard.layout import Factored, Layout, LayoutError
from autoshard.mesh import MeshError, init_mesh
from autoshard.ops import StrategyError
from autoshard.precision import Precision
from autoshard.redistribution import (
    RedistributionPlan,
    Step,
    gather_tensor,
    redistribute,
    redistribution_plan,
    shard_tensor,
)
from autoshard.runtime import (
    CheckpointDamaged,
    CheckpointError,
    GradScaler,
    NonFiniteGradientError,
    ParallelModule,
    PlanMismatchError,
    clip_grad_norm_,
    latest,
    load,
    materialize,
    meta_init,
    parallelize,
    save,
    shard_inputs,
    single_device,
)
from autoshard.search import Plan, PlanningError, plan

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
