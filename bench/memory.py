"""Peak bytes of tensor storage on CPU, counted the same way whatever library made the tensors.

CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so :class:`LiveBytes`
counts storages: a dispatch mode sees every tensor an operator returns (in forward, backward,
hooks, optimizers and collectives' outputs alike) and adds its storage's bytes the first time it
sees it; a weak reference subtracts them when the storage is freed, and ``resize_`` (FSDP2 frees
gathered parameters that way) is followed. Storages the mode never saw an operator make (the
reference model's, told with ``ignore``) count nothing, so build the measured thing inside it.
DTensor operators are left to DTensor, whose local operators the mode then sees.
"""

from collections.abc import Callable

import torch

from autoshard.testing import LiveBytes
from bench.timing import train_step


def step_peak(build: Callable[[], tuple], outside: list[torch.Tensor]) -> int:
    """The most storage alive on this rank in three steps after two warm-up ones of what
    ``build()`` makes (module, optimizer, inputs), ``outside``'s storages not counted
    (several steps: asynchronous collectives move the moment of the peak a little)."""
    import gc

    gc.collect()
    with LiveBytes() as count:
        count.ignore(*outside)
        state = build()
        for _ in range(2):
            train_step(*state)
        count.reset_peak()
        for _ in range(3):
            train_step(*state)
    return count.peak


__all__ = ["LiveBytes", "step_peak"]
