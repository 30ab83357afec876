"""The link model fitted to measured collectives, for ``autoshard calibrate`` on CPU ranks
and on CUDA devices alike: all-reduce's latency and bandwidth, and the other kinds' factors
over the time that link prices them at (docs/cost.md)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def fit_all_reduce(samples: Sequence[tuple[int, int, float]]) -> dict[str, float]:
    """Latency and bandwidth whose all-reduce formula ``2 ceil(log2 g) latency + 2 (g - 1) / g
    bytes / bandwidth`` fits the ``(group size, bytes, seconds)`` samples best in relative error
    (weighted least squares); a degenerate fit takes latency from the smallest message and
    bandwidth from the largest."""
    rows = [(2 * math.ceil(math.log2(g)) / t, 2 * (g - 1) / g * s / t) for g, s, t in samples]
    saa = sum(r[0] * r[0] for r in rows)
    sab = sum(r[0] * r[1] for r in rows)
    sbb = sum(r[1] * r[1] for r in rows)
    sa, sb = sum(r[0] for r in rows), sum(r[1] for r in rows)
    det = saa * sbb - sab * sab
    latency = (sa * sbb - sb * sab) / det if det else -1.0
    per_byte = (saa * sb - sab * sa) / det if det else -1.0
    if latency <= 0 or per_byte <= 0:
        g, s, t = min(samples, key=lambda x: x[1])
        latency = max(t / (2 * math.ceil(math.log2(g))), 1e-7)
        g, s, t = max(samples, key=lambda x: x[1])
        steps = math.ceil(math.log2(g))
        per_byte = max(t - 2 * steps * latency, 1e-9) / (2 * (g - 1) / g * s)
    return {"latency": latency, "bandwidth": 1 / per_byte}


def kind_factors(
    times: dict[str, list[float]],
    world: int,
    latency: float,
    bandwidth: float,
    sizes: Sequence[int],
) -> dict[str, float]:
    """Each kind's measured time over the link model's (median over ``sizes``, the bytes they
    were measured at), given the fitted all-reduce latency and bandwidth."""
    factors = {}
    for kind, seconds in times.items():
        share = (world - 1) / world
        model = [share * n / bandwidth + (world - 1) * latency for n in sizes]
        factors[kind] = statistics.median(t / m for t, m in zip(seconds, model, strict=True))
    return factors


__all__ = ["fit_all_reduce", "kind_factors"]
