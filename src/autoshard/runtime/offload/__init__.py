"""The runtime's offload room: training state kept on the host rather than the device
(``optimizer``: a fraction of each tensor's master weights, optimizer state and update; ``host``:
parameters made on the host, ZeRO 3's shards and embedding tables; ``embeddings``: tables looked up
and updated on the host; ``activations``: what the named blocks save for backward; ``nvme``: the
optimizer's host part in files; docs/parallelism/offload.md). The one-program room and the
pipeline's place their state here through this face."""

from autoshard.runtime.offload.activations import (
    ActivationOffload,
    OffloadedBlock,
    activation_offload,
)
from autoshard.runtime.offload.embeddings import EmbeddingOffload, embedding_offload, table_names
from autoshard.runtime.offload.host import HostTier
from autoshard.runtime.offload.nvme import NvmeOffload, check_nvme, optimizer_offload
from autoshard.runtime.offload.optimizer import CHUNK_BYTES, OptimizerOffload, offloads_of

__all__ = [
    "CHUNK_BYTES",
    "ActivationOffload",
    "EmbeddingOffload",
    "HostTier",
    "NvmeOffload",
    "OffloadedBlock",
    "OptimizerOffload",
    "activation_offload",
    "check_nvme",
    "embedding_offload",
    "offloads_of",
    "optimizer_offload",
    "table_names",
]
