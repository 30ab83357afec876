"""The runtime's pipeline room: the module of a rank's stages (``module``), the executor of
their schedule's actions (``step``), a stage's micro-batch run as interleaved copies
(``copies``); the loss of micro-batches is weighed by their targets
(``CountedLoss``, of the program room). The entry uses this face only."""

from autoshard.runtime.pipeline.module import (
    Pipe,
    PipelineModule,
    cut_modes,
    microbatch_example,
    pipeline_groups,
    pipeline_plans,
    stage_mesh,
)
from autoshard.runtime.program import CountedLoss

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
