"""Compute as the cost model prices it: an op's forward and backward time on one device, the
bytes a layout holds, which outputs autograd keeps, and an optimizer step (docs/cost.md)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard.cost.cluster import ClusterSpec
from autoshard.graph import node_info
from autoshard.layout import Layout
from autoshard.ops import Strategy, rule_for, tensor_inputs


def op_time(node: fx.Node, strategy: Strategy, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one op on one device: its rule's work at the device's
    efficiency for that kind and size of work (``ClusterSpec.compute_time``), and in a parallel
    job the waits for the slowest rank that compute brings (``sync_wait``). A view costs the
    per-op overhead, in backward too when a gradient flows through it."""
    rule = rule_for(node)
    slowed = 1.0 + (cluster.sync_wait if _spans_devices(strategy) else 0.0)
    if rule.is_shape_op:
        backward = cluster.op_overhead if node_info(node).requires_grad else 0.0
        return cluster.op_overhead * slowed, backward * slowed
    needs = [node_info(a).requires_grad for a in tensor_inputs(node)]
    cost = rule.cost(node, strategy, needs)
    out = next((layout for layout in strategy.outs if layout is not None), None)
    dtype = out.dtype if out is not None else torch.float32
    forward = cluster.compute_time(cost, dtype)
    backward = cluster.compute_time(cost, dtype, backward=True) + _accumulation(node, out, cluster)
    return forward * slowed, backward * slowed


def _accumulation(node: fx.Node, out: Layout | None, cluster: ClusterSpec) -> float:
    """Autograd adds the gradients of a value read k times: k - 1 adds over its bytes (each
    reads two and writes one), before the op's own backward (a residual stream's every add)."""
    if out is None or not node_info(node).requires_grad:
        return 0.0
    reads = sum(1 for user in node.users for a in tensor_inputs(user) if a is node)
    if reads < 2:
        return 0.0
    nbytes = 3 * local_bytes(out)
    return (reads - 1) * (nbytes / cluster.memory_bandwidth + cluster.op_overhead)


def _spans_devices(strategy: Strategy) -> bool:
    """Whether the op runs in a job of more than one device, whose ranks wait for each other
    at the collectives that synchronize them (``ClusterSpec.sync_wait``)."""
    layouts = [*strategy.ins, *strategy.outs]
    return any(layout is not None and layout.num_devices > 1 for layout in layouts)


def local_bytes(layout: Layout | None) -> int:
    return 0 if layout is None else layout.local_numel * layout.dtype.itemsize


def saves_output(node: fx.Node) -> bool:
    """Whether autograd keeps this op's output until backward (views alias their input)."""
    if node_info(node).kind != "op":
        return False
    return not rule_for(node).is_shape_op


def saved_bytes(node: fx.Node, strategy: Strategy) -> float:
    """The bytes of activations ``node`` keeps for backward on a rank under ``strategy``: its
    outputs (``saves_output``) and the copies of its inputs that only it holds
    (``OpRule.held_inputs``: an attention's gathered keys and values). An output pending a
    sum (a row-split linear's) is not kept as it is: the collective that sums it consumes it;
    it counts as the share of the sum a rank ends with when it is reduce-scattered (a t-th
    under sequence parallelism, where every term of a layer is a t-th)."""
    held = float(rule_for(node).held_inputs(node, strategy)) if node_info(node).kind == "op" else 0
    if saves_output(node):
        held += sum(local_bytes(o) / _pending(o) for o in strategy.outs)
    return held


def _pending(layout: Layout | None) -> int:
    """How many ranks' values a local tensor in ``layout`` sums with (1: none)."""
    return 1 if layout is None else math.prod(layout.mesh[a] for a in layout.partial)


def input_time(layout: Layout, cluster: ClusterSpec) -> float:
    """Seconds a rank spends taking in its part of an input a step: its bytes written into
    device memory once (the least a copy from the data loader costs). A batch fed whole to
    every rank pays it on every rank, a split one only its part."""
    return local_bytes(layout) / cluster.memory_bandwidth


def optimizer_time(layout: Layout, cluster: ClusterSpec, share: float = 1.0) -> float:
    """One AdamW step on a parameter shard (``share`` of it under ZeRO): about ten elementwise
    ops over it (torch.optim's per-parameter loop), ``optimizer_passes`` times its bytes of
    memory traffic in all."""
    traffic = cluster.optimizer_passes * local_bytes(layout) * share
    return 10 * cluster.op_overhead + traffic / cluster.memory_bandwidth


__all__ = ["input_time", "local_bytes", "op_time", "optimizer_time", "saved_bytes", "saves_output"]
