"""The runtime's pipeline room: the module of a rank's stages (``module``), the executor of
their schedule's actions (``step``) and the loss of micro-batches weighed by their targets
(``microbatch_loss``). The entry uses this face only."""

from autoshard.runtime.pipeline.microbatch_loss import CountedLoss
from autoshard.runtime.pipeline.module import (
    Pipe,
    PipelineModule,
    cut_modes,
    microbatch_example,
    pipeline_groups,
    pipeline_plans,
    stage_mesh,
)

__all__ = [
    "CountedLoss",
    "Pipe",
    "PipelineModule",
    "cut_modes",
    "microbatch_example",
    "pipeline_groups",
    "pipeline_plans",
    "stage_mesh",
]
