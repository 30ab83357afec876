"""The runtime, in rooms whose faces the others use (docs/architecture.md): ``state``
(checkpoints, models built on meta), ``program`` (the one-program module with its buckets,
ZeRO and replicas), ``ps`` (parameter servers, ``autoshard.ps``), ``pipeline`` (stages
and the executor of their schedule) and ``entry`` (``parallelize`` and its plans), each room
importing only the faces of those before it."""

from autoshard.runtime.entry import PlanMismatchError, check_plan_fits, parallelize
from autoshard.runtime.program import (
    GradScaler,
    GradSync,
    NonFiniteGradientError,
    ParallelModule,
    clip_grad_norm_,
    shard_inputs,
    single_device,
)
from autoshard.runtime.state import (
    CheckpointDamaged,
    CheckpointError,
    damaged,
    latest,
    load,
    materialize,
    meta_init,
    resume,
    save,
    unresumable,
)

__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "damaged",
    "latest",
    "load",
    "materialize",
    "meta_init",
    "resume",
    "save",
    "unresumable",
    "GradScaler",
    "GradSync",
    "NonFiniteGradientError",
    "clip_grad_norm_",
    "ParallelModule",
    "PlanMismatchError",
    "check_plan_fits",
    "parallelize",
    "shard_inputs",
    "single_device",
]
