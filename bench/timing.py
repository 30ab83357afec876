"""What the benchmarks that compare with native PyTorch share: one step timed on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(step: Callable[[], None], times: list[float], keep: bool) -> None:
    """Run ``step`` after a barrier; append the slowest rank's seconds to ``times`` if ``keep``
    (warm-up steps are run and not kept)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if keep:
        times.append(float(elapsed))
