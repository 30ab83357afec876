"""Copies inside pipeline micro-batches (docs/parallelism/copies.md): each stage runs its
micro-batch as ``k`` interleaved copies (``program.copies.Interleaved``), so that one copy's
collectives inside the stage travel while another copy computes.

Between stages a micro-batch's value travels as its copies' local parts stacked on a new
first dim (``k`` first): the sending stage stacks what its copies made, the receiving stage
gives copy ``c`` the ``c``-th, whatever the value's own dims are (a batch dim, or none, as
rotary tables have). The last stage's loss is its copies' losses weighted by their shares
of the micro-batch's counted targets, so the micro-batch's loss is one device's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoshard.runtime.program import combine, interleaved_program, local_input, whole_copies


def split_copies(
    pm: Any, chunks: Sequence[Sequence[Any]], mode: bool, cast: bool
) -> tuple[list[list[list[Any]]], list[list[Any]]]:
    """Each micro-batch's copies' local inputs (``chunks``: each micro-batch's whole inputs)
    and each copy's whole inputs (what counts its targets), micro-batch by micro-batch."""
    captured, plan, k = pm.captured[mode], pm.plans[mode], pm.options.copies
    local: list[list[list[Any]]] = []
    whole: list[list[Any]] = []
    for inputs in chunks:
        rows = [
            whole_copies(x, plan.inputs[n], k, pm.rank) if isinstance(x, torch.Tensor) else [x] * k
            for x, n in zip(inputs, captured.inputs, strict=True)
        ]
        copies = [[r[c] for r in rows] for c in range(k)]
        whole += copies
        local.append(
            [
                [
                    local_input(x, plan.inputs[n], pm.rank, n, cast, pm.device)
                    for x, n in zip(xs, captured.inputs, strict=True)
                ]
                for xs in copies
            ]
        )
    return local, whole


def copy_shares(weights: Sequence[float] | None, m: int, k: int) -> tuple[list, list]:
    """From each copy's share of the whole batch's counted targets (None: equal shares),
    each micro-batch's share and each copy's share of its micro-batch."""
    weights = list(weights) if weights else [1 / (m * k)] * (m * k)
    shares = [sum(weights[i * k : (i + 1) * k]) for i in range(m)]
    within = [
        [w / shares[i] if shares[i] else 1 / k for w in weights[i * k : (i + 1) * k]]
        for i in range(m)
    ]
    return shares, within


def run_stage(step: Any, s: int, i: int, leaves: Sequence[torch.Tensor]) -> tuple:
    """Stage ``s`` on micro-batch ``i`` as its copies interleaved: each copy reads its part of
    what the stage received; the outputs sent on are the copies' stacked, the last stage's
    the copies' combined (a loss weighted by the copies' shares)."""
    pm, k = step.pm, step.pm.options.copies
    inputs = [[*step.inputs[i][c], *(leaf[c] for leaf in leaves)] for c in range(k)]
    interleaved = interleaved_program(step.programs[s], pm.rank)
    with pm.zero_units.saving():
        results = interleaved(inputs)
    if s == step.last:
        return tuple(combine(results, pm._copy_shares[i]))
    return tuple(torch.stack(values) for values in zip(*results, strict=True))


__all__ = ["copy_shares", "run_stage", "split_copies"]
