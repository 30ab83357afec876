"""The runtime: the parallel module each rank trains (``parallel``), its gradient buckets
(``grad_sync``), ZeRO (``zero``), checkpoints (``checkpoint``), clipping (``clip``), loss scaling
(``scaler``), replicas (``replicas``) and models built on the meta device (``materialize``)."""

from autoshard.runtime.checkpoint import CheckpointDamaged, CheckpointError, latest, load, save
from autoshard.runtime.clip import NonFiniteGradientError, clip_grad_norm_
from autoshard.runtime.entry import parallelize
from autoshard.runtime.grad_sync import GradSync
from autoshard.runtime.materialize import materialize, meta_init
from autoshard.runtime.parallel import (
    ParallelModule,
    PlanMismatchError,
    shard_inputs,
    single_device,
)
from autoshard.runtime.scaler import GradScaler

__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "latest",
    "load",
    "materialize",
    "meta_init",
    "save",
    "GradScaler",
    "GradSync",
    "NonFiniteGradientError",
    "clip_grad_norm_",
    "ParallelModule",
    "PlanMismatchError",
    "parallelize",
    "shard_inputs",
    "single_device",
]
