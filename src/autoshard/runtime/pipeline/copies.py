"""Copies inside pipeline micro-batches (docs/parallelism/copies.md): each stage runs its
micro-batch as ``k`` interleaved copies (``program.copies.Interleaved``), so that one copy's
collectives inside the stage travel while another copy computes.

Between stages a micro-batch's value travels as its copies' local parts stacked on a new
first dim (``k`` first): the sending stage stacks what its copies made, the receiving stage
gives copy ``c`` the ``c``-th, whatever the value's own dims are (a batch dim, or none, as
rotary tables have). The last stage's loss is its copies' losses weighted by their shares
of the micro-batch's counted targets, so the micro-batch's loss is one device's. A statistic
of the micro-batch inside a stage (``copy_means``: a router's per-expert loads) is the copies'
mean there, as one device computes it over the micro-batch's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoshard.runtime.program import (
    CountedLoss,
    combine,
    interleaved_program,
    local_input,
    whole_copies,
)


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


def inner_shares(pm: Any, whole: Sequence[Sequence[Any]], mode: bool) -> list[dict]:
    """Per micro-batch, each counted loss inside the loss (``copy_means``) with its copies'
    shares of that micro-batch's counted targets (``whole``: each copy's whole inputs,
    micro-batch by micro-batch)."""
    k, found = pm.options.copies, pm._inner_counted
    if mode not in found:  # found once a module and mode
        captured, means = pm.captured[mode], pm.copy_means if mode else frozenset()
        found[mode] = {n: CountedLoss.of(captured, captured.by_name[n]) for n in sorted(means)}
    inner = found[mode]
    shares: list[dict] = [{} for _ in range(len(whole) // k)]
    for name, counted in inner.items():
        for i, part in enumerate(shares):
            if counted is not None:
                part[name] = counted.weights(whole[i * k : (i + 1) * k]) or [1 / k] * k
    return shares


def run_stage(step: Any, s: int, i: int, leaves: Sequence[torch.Tensor]) -> tuple:
    """Stage ``s`` on micro-batch ``i`` as its copies interleaved: each copy reads its part of
    what the stage received; the outputs sent on are the copies' stacked, the last stage's
    the copies' combined (a loss weighted by the copies' shares)."""
    pm, k = step.pm, step.pm.options.copies
    inputs = [[*step.inputs[i][c], *(leaf[c] for leaf in leaves)] for c in range(k)]
    means = pm.copy_means if step.mode else frozenset()
    interleaved = interleaved_program(step.programs[s], pm.rank, means)
    with pm.zero_units.saving():
        results = interleaved(inputs, pm._inner_shares[i])
    if s == step.last:
        return tuple(combine(results, pm._copy_shares[i]))
    return tuple(torch.stack(values) for values in zip(*results, strict=True))


__all__ = ["copy_shares", "inner_shares", "run_stage", "split_copies"]
