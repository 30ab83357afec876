"""Redistribution: the least-bytes plan between two layouts (``planner``) and running it on this
rank's tensor, differentiably (``execute``)."""

from autoshard.redistribution.execute import (
    execute,
    gather_tensor,
    redistribute,
    shard_tensor,
    start_execute,
)
from autoshard.redistribution.planner import (
    RedistributionPlan,
    Step,
    StepCost,
    backward_plan,
    backward_source,
    gradient_sum,
    redistribution_plan,
    replica_sum_groups,
    step_costs,
)
from autoshard.redistribution.posted import Finish, post_execute

__all__ = [
    "Finish",
    "RedistributionPlan",
    "Step",
    "StepCost",
    "backward_plan",
    "backward_source",
    "gradient_sum",
    "post_execute",
    "execute",
    "gather_tensor",
    "redistribute",
    "redistribution_plan",
    "replica_sum_groups",
    "shard_tensor",
    "start_execute",
    "step_costs",
]
