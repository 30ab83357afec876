"""The cost model: time of an op under a strategy, of a redistribution, and of a whole plan, and
the memory a plan needs per device (docs/search.md).

Redistributions are priced symbolically, per mesh axis, without the least-bytes planner: the
search prices hundreds of thousands of them, on meshes of hundreds of devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.fx as fx

from autoshard.cost.cluster import ClusterSpec
from autoshard.graph import OpGraph, node_info
from autoshard.layout import NOT_SPLIT, Layout
from autoshard.ops import Strategy, rule_for, tensor_inputs
from autoshard.redistribution import redistribution_plan

# -- redistribution -------------------------------------------------------------------------------


def _boundaries(layout: Layout) -> list[int]:
    out, acc = [1], 1
    for m in reversed(layout.mesh):
        acc *= m
        out.append(acc)
    return out


def _axis_states(layout: Layout) -> list[tuple[int, int, object]]:
    """(stride, size, state) per mesh axis: state is ("P",), ("S", dim) or ("R",)."""
    state: dict[int, object] = {a: ("R",) for a in range(len(layout.mesh))}
    for a in layout.partial:
        state[a] = ("P",)
    for d, factors in enumerate(layout.factors):
        for _, a in factors:
            if a != NOT_SPLIT:
                state[a] = ("S", d)
    out, stride = [], 1
    for a in reversed(range(len(layout.mesh))):
        out.append((stride, layout.mesh[a], state[a]))
        stride *= layout.mesh[a]
    return out


def _refine(layout: Layout, cuts: list[int]) -> list[tuple[int, int, object]]:
    """Each axis split into the sub-axes between consecutive cuts: (stride, size, state)."""
    out = []
    for stride, size, state in _axis_states(layout):
        inner = [c for c in cuts if stride <= c < stride * size]
        for lo, hi in zip(inner, inner[1:] + [stride * size], strict=True):
            out.append((lo, hi // lo, state))
    return out


def _group(axes: list[tuple[int, int]], cluster: ClusterSpec) -> tuple[int, bool]:
    """Size of the group over sub-axes ``(stride, size)`` and whether it spans nodes (rank 0's
    group stands for all: groups of a row-major mesh are translates of each other)."""
    size = math.prod(s for _, s in axes)
    reach = sum((s - 1) * stride for stride, s in axes)
    return size, reach >= cluster.devices_per_node


@dataclass(frozen=True)
class Transfer:
    """A priced redistribution: seconds and bytes sent per rank, and the collectives in order."""

    seconds: float
    bytes: float
    kinds: tuple[str, ...] = ()


_NONE = Transfer(0.0, 0.0)


def transition(src: Layout, dst: Layout, cluster: ClusterSpec) -> Transfer:
    """Price taking a tensor from ``src`` to ``dst`` (both on the same devices)."""
    if src == dst:
        return _NONE
    return _transition(src, dst, cluster)


@lru_cache(maxsize=1 << 18)
def _transition(src: Layout, dst: Layout, cluster: ClusterSpec) -> Transfer:
    n = src.num_devices
    if n != dst.num_devices or src.ranks != dst.ranks or src.ranks != tuple(range(n)):
        return _fallback(src, dst, cluster)
    cuts = sorted(set(_boundaries(src)) | set(_boundaries(dst)))
    if any(b % a for a, b in zip(cuts, cuts[1:], strict=False)):
        return _fallback(src, dst, cluster)
    cuts = cuts[:-1]
    pairs = list(zip(_refine(src, cuts), _refine(dst, cuts), strict=True))
    local = src.local_numel * src.dtype.itemsize
    seconds = sent = 0.0
    kinds = []

    def do(kind: str, axes: list[tuple[int, int]], nbytes: float) -> None:
        nonlocal seconds, sent
        if not axes:
            return
        g, crosses = _group(axes, cluster)
        seconds += cluster.collective_time(kind, nbytes, g, crosses)
        factor = 2 * (g - 1) / g if kind == "all_reduce" else (g - 1) / g
        sent += factor * nbytes
        kinds.append(kind)

    reduce = [(st, sz) for (st, sz, a), (_, _, b) in pairs if a == ("P",) and b == ("R",)]
    scatter = [(st, sz) for (st, sz, a), (_, _, b) in pairs if a == ("P",) and b[0] == "S"]
    do("all_reduce", reduce, local)
    if scatter:
        do("reduce_scatter", scatter, local)
        local /= math.prod(sz for _, sz in scatter)
    swap = [(st, sz) for (st, sz, a), (_, _, b) in pairs if a[0] == "S" and b[0] == "S" and a != b]
    do("all_to_all", swap, local)
    gather = [(st, sz) for (st, sz, a), (_, _, b) in pairs if a[0] == "S" and b[0] != "S"]
    if gather:
        local *= math.prod(sz for _, sz in gather)
        do("all_gather", gather, local)
    return Transfer(seconds, sent, tuple(kinds))


def grad_sync(partial: Layout, full: Layout, cluster: ClusterSpec) -> tuple[float, tuple | None]:
    """A parameter's gradient sum at the end of the backward. One all-reduce joins its group's
    flat all-reduce (``parallel.GradSync``): returned are its bandwidth term and the bucket's key,
    the bucket's latency being paid once (:func:`bucket_latency`). Anything else is priced whole,
    with key None."""
    t = transition(partial, full, cluster)
    if t.kinds != ("all_reduce",):
        return t.seconds, None
    key = (tuple(sorted(partial.partial)), partial.ranks, partial.dtype)
    return t.seconds - bucket_latency(partial, cluster), key


def bucket_latency(partial: Layout, cluster: ClusterSpec) -> float:
    """Latency of the all-reduce over ``partial``'s partial axes."""
    axes = [(st, sz) for st, sz, state in _axis_states(partial) if state == ("P",)]
    g, crosses = _group(axes, cluster)
    return cluster.collective_latency("all_reduce", g, crosses)


