"""A predicted step, layer by layer: where its time, communication and memory go.

The rows add up to the estimate: each layer's ops (forward and backward compute, the
communication they wait for) and its parameters' memory and in-line gradient sums; then the
optimizer step, the overlapped communication the step still waits for, and what belongs to
no layer (the inputs, moves of the outputs, ZeRO's gathered units). A repeated block list is
one row (``layers.*``) whose values are one block's, with the number of blocks it stands for;
the totals count every block. The same step by kind of op (matrix products, attention, the
loss, norms, other elementwise ops, views) is :func:`kind_breakdown`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch.fx as fx

from autoshard.cost.collectives import PRODUCTS
from autoshard.cost.copies import CopiesEstimate
from autoshard.cost.estimate import Estimate, exposed
from autoshard.graph import OpGraph
from autoshard.ops import rule_for

#: the row of ops made by the root module itself (the loss, an add of two embeddings)
TOP = "(top level)"


@dataclass
class LayerCost:
    """One row: per block for a repeated block list, ``blocks`` of them in the step."""

    layer: str
    blocks: int = 1
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def layer_of(og: OpGraph, path: str) -> str:
    """The row a module path belongs to: a repeated block list's ``prefix.*``, else the
    module as deep as the block lists sit (``transformer.wte`` beside ``transformer.h.*``)."""
    for prefix in og.repeated:
        if re.match(rf"{re.escape(prefix)}\.\d+(\.|$)", path):
            return f"{prefix}.*"
    depth = min((p.count(".") + 1 for p in og.repeated), default=1)
    return ".".join(path.split(".")[:depth]) or TOP


def layer_breakdown(est: Estimate, og: OpGraph) -> list[LayerCost]:
    """The estimate's step as rows, in the order forward meets them, then the rest; the
    blocks' rows times their blocks plus the others sum to ``est.step_time`` and
    ``est.peak_memory``."""
    rows: dict[str, LayerCost] = {}
    runs: dict[str, int] = {}
    for node in og.graph.nodes:
        if node.name not in est.by_node:
            continue
        terms, count = est.by_node[node.name]
        layer = layer_of(og, og[node].path) if node.op != "placeholder" else TOP
        row = rows.setdefault(layer, LayerCost(layer))
        runs[layer] = max(runs.get(layer, 1), count)
        compute = terms.compute_forward + terms.compute_backward
        comm = terms.comm_forward + terms.comm_backward + terms.grad_sync
        row.compute_s += count * compute
        row.comm_s += count * comm
        row.memory_bytes += count * terms.memory["activations"]
    for fqn, (memory, in_line) in est.by_param.items():
        layer = layer_of(og, fqn.rpartition(".")[0])
        row = rows.setdefault(layer, LayerCost(layer))
        row.memory_bytes += memory
        row.comm_s += in_line
    return _per_block(rows, runs, og) + _rest(est, rows.values())


def _per_block(rows: dict[str, LayerCost], runs: dict[str, int], og: OpGraph) -> list[LayerCost]:
    """A repeated block list's row as one block's values and its number of blocks."""
    for layer, row in rows.items():
        if layer.endswith(".*"):
            captured = len(og.repeated[layer[:-2]])
            blocks = captured - 1 + runs.get(layer, 1)
            row.blocks = blocks
            row.compute_s /= blocks
            row.comm_s /= blocks
            row.memory_bytes /= blocks
    return list(rows.values())


def _rest(est: Estimate, rows: object) -> list[LayerCost]:
    """The optimizer step, the overlapped communication the step waits for, and what no
    layer owns, so that the rows add up to the estimate."""
    layers = list(rows)  # type: ignore[call-overload]
    time = sum(r.blocks * r.time_s for r in layers)
    memory = sum(r.blocks * r.memory_bytes for r in layers)
    waited = exposed(est.overlapped, est.overlap_efficiency)
    out = [
        LayerCost("optimizer step", compute_s=est.optimizer),
        LayerCost("overlapped communication, exposed", comm_s=waited),
    ]
    hidden = est.hidden_by_copies if isinstance(est, CopiesEstimate) else 0.0
    if hidden:  # the layers' rows count every copy's communication in line
        out.append(LayerCost("in-line communication hidden by copies", comm_s=-hidden))
    offload, moved = getattr(est, "offload_s", 0.0), getattr(est, "moved_off", 0.0)
    if offload or moved:  # the layers' rows count the state on the device, as without it
        out.append(LayerCost("offload: waited for, moved off", comm_s=offload, memory_bytes=-moved))
    other_time = est.step_time - time - est.optimizer - waited + hidden - offload
    other_memory = est.peak_memory - memory + moved
    other_time = 0.0 if abs(other_time) < 1e-9 * est.step_time else other_time  # rounding
    if abs(other_time) > 1e-12 * est.step_time or abs(other_memory) > 0.5:
        out.append(
            LayerCost(
                "other (inputs, output moves, ZeRO units)",
                comm_s=other_time,
                memory_bytes=other_memory,
            )
        )
    return out


@dataclass
class KindCost:
    """The ops of one kind in a step: how many run, their compute forward and backward, and
    the in-line communication they wait for (a tensor-parallel move before or after them,
    an in-line gradient sum), all runs counted."""

    kind: str
    ops: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_forward_s: float = 0.0
    comm_backward_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


#: the kinds of :func:`kind_breakdown`, in its order
KINDS = ("matrix products", "attention", "loss", "norms", "elementwise", "views", "inputs")


def op_kind(og: OpGraph, node: fx.Node) -> str:
    """Which of :data:`KINDS` a node's op is: the kinds of work the cost model prices apart
    (products and attention by their FLOPs, the rest by their bytes, views by their
    overhead alone)."""
    if node.op == "placeholder":
        return "inputs"
    op = str(og[node].op).split(".")[0]
    if op in PRODUCTS:
        return "matrix products"
    if "attention" in op:
        return "attention"
    if "loss" in op or "cross_entropy" in op:
        return "loss"
    if "norm" in op:
        return "norms"
    if og[node].kind != "op" or rule_for(node).is_shape_op:  # a tuple's item: a view too
        return "views"
    return "elementwise"


def kind_breakdown(est: Estimate, og: OpGraph) -> list[KindCost]:
    """The estimate's ops by kind (:data:`KINDS`): every run of every node counted, so the
    rows' compute adds up to ``est.compute`` and their communication to the in-line
    communication of the ops (what the parameters' own sums and the overlapped transfers add
    is :func:`layer_breakdown`'s other rows)."""
    rows = {kind: KindCost(kind) for kind in KINDS}
    for node in og.graph.nodes:
        if node.name not in est.by_node:
            continue
        terms, count = est.by_node[node.name]
        row = rows[op_kind(og, node)]
        row.ops += count
        row.forward_s += count * terms.compute_forward
        row.backward_s += count * terms.compute_backward
        row.comm_forward_s += count * terms.comm_forward
        row.comm_backward_s += count * (terms.comm_backward + terms.grad_sync)
    return [row for row in rows.values() if row.ops]


def breakdown_rows(est: Estimate, og: OpGraph) -> list[dict[str, object]]:
    """:func:`layer_breakdown` as the plan JSON's ``predicted.layers``."""
    return [row.as_dict() for row in layer_breakdown(est, og)]


__all__ = [
    "KINDS",
    "TOP",
    "KindCost",
    "LayerCost",
    "breakdown_rows",
    "kind_breakdown",
    "layer_breakdown",
    "layer_of",
    "op_kind",
]
