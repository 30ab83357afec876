"""The runtime: the parallel module each rank trains (``parallel``) and its gradient
synchronisation (``grad_sync``)."""

from autoshard.runtime.clip import NonFiniteGradientError, clip_grad_norm_
from autoshard.runtime.grad_sync import GradSync
from autoshard.runtime.parallel import (
    ParallelModule,
    PlanMismatchError,
    parallelize,
    shard_inputs,
    single_device,
)

__all__ = [
    "GradSync",
    "NonFiniteGradientError",
    "clip_grad_norm_",
    "ParallelModule",
    "PlanMismatchError",
    "parallelize",
    "shard_inputs",
    "single_device",
]
