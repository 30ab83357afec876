"""An op's work: the matrix products it does (``Contraction``), what one rank's part of it
costs (``Cost``), and how big a product is for the device's efficiency (``product_size``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Contraction:
    """One matrix product inside an op: 2 FLOPs (a multiply-add) per point of ``dims``, the
    iteration dims it walks. Backward does one product of the same size per operand whose
    gradient is needed; ``operands`` lists, per operand, the op's tensor inputs it is made from
    (an attention's probabilities come from the query and the key)."""

    dims: tuple[int, ...]
    operands: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Cost:
    """One op's work on one rank. FLOPs are model FLOPs: the matrix products only, as torch's
    ``FlopCounterMode`` and the MFU formulas of Megatron-LM count them. ``kind`` ("matmul",
    "grouped_mm" for the experts' grouped product, "attention" for a fused attention kernel,
    "loss", or "memory") and ``size`` (a product's intensity size, ``3 / (1/M + 1/N +
    1/K)``) pick the device's efficiency; ``work`` is the share of the FLOPs the kernel really
    does (a causal attention kernel skips the masked half); ``scores``: an attention's score
    elements on the rank (batch x heads x query rows x keys), which an attention without a
    fused kernel writes and reads through memory; a loss's logit elements on the rank, which
    software computing it by separate passes reads and writes several times."""

    flops: float
    bytes: float
    backward_flops: float = 0.0
    backward_bytes: float = 0.0
    kind: str = "memory"
    size: float = 0.0
    work: float = 1.0
    scores: float = 0.0


@dataclass(frozen=True)
class Exchange:
    """A collective an op runs itself (the experts op's all-to-alls): its kind, one rank's
    group (the others are translates of it), the bytes each rank sends as ``comm`` counts
    them on average, whether it runs in backward, and ``skew``: the busiest rank's bytes over
    the average (every rank waits for it)."""

    kind: str
    group: tuple[int, ...]
    bytes: float
    backward: bool = False
    skew: float = 1.0


def product_size(space: Any, product: Contraction, sizes: Sequence[int]) -> float:
    """A matrix product's size as its arithmetic intensity sees it: ``3 / (1/M + 1/N + 1/K)``,
    the side of the cube with the FLOPs per byte moved of this product (an n-cube is n; a
    skinny product, 32 rows through a 256 x 1024 weight, is 83, not the 203 of its volume's
    cube root). Batch dims, in every operand, do not change it."""
    dims = set(product.dims)
    operands = [
        {d for i in inputs for d in space.ins[i] if d is not None} & dims
        for inputs in product.operands
    ]
    out = {d for d in space.outs[0] if d is not None} & dims if space.outs else set()
    if len(operands) != 2 or not out:
        return math.prod(sizes[d] for d in dims) ** (1 / 3)
    volume = math.prod(sizes[d] for d in dims)
    moved = sum(math.prod(sizes[d] for d in group) for group in (*operands, out))
    return 3 * volume / moved


__all__ = ["Contraction", "Cost", "Exchange", "product_size"]
