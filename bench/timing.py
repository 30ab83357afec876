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


def in_turns(
    steps: dict[str, Callable[[], None]], rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Time every step once a round, ``warmup`` rounds first and not kept; the order turns
    around every round (A B, B A, ...), so no way always runs right after the same other one.
    Returns each way's kept times (the slowest rank's seconds), round by round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(warmup + rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            timed(steps[name], times[name], i >= warmup)
    return times


def paired_ratio(ours: list[float], theirs: list[float], seed: int = 0) -> dict[str, float]:
    """The ratio of two ways timed in the same rounds: the median over rounds of each round's
    ratio (a slow stretch of the host falls on both sides of it), with the 95% interval of
    that median (percentile bootstrap over rounds, 2000 resamples, fixed seed)."""
    import random
    import statistics

    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {
        "median": statistics.median(ratios),
        "low": medians[int(0.025 * len(medians))],
        "high": medians[int(0.975 * len(medians)) - 1],
    }


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer every way of a comparison steps with."""
    return torch.optim.AdamW(m.parameters(), lr=1e-4)


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, inputs: tuple) -> float:
    """One training step of ``m``: forward, backward, the optimizer; the loss."""
    loss = m(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)
