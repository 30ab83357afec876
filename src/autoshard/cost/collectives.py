"""Collectives as the cost model prices them: a redistribution between two layouts priced as
the steps the least-bytes planner returns for it (the steps the runtime runs; both memoized per
pair), and each collective by the link its group uses (docs/cost.md).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.cost.cluster import ClusterSpec
from autoshard.graph import node_info
from autoshard.layout import Layout
from autoshard.memo import per_search
from autoshard.ops import rule_for, tensor_inputs
from autoshard.ops.regather import regathers
from autoshard.options import BUCKET_CAP_MB
from autoshard.redistribution import (
    RedistributionPlan,
    Step,
    StepCost,
    gradient_sum,
    replica_sum_groups,
    step_costs,
)


def _flat(kind: str, nbytes: float, g: int, crosses: bool, cluster: ClusterSpec) -> tuple:
    """(bandwidth term, latency term) of one collective over one kind of link. All-reduce
    pays a tree's latency (NCCL's tree and NVLS algorithms for latency-bound sizes), the
    others a ring's: one step per peer."""
    bw, alpha = cluster.link(crosses)
    factor = cluster.collective_factors.get(kind, 1.0)  # a backend slower than the model
    if kind == "all_reduce":
        return 2 * (g - 1) / g * nbytes / bw * factor, 2 * math.ceil(math.log2(g)) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (g - 1) / g * nbytes / bw * factor, (g - 1) * alpha * factor
    if kind == "send_recv":
        return nbytes / bw * factor, alpha
    raise ValueError(f"unknown collective {kind!r}")


def collective_parts(
    kind: str, nbytes: float, g: int, per_node: int, cluster: ClusterSpec
) -> tuple[float, float]:
    """(bandwidth term, latency term) of a collective of ``nbytes`` per rank (the input of an
    all-reduce, reduce-scatter or all-to-all, the output of an all-gather) over ``g`` ranks,
    ``per_node`` of them in each node. A group inside a node uses the intra-node link, one with
    a rank per node the network; one with several ranks in each of several nodes runs
    hierarchically, as NCCL does: inside the nodes, then across them on ``1/per_node`` of the
    data (each rank on its own network rail), then inside again."""
    if g <= 1:
        return 0.0, 0.0
    k = min(per_node, g)
    if k >= g or k <= 1:
        return _flat(kind, nbytes, g, k <= 1, cluster)
    n = g // k
    if kind == "all_reduce":
        steps = [("reduce_scatter", nbytes, k, False), ("all_reduce", nbytes / k, n, True)]
        steps.append(("all_gather", nbytes, k, False))
    elif kind == "reduce_scatter":
        steps = [("reduce_scatter", nbytes, k, False), ("reduce_scatter", nbytes / k, n, True)]
    elif kind == "all_gather":
        steps = [("all_gather", nbytes / k, n, True), ("all_gather", nbytes, k, False)]
    else:  # all-to-all: the share bound for other nodes crosses the network
        inside, _ = _flat(kind, nbytes * (k - 1) / (g - 1), g, False, cluster)
        outside, latency = _flat(kind, nbytes * (g - k) / (g - 1), g, True, cluster)
        return max(inside, outside), latency
    parts = [_flat(*step, cluster) for step in steps]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def collective_time(kind: str, nbytes: float, g: int, per_node: int, cluster: ClusterSpec) -> float:
    """Seconds of one collective (see :func:`collective_parts`)."""
    if nbytes <= 0:
        return 0.0
    return sum(collective_parts(kind, nbytes, g, per_node, cluster))