def _fallback(src: Layout, dst: Layout, cluster: ClusterSpec) -> Transfer:
    """Layouts on meshes with no common refinement: the least-bytes plan's bytes, priced as an
    all-to-all over all the devices."""
    nbytes = redistribution_plan(src, dst).bytes
    n = max(src.num_devices, dst.num_devices)
    crosses = n > cluster.devices_per_node
    bw, alpha = cluster.link(crosses)
    return Transfer(nbytes / bw + (n - 1) * alpha, float(nbytes), ("all_to_all",))


# -- ops ------------------------------------------------------------------------------------------


def op_time(node: fx.Node, strategy: Strategy, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one op on one device."""
    rule = rule_for(node)
    if rule.is_shape_op:
        return cluster.op_overhead, cluster.op_overhead if node_info(node).differentiable else 0.0
    cost = rule.cost(node, strategy)
    out = next((layout for layout in strategy.outs if layout is not None), None)
    dtype = out.dtype if out is not None else torch.float32
    fwd = cluster.compute_time(cost.flops, cost.bytes, dtype)
    k = node_info(node).backward_passes
    bwd = k * (fwd - cluster.op_overhead) + (cluster.op_overhead if k else 0.0)
    return fwd, bwd


def local_bytes(layout: Layout | None) -> int:
    return 0 if layout is None else layout.local_numel * layout.dtype.itemsize


def saves_output(node: fx.Node) -> bool:
    """Whether autograd keeps this op's output until backward (views alias their input)."""
    if node_info(node).kind != "op":
        return False
    return not rule_for(node).is_shape_op


def optimizer_time(layout: Layout, cluster: ClusterSpec) -> float:
    """One AdamW step on a parameter shard: about ten elementwise ops over it (torch.optim's
    per-parameter loop), ``optimizer_passes`` times its bytes of memory traffic in all."""
    traffic = cluster.optimizer_passes * local_bytes(layout)
    return 10 * cluster.op_overhead + traffic / cluster.memory_bandwidth


# -- plans ----------------------------------------------------------------------------------------

#: optimizer state values per parameter element (Adam's two moments)
ADAM_STATES = 2


@dataclass
class Estimate:
    """A plan's predicted step time (seconds) and memory per device (bytes), by kind."""

    compute_forward: float = 0.0
    compute_backward: float = 0.0
    comm_forward: float = 0.0
    comm_backward: float = 0.0
    grad_sync: float = 0.0
    bucket_latency: float = 0.0  # part of grad_sync: one latency per coalesced all-reduce
    optimizer: float = 0.0
    overlap: bool = False
    memory: dict[str, float] = field(
        default_factory=lambda: {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    )
    model_flops: float = 0.0
    num_devices: int = 1
    peak_flops: float = 1.0

    @property
    def compute(self) -> float:
        return self.compute_forward + self.compute_backward

    @property
    def comm(self) -> float:
        return self.comm_forward + self.comm_backward + self.grad_sync

    @property
    def step_time(self) -> float:
        hidden = min(self.grad_sync, self.compute_backward) if self.overlap else 0.0
        return self.compute + self.comm + self.optimizer - hidden

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.num_devices * self.peak_flops)

    def as_dict(self) -> dict[str, object]:
        return {
            "step_time_s": self.step_time,
            "compute_s": self.compute,
            "comm_s": self.comm,
            "grad_sync_s": self.grad_sync,
            "optimizer_s": self.optimizer,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory,
            "memory_bytes": dict(self.memory),
        }


def estimate(
    plan: Any, og: OpGraph, cluster: ClusterSpec, optimizer_states: int = ADAM_STATES
) -> Estimate:
    """Price a :class:`~autoshard.search.Plan` of ``og`` on ``cluster``."""
    graph_nodes = og.by_name
    est = Estimate(overlap=cluster.overlap, num_devices=plan.mesh.num_devices)
    dtypes = []
    for name, node_plan in plan.nodes.items():
        node = graph_nodes[name]
        strategy = node_plan.strategy
        fwd, bwd = op_time(node, strategy, cluster)
        est.compute_forward += fwd
        est.compute_backward += bwd
        est.model_flops += og[node].flops
        if saves_output(node):
            est.memory["activations"] += sum(local_bytes(o) for o in strategy.outs)
        args = tensor_inputs(node)
        for i, (src, dst) in node_plan.moves.items():
            est.comm_forward += transition(src, dst, cluster).seconds
            if og[args[i]].differentiable:
                back = transition(dst.without_partial(), src.without_partial(), cluster)
                est.comm_backward += back.seconds
        for i, (grad, want) in node_plan.grad_reduce.items():
            seconds = transition(grad, want, cluster).seconds
            if args[i].op == "placeholder":
                est.grad_sync += seconds
            else:
                est.comm_backward += seconds
        if strategy.outs and strategy.outs[0] is not None and og[node].flops:
            dtypes.append(strategy.outs[0].dtype)
    kinds = {i.fqn: i.kind if i.node.users else "unused" for i in og if i.node.op == "placeholder"}
    buckets: dict[tuple, float] = {}
    for fqn, param in plan.params.items():
        size = local_bytes(param.layout)
        if kinds.get(fqn) == "param":
            est.memory["params"] += size
            est.memory["grads"] += size
            est.memory["optimizer"] += optimizer_states * size
            est.optimizer += optimizer_time(param.layout, cluster)
            if param.grad_partial is not None:
                seconds, key = grad_sync(param.grad_partial, param.layout, cluster)
                est.grad_sync += seconds
                if key is not None and key not in buckets:
                    buckets[key] = bucket_latency(param.grad_partial, cluster)
        else:
            est.memory["params"] += size
    est.bucket_latency = sum(buckets.values())
    est.grad_sync += est.bucket_latency
    for layout in plan.inputs.values():
        est.memory["activations"] += local_bytes(layout)
    for src, dst in plan.outputs:
        est.comm_forward += transition(src, dst, cluster).seconds
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    est.peak_flops = cluster.peak_flops(dtype)
    return est


__all__ = ["Estimate", "Transfer", "estimate", "grad_sync", "op_time", "transition"]
