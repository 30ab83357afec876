"""The runtime's one-program room: the module each rank runs (``parallel``; on one device, the
reference every parallel run must equal, ``reference``) with its gradient
buckets overlapping backward (``grad_sync``), ZeRO's shards and units (``zero``), replicas made
equal (``replicas``), clipping (``clip``), loss scaling (``scaler``), the loss of micro-batches
and copies weighed by their targets (``counted_loss``) and the batch cut in copies whose
collectives overlap each other's compute (``copies``), the whole batch's statistics among
them (``copy_means``). The pipeline and the
entry use this face only."""

from autoshard.runtime.program.clip import NonFiniteGradientError, clip_grad_norm_
from autoshard.runtime.program.copies import (
    combine,
    copy_example,
    interleaved_program,
    whole_copies,
)
from autoshard.runtime.program.copy_means import batch_means
from autoshard.runtime.program.counted_loss import CountedLoss
from autoshard.runtime.program.grad_sync import GradSync
from autoshard.runtime.program.inputs import local_input, shard_inputs
from autoshard.runtime.program.parallel import ParallelModule
from autoshard.runtime.program.reference import single_device
from autoshard.runtime.program.replicas import ReplicaMismatchError
from autoshard.runtime.program.scaler import GradScaler

__all__ = [
    "CountedLoss",
    "GradScaler",
    "GradSync",
    "NonFiniteGradientError",
    "ParallelModule",
    "ReplicaMismatchError",
    "batch_means",
    "clip_grad_norm_",
    "combine",
    "copy_example",
    "interleaved_program",
    "local_input",
    "shard_inputs",
    "single_device",
    "whole_copies",
]
