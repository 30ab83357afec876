"""autoshard: automatic parallelism for PyTorch training."""

from autoshard.auto import plan  # noqa: E402  (after autoshard.plan, the module it shadows)
from autoshard.capture import CaptureError, capture_modes
from autoshard.cluster import PRESETS, ClusterSpec
from autoshard.layout import Factored, Layout, LayoutError
from autoshard.mesh import MeshError, init_mesh
from autoshard.ops import StrategyError
from autoshard.parallel import (
    ParallelModule,
    PlanMismatchError,
    parallelize,
    shard_inputs,
    single_device,
)
from autoshard.plan import Plan
from autoshard.redistribute import (
    RedistributionPlan,
    Step,
    gather_tensor,
    redistribute,
    redistribution_plan,
    shard_tensor,
)
from autoshard.search import PlanningError

__all__ = [
    "PRESETS",
    "CaptureError",
    "ClusterSpec",
    "Factored",
    "Layout",
    "LayoutError",
    "MeshError",
    "ParallelModule",
    "Plan",
    "PlanMismatchError",
    "PlanningError",
    "RedistributionPlan",
    "Step",
    "StrategyError",
    "capture_modes",
    "gather_tensor",
    "init_mesh",
    "parallelize",
    "plan",
    "redistribute",
    "redistribution_plan",
    "shard_inputs",
    "shard_tensor",
    "single_device",
]