def exchange_times(node: Any, strategy: Any, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives an op runs itself (``OpRule.exchanges``),
    each over the links its group spans."""
    seconds = [0.0, 0.0]
    for ex in rule_for(node).exchanges(node, strategy):
        g, per_node = group_size(ex.group, cluster.devices_per_node)
        # the op's bytes are what a rank sends; the collective's own size, what it holds
        held = ex.bytes * g / (g - 1) if ex.kind == "all_to_all" and g > 1 else ex.bytes
        seconds[ex.backward] += collective_time(ex.kind, held * ex.skew, g, per_node, cluster)
    return seconds[0], seconds[1]


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


@per_search()
def _transition(src: Layout, dst: Layout, cluster: ClusterSpec) -> Transfer:
    # the plan's steps as pricing sees them (step_costs: the same plan, its layouts unmade)
    return _price_steps(step_costs(src, dst), cluster)


#: the ops that are matrix products (``NodeInfo.op`` before its call index)
PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "linear", "convolution", "matmul")


#: how many views and copies a product's output may pass through and still be its output
_PASSED_ON = 8
#: the ops that pass a value on unchanged: views and copies of the whole of it
_PASSING = ("view", "_unsafe_view", "reshape", "clone", "alias", "detach", "contiguous")


def is_product(node: Any) -> bool:
    """Whether ``node`` (an fx node) is a matrix product, or a product's output passed on
    unchanged through views and copies (a dropout that drops nothing is a copy): the
    software that overlaps a product with its output's reduce-scatter (Transformer Engine's
    ``--tp-comm-overlap``) does so whatever views the model puts between them."""
    for _ in range(_PASSED_ON):
        if node_info(node).op.split(".")[0] in PRODUCTS:
            return True
        ins = tensor_inputs(node)
        if len(ins) != 1 or node_info(node).op.split(".")[0] not in _PASSING:
            return False
        node = ins[0]
    return False


def move_time(src: Layout, dst: Layout, cluster: ClusterSpec, beside_product: bool) -> float:
    """Seconds of a move whose value a matrix product makes or reads (``beside_product``):
    where the cluster's software overlaps tensor-parallel communication with the products
    (``ClusterSpec.tp_comm_overlap``), an all-gather or reduce-scatter inside a node is split
    into one chunk a rank of its group, each sent while the product works on the one before
    (docs/cost.md): one chunk of the collective is left exposed."""
    if src == dst:
        return 0.0
    if not (beside_product and cluster.tp_comm_overlap):
        return _transition(src, dst, cluster).seconds
    return _chunked(src, dst, cluster)


@per_search()
def _chunked(src: Layout, dst: Layout, cluster: ClusterSpec) -> float:
    seconds, per_node = 0.0, cluster.devices_per_node
    for step in step_costs(src, dst):
        if step.kind in ("split", "to_partial") or not step.bytes:
            continue
        t = _step_seconds(step, per_node, cluster)
        inside = len({r // per_node for r in step.group}) == 1
        if step.kind in ("all_gather", "reduce_scatter") and inside and step.group:
            t /= len(step.group)
        seconds += t
    return seconds


def regathered(node: Any, decisions: Any) -> list[tuple[Layout, Layout]]:
    """The moves of ``node``'s inputs (``OpDecisions``) that its backward gathers again
    (``ops.regather``: sequence parallelism's column-split linears), each once: a move an
    earlier reader made is gathered again once for all its readers."""
    args = tensor_inputs(node)
    if len(args) < 2 or not node_info(args[1]).requires_grad:
        return []  # no weight gradient: nothing needs the input again
    return [
        (src, dst)
        for i, (src, dst) in decisions.moves.items()
        if i not in decisions.reuses and regathers(node, i, src, dst)
    ]


def gradient_transition(partial: Layout, full: Layout, cluster: ClusterSpec) -> Transfer:
    """Price summing a parameter's gradient from ``partial`` to ``full`` as the runtime does
    (``redistribution.gradient_sum``)."""
    if partial == full:
        return _NONE
    return _gradient_transition(partial, full, cluster)


@per_search()
def _gradient_transition(partial: Layout, full: Layout, cluster: ClusterSpec) -> Transfer:
    return price_plan(gradient_sum(partial, full), cluster)


def price_plan(plan: RedistributionPlan, cluster: ClusterSpec) -> Transfer:
    """Seconds and bytes per rank of a redistribution plan's steps, as they run."""
    return _price_steps(tuple(StepCost.of(step) for step in plan.steps), cluster)


def _price_steps(steps: tuple[StepCost, ...], cluster: ClusterSpec) -> Transfer:
    seconds = sent = 0.0
    kinds = []
    for step in steps:
        if step.kind in ("split", "to_partial") or not step.bytes:
            continue
        seconds += _step_seconds(step, cluster.devices_per_node, cluster)
        sent += step.bytes
        kinds.append(step.kind)
    return Transfer(seconds, sent, tuple(kinds))


def step_time(step: Step, devices_per_node: int, cluster: ClusterSpec) -> float:
    """Seconds of one redistribution step as the runtime runs it: its collective over its
    first group (the groups of one step are translates of each other), on the links that group
    spans. ``step.bytes`` are the ring formula's bytes sent per rank; the time takes the
    collective's own size (the input of an all-reduce, reduce-scatter or all-to-all, the output
    of an all-gather)."""
    return _step_seconds(StepCost.of(step), devices_per_node, cluster)


def _step_seconds(step: StepCost, devices_per_node: int, cluster: ClusterSpec) -> float:
    if step.kind in ("permute", "send_recv"):
        crosses = len({r // devices_per_node for r in step.group}) > 1
        bw, alpha = cluster.link(crosses)
        factor = cluster.collective_factors.get("send_recv", 1.0)
        return step.bytes / bw * factor + alpha
    group = step.group
    _, per_node = group_size(group, devices_per_node)
    nbytes = step.local_bytes * len(group) if step.kind == "all_gather" else step.local_bytes
    return collective_time(step.kind, nbytes, len(group), per_node, cluster)


def grad_sync(partial: Layout, full: Layout, cluster: ClusterSpec) -> tuple[float, float, tuple]:
    """A parameter's gradient sum once per backward: (communication, in-line copies, bucket
    key). One all-reduce (``replica_sum_groups``, the runtime's decision) joins a bucket of
    its groups' (``runtime.GradSync``): its bandwidth term, the hook's copy into the bucket
    (one pass over its bytes), and the bucket's key, the latency being the bucket's
    (:func:`bucket_latency`). Anything else runs in the hook: priced whole, in line, with key
    None."""
    t = gradient_transition(partial, full, cluster)
    groups = replica_sum_groups(partial, full)
    if groups is None:
        return 0.0, t.seconds, None
    key = (groups, partial.dtype)  # the runtime's bucket key, less the device
    copy = partial.local_numel * partial.dtype.itemsize / cluster.memory_bandwidth
    return t.seconds - bucket_latency(partial, cluster), copy, key


#: the first bucket of each group is smaller, so that communication starts early in backward
#: (DDP's 1 MiB)
FIRST_BUCKET_MB = 1.0


def assign_buckets(
    items: Sequence[tuple[Hashable, Hashable, float]], cap_bytes: float
) -> list[tuple[Hashable, list[Hashable]]]:
    """Gradient buckets as the runtime fills them: ``items`` are (name, key, bytes) in the
    order backward completes the gradients, the key naming the one all-reduce a gradient can
    join (its group and dtype). Each key fills its own bucket until it holds ``cap_bytes`` or
    more (its first bucket: :data:`FIRST_BUCKET_MB` or more, if that is less), then opens the
    next. Returns (key, names) per bucket, in the order they were opened."""
    filling: dict[Hashable, tuple[list[Hashable], list[float]]] = {}
    opened: set[Hashable] = set()
    out: list[tuple[Hashable, list[Hashable]]] = []
    for name, key, nbytes in items:
        if key not in filling:
            limit = cap_bytes if key in opened else min(cap_bytes, FIRST_BUCKET_MB * 2**20)
            filling[key] = ([], [0.0, limit])
            opened.add(key)
            out.append((key, filling[key][0]))
        names, size = filling[key]
        names.append(name)
        size[0] += nbytes
        if size[0] >= size[1]:
            del filling[key]
    return out


def group_size(group: Sequence[int], devices_per_node: int) -> tuple[int, int]:
    """(size, ranks per node) of ``group``, whose ranks fill their nodes alike."""
    node = group[0] // devices_per_node
    return len(group), sum(1 for r in group if r // devices_per_node == node)


def bucket_latency(partial: Layout, cluster: ClusterSpec) -> float:
    """Latency of the all-reduce over ``partial``'s partial axes."""
    groups = replica_sum_groups(partial, partial.without_partial())
    if groups is None:
        return 0.0
    g, per_node = group_size(groups[0], cluster.devices_per_node)
    return collective_parts("all_reduce", 1.0, g, per_node, cluster)[1]


__all__ = [
    "BUCKET_CAP_MB",
    "PRODUCTS",
    "FIRST_BUCKET_MB",
    "Transfer",
    "assign_buckets",
    "bucket_latency",
    "collective_parts",
    "collective_time",
    "exchange_times",
    "grad_sync",
    "gradient_transition",
    "group_size",
    "is_product",
    "move_time",
    "price_plan",
    "regathered",
    "transition",
]
