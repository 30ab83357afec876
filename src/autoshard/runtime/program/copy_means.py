"""The whole batch's statistics under copies (docs/parallelism/copies.md): a value that sums
or averages over the batch's rows and reaches only values without rows (a MoE router's
per-expert loads and mean probabilities, which its balance loss multiplies) is the mean of
the copies' values, each copy reading that mean (a loss that is a mean over counted
targets, inside a larger one, weighted by the copies' counts of them), so that what is
formed from it is the one device's over the whole batch and not each copy's over its rows.

Which ops those are is found by shape: the model captured at one copy's rows and at the
whole batch's, an op whose input changes with the rows while its output does not reduces
over them."""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.graph import OpGraph
from autoshard.runtime.program.counted_loss import CountedLoss

aten = torch.ops.aten
#: the reductions whose copies' values average into the whole batch's (equal rows a copy):
#: a sum over the rows later divided by the copy's count of them, a mean, a histogram
REDUCTIONS = {
    aten.sum.dim_IntList,
    aten.sum.default,
    aten.mean.dim,
    aten.mean.default,
    aten.histc.default,
}


def batch_means(copy: OpGraph, whole: OpGraph) -> frozenset[str]:
    """The names in ``copy`` (captured at one copy's rows) of the floating reductions over the
    batch's rows whose values reach no value with rows (``whole``: at the whole batch's): sums,
    means, histograms, and counted losses other than the one returned."""

    def rowless(node: fx.Node) -> bool:
        other = whole.by_name.get(node.name)
        return other is not None and copy[node].out_shapes == whole[other].out_shapes

    found = set()
    returned = CountedLoss.output_loss(copy)
    for node in copy.graph.nodes:
        if node.op != "call_function" or not rowless(node):
            continue
        if node.target not in REDUCTIONS and not (
            node is not returned and CountedLoss.of(copy, node) is not None
        ):  # the loss returned is weighed by its copies' counted targets already
            continue
        info, other = copy[node], whole[whole.by_name[node.name]]
        if info.in_shapes == other.in_shapes or not info.out_dtypes[0].is_floating_point:
            continue
        if all(rowless(n) for n in _after(node) if n.op != "output"):
            found.add(node.name)
    return frozenset(found)


def _after(node: fx.Node) -> list[fx.Node]:
    """Every node that reads ``node``'s value, directly or through others."""
    seen: dict[fx.Node, None] = {}
    stack = list(node.users)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen[n] = None
            stack += list(n.users)
    return list(seen)


__all__ = ["REDUCTIONS", "batch_means"]
