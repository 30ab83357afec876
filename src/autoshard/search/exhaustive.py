"""Every combination of a small cost graph's options: the tests' reference for the solvers."""

from __future__ import annotations

import math

import numpy as np

from autoshard.search.costgraph import CostGraph
from autoshard.search.solvers import Solution


def brute_force(graph: CostGraph, memory_limit: float = math.inf, limit: int = 4_000_000):
    """Every combination of options (small graphs only): the reference for ``solve_optimal``."""
    sizes = [len(o) for o in graph.options]
    if math.prod(sizes) > limit:
        raise ValueError(f"{math.prod(sizes)} combinations: too many to enumerate")
    k = len(sizes)

    def along(i: int, v: np.ndarray) -> np.ndarray:
        shape = [1] * k
        shape[i] = len(v)
        return v.reshape(shape)

    total = np.full(sizes, graph.const_time)
    mem = np.full(sizes, graph.const_memory)
    bucketed, window = np.zeros(sizes), np.full(sizes, graph.const_window)
    for i in range(k):
        total = total + along(i, graph.unary[i])
        mem = mem + along(i, graph.memory[i])
        if graph.overlap:
            bucketed = bucketed + along(i, graph.overlap[i])
            window = window + along(i, graph.window[i])
    total = total - np.minimum(bucketed, window)
    for (i, j), m in graph.edges.items():
        shape = [1] * k
        shape[i], shape[j] = m.shape
        total = total + m.reshape(shape)
    total = np.where(mem <= memory_limit, total, np.inf)
    flat = int(np.argmin(total))
    if not np.isfinite(total.flat[flat]):
        return None
    choice = [int(c) for c in np.unravel_index(flat, sizes)]
    seconds, memory = graph.objective(choice)
    return Solution(choice, seconds, memory, "brute_force")


__all__ = ["brute_force"]
