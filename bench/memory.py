"""Peak bytes of tensor storage on CPU, counted the same way whatever library made the tensors.

CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so :class:`LiveBytes`
counts storages: a dispatch mode sees every tensor an operator returns (in forward, backward,
hooks, optimizers and collectives' outputs alike) and adds its storage's bytes the first time it
sees it; a weak reference subtracts them when the storage is freed, and ``resize_`` (FSDP2 frees
gathered parameters that way) is followed. Storages the mode never saw an operator make (the
reference model's, told with ``ignore``) count nothing, so build the measured thing inside it.
DTensor operators are left to DTensor, whose local operators the mode then sees.
"""

from autoshard.testing import LiveBytes

__all__ = ["LiveBytes"]
