"""autoshard: automatic parallelism for PyTorch training."""

from autoshard.layout import Factored, Layout, LayoutError
from autoshard.mesh import MeshError, init_mesh
from autoshard.redistribute import (
    RedistributionPlan,
    Step,
    gather_tensor,
    redistribute,
    redistribution_plan,
    shard_tensor,
)

__all__ = [
    "Factored",
    "Layout",
    "LayoutError",
    "MeshError",
    "RedistributionPlan",
    "Step",
    "gather_tensor",
    "init_mesh",
    "redistribute",
    "redistribution_plan",
    "shard_tensor",
]
