"""Pricing for the cost graph: what a decision node and the ops that follow it cost under one
option, what moving a value between two layouts costs, and gradient sums (docs/search.md).

The caches here are the search's own (``search.state``), keyed by graph node or by layouts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch.fx as fx

from autoshard.cost import ClusterSpec, grad_sync, transition
from autoshard.cost.collectives import exchange_times, is_product, move_time
from autoshard.cost.compute import (
    input_time,
    local_bytes,
    op_time,
    optimizer_time,
    saved_bytes,
)
from autoshard.cost.offload import device_bytes, host_parts
from autoshard.cost.zero import ZeroParam, master_layout, sum_dtype, zero_param
from autoshard.graph import node_info
from autoshard.layout import Layout
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy, rule_for, tensor_inputs
from autoshard.precision import Precision
from autoshard.redistribution import backward_source
from autoshard.search.options import options
from autoshard.search.state import cache, search_session, state


def edge_row(
    value: fx.Node, layout: Layout, user: fx.Node, i: int, mesh: MeshInfo, cluster: ClusterSpec
) -> np.ndarray:
    """Seconds of moving ``value`` in ``layout`` to what each option of ``user`` wants. A
    move's backward also sums the option's partial gradient (``backward_plan``): what summing
    it alone costs, which the option's own price holds (``CostGraph.own_inputs``), is taken
    off where there is a move to do it. A row is priced once for every reader whose options
    want the same layouts (each block of a repeated list, a block's q, k and v)."""
    rows_cache = cache("rows")
    backward = node_info(value).requires_grad
    wants, where = _wants(user, i, mesh)
    beside = is_product(user) or is_product(value)
    key = (layout, wants, backward, beside, id(cluster))
    row = rows_cache.get(key)
    if row is None:
        row = rows_cache[key] = np.array(
            [
                move_cost(layout, w, backward, cluster, g, beside)
                - (
                    transition(g, w.without_partial(), cluster).seconds
                    if backward and g is not None and layout != w
                    else 0.0
                )
                for w, g in wants
            ]
        )
    return row[where]


def _wants(
    user: fx.Node, i: int, mesh: MeshInfo
) -> tuple[tuple[tuple[Layout, Layout | None], ...], np.ndarray]:
    """The distinct (layout, partial gradient or None) ``user``'s options want for input ``i``,
    and which each wants."""
    wants_cache = cache("wants")
    key = (user, i, mesh)
    found = wants_cache.get(key)
    if found is None:
        index: dict[tuple[Layout, Layout | None], int] = {}
        wants = [(o.strategy.ins[i], o.strategy.grads[i]) for o in options(user, mesh)]
        where = [index.setdefault((w, pending_sum(w, g)), len(index)) for w, g in wants]
        found = wants_cache[key] = (tuple(index), np.array(where, dtype=np.intp))
    return found


def pending_sum(want: Layout, grad: Layout) -> Layout | None:
    """The reader's gradient when it leaves sums pending (what a move's backward sums with it,
    ``backward_plan``), or None."""
    return None if grad == want.without_partial() else grad


@contextmanager
def priced_under(precision: Precision | None, offload: Any = None) -> Iterator[None]:
    """Parameters priced as a run under ``precision`` keeps them (master weights, their
    gradients and optimizer state in the master dtype, the graph's compute-dtype cast of each
    kept for backward, gradient sums in the reduce dtype), their device bytes and update as
    ``offload`` (``cost.offload.Offload``) leaves them."""
    with search_session() as searching:
        kept = searching.precision, searching.offload
        searching.precision, searching.offload = precision, offload
        try:
            yield
        finally:
            searching.precision, searching.offload = kept


def _kept(layout: Layout) -> Layout:
    return master_layout(layout, state().precision)


def zero_terms(
    p: fx.Node,
    layout: Layout,
    grad: Layout,
    zero: int,
    optimizer_states: int,
    cluster: ClusterSpec,
) -> ZeroParam | None:
    """What parameter ``p`` stored as ``layout`` costs under ZeRO stage ``zero`` (None: ZeRO
    leaves it alone, as the runtime does)."""
    zero_cache = cache("zero")
    info = node_info(p)
    if zero == 0 or info.kind != "param" or not info.requires_grad:
        return None
    precision = state().precision
    key = (layout, grad, zero, optimizer_states, id(cluster), precision)
    if key not in zero_cache:
        compute = layout.dtype if sum_dtype(precision) else None
        zero_cache[key] = zero_param(
            zero, _kept(layout), grad, cluster, optimizer_states, compute, sum_dtype(precision)
        )
    return zero_cache[key]


def param_bytes(
    p: fx.Node, layout: Layout, optimizer_states: int, zp: ZeroParam | None = None
) -> float:
    if node_info(p).kind != "param":
        return local_bytes(layout)
    offload = state().offload
    if zp is not None:
        return device_bytes(zp.memory, zp.stage, offload) if offload else sum(zp.memory.values())
    kept = _kept(layout)  # with the cast of it a mixed policy's program keeps for backward
    cast = local_bytes(layout) if kept != layout else 0.0
    size = local_bytes(kept)
    if offload and node_info(p).requires_grad:
        kinds = {"parameters": size, "gradients": size, "optimizer": optimizer_states * size}
        return device_bytes(kinds, 0, offload) + cast
    return size * (2 + optimizer_states) + cast


def param_time(
    p: fx.Node, layout: Layout, cluster: ClusterSpec, zp: ZeroParam | None = None
) -> float:
    if node_info(p).kind != "param":
        return 0.0
    kept, share = _kept(layout), zp.share if zp is not None else 1.0
    offload = state().offload
    host = 0.0
    if offload and offload.optimizer and node_info(p).requires_grad:
        host = host_parts(kept.local_numel * share, kept.dtype.itemsize, offload.optimizer, cluster)
    return optimizer_time(kept, cluster, share) + host


def move(
    value: fx.Node,
    src: Layout,
    want: Layout,
    cluster: ClusterSpec,
    grad: Layout | None = None,
    reader: fx.Node | None = None,
) -> float:
    """Forward redistribution and, for a value that needs a gradient, its mirror in backward
    (which sums ``grad``, the reader's partial gradient, when given); ``reader``: the op that
    reads it (a matrix product beside the move may hide it: ``move_time``)."""
    if src == want:
        return 0.0
    beside = reader is not None and (is_product(reader) or is_product(value))
    return move_cost(src, want, node_info(value).requires_grad, cluster, grad, beside)


def move_cost(
    src: Layout,
    want: Layout,
    backward: bool,
    cluster: ClusterSpec,
    grad: Layout | None = None,
    beside: bool = False,
) -> float:
    moves_cache = cache("moves")
    if src == want:
        return 0.0
    key = (src, want, backward, grad, id(cluster), beside)
    seconds = moves_cache.get(key)
    if seconds is None:
        seconds = move_time(src, want, cluster, beside)
        if backward:
            back = backward_source(want, grad)
            seconds += move_time(back, src.without_partial(), cluster, beside)
        moves_cache[key] = seconds
    return seconds


def grad_reduce_parts(
    arg: fx.Node,
    grad: Layout,
    want: Layout,
    cluster: ClusterSpec,
    zp: ZeroParam | None = None,
    leading: bool = False,
) -> tuple[float, float]:
    """(in line, bucketed) seconds of ``arg``'s gradient sum: a parameter's all-reduce joins
    a bucket that runs beside backward (its bandwidth term; the hook's copy is in line, the
    bucket's latency left out), as does the sum of a value made from parameters alone, which
    the plan makes at its parameter; anything else runs in line. Under ZeRO (``zp``) the unit's
    collectives take the bucket's place. A ``leading`` parameter's (``OpGraph.leading``) is
    ready when backward ends: all of it counts as in line."""
    in_line, bucketed = _grad_reduce_parts(arg, grad, want, cluster, zp)
    return (in_line + bucketed, 0.0) if leading else (in_line, bucketed)


def _grad_reduce_parts(
    arg: fx.Node, grad: Layout, want: Layout, cluster: ClusterSpec, zp: ZeroParam | None
) -> tuple[float, float]:
    parts_cache = cache("parts")
    info = node_info(arg)
    if not info.requires_grad:
        return 0.0, 0.0
    if zp is not None:
        return zp.copy, zp.bandwidth(cluster)
    param = info.from_state
    key = (grad, want, "param grad" if param else "grad", id(cluster))
    parts = parts_cache.get(key)
    if parts is None:
        whole = want.without_partial()
        if grad == whole:
            parts = (0.0, 0.0)
        elif param:
            summed = sum_dtype(state().precision)
            if summed is not None:  # summed as a run sums it under the policy
                grad, whole = grad.with_dtype(summed), whole.with_dtype(summed)
            bucketed, in_line, _ = grad_sync(grad, whole, cluster)
            parts = (in_line, bucketed)
        else:
            parts = (transition(grad, whole, cluster).seconds, 0.0)
        parts_cache[key] = parts
    return parts


def own_exchanges(node: fx.Node, strategy: Strategy, cluster: ClusterSpec) -> float:
    """Seconds of the collectives the op runs itself, as ``estimate`` prices them."""
    fwd, bwd = exchange_times(node, strategy, cluster)
    return fwd + (bwd if node_info(node).requires_grad else 0.0)


def replicated(node: fx.Node, mesh: MeshInfo) -> Strategy:
    ins = [None for _ in tensor_inputs(node)]
    return rule_for(node).follow(node, ins, mesh)


def weight_layouts(
    graph: fx.Graph, weight: set[fx.Node], mesh: MeshInfo
) -> tuple[dict[fx.Node, Layout], dict[fx.Node, fx.Node]]:
    """Layouts of weight-like values (as the planner's walk gives them) and each parameter's
    first consumer, which decides its stored layout."""
    layouts: dict[fx.Node, Layout] = {}
    all_outs: dict[fx.Node, tuple] = {}
    owner: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for a in tensor_inputs(node):
            if node_info(a).is_state:
                owner.setdefault(a, node)
        if node not in weight:
            continue
        if node_info(node).kind == "getitem":
            outs = all_outs.get(node.args[0], ())
            if node.args[1] < len(outs) and outs[node.args[1]] is not None:
                layouts[node] = outs[node.args[1]]
            continue
        args = tensor_inputs(node)
        ins = [layouts.get(a) for a in args]
        strategy = rule_for(node).follow(node, ins, mesh)
        for a, want in zip(args, strategy.ins, strict=True):
            if a.op == "placeholder" and a not in layouts and owner.get(a) is node:
                layouts[a] = want.without_partial()
        all_outs[node] = strategy.outs
        if strategy.outs and strategy.outs[0] is not None:
            layouts[node] = strategy.outs[0]
    return layouts, owner


class ParamUse(NamedTuple):
    """A parameter a region owns: stored as ``whole``, with the gradient ``grad`` its
    reader's option gives it and the layout ``want`` it reads: what pricing its terms at a
    ZeRO stage needs (``params.ParamTerms``)."""

    param: fx.Node
    whole: Layout
    grad: Layout
    want: Layout


class Priced(NamedTuple):
    """A region's price under one option (``Region.price``)."""

    seconds: float
    memory: float
    values: dict[fx.Node, Layout]
    overlap: tuple[float, float]  # (bucketed gradient sums, backward compute)
    params: tuple[ParamUse, ...]


class Region:
    """Prices a decision node with the ops that follow it (its region) under one option."""

    def __init__(
        self,
        followers: dict[fx.Node, list[fx.Node]],
        const_layout: dict[fx.Node, Layout],
        owner: dict[fx.Node, fx.Node],
        mesh: MeshInfo,
        cluster: ClusterSpec,
        outputs: set[fx.Node],
    ) -> None:
        self.followers, self.const_layout, self.owner = followers, const_layout, owner
        self.leading: set[fx.Node] = set()  # OpGraph.leading and values made from it alone
        self.mesh, self.cluster, self.outputs = mesh, cluster, outputs

    def price(self, node: fx.Node, strategy: Strategy) -> Priced:
        """Seconds and bytes of the region under one option of ``node``, the layouts of every
        value it produces (not to be changed: shared), (the bucketed gradient sums among
        those seconds, its backward compute): what the overlap term of the objective needs;
        and the parameters it owns, whose terms are priced apart (``params.ParamTerms``: all
        else is the same at every ZeRO stage). Kept for the search's other graphs of the mesh."""
        prices_cache = cache("prices")
        key = (node, id(strategy), self.mesh, id(self.cluster))
        kept = prices_cache.get(key)  # (its strategy, kept alive while its id keys this)
        if kept is not None:
            return kept[1]
        priced = self._price(node, strategy)
        prices_cache[key] = (strategy, priced)
        return priced

    def _price(self, node: fx.Node, strategy: Strategy) -> Priced:
        values: dict[fx.Node, Layout] = {}
        params: list[ParamUse] = []
        seconds = memory = bucketed = backward = 0.0
        if node.op == "placeholder":
            values[node] = strategy.outs[0]
            memory += local_bytes(strategy.outs[0])
            seconds += input_time(strategy.outs[0], self.cluster)
        else:
            fwd, bwd = op_time(node, strategy, self.cluster)
            seconds, backward = seconds + fwd + bwd, backward + bwd
            seconds += own_exchanges(node, strategy, self.cluster)
            memory += saved_bytes(node, strategy)
            _set_outputs(node, strategy, values)
        for f in self.followers[node]:
            if node_info(f).kind == "getitem":
                continue  # its layout came with its producer's outputs
            f_seconds, f_memory, (f_bucketed, f_backward) = self._follower(f, values, params)
            seconds, memory = seconds + f_seconds, memory + f_memory
            bucketed, backward = bucketed + f_bucketed, backward + f_backward
        for value in self.outputs & set(values):
            src = values[value]
            whole = Layout.replicated(src.shape, self.mesh.num_devices, dtype=src.dtype)
            seconds += transition(src, whole, self.cluster).seconds
        return Priced(seconds, memory, values, (bucketed, backward), tuple(params))

    def _follower(
        self, f: fx.Node, values: dict[fx.Node, Layout], params: list[ParamUse]
    ) -> tuple[float, float, tuple[float, float]]:
        """A follower follows its inputs' layouts; the parameters it owns take what it wants
        (added to ``params``)."""
        args = tensor_inputs(f)
        ins: list[Layout | None] = []
        for a in args:
            if a in values:
                ins.append(values[a])
            elif a.op == "placeholder" and self.owner.get(a) is f:
                ins.append(None)
            else:
                ins.append(self.const_layout.get(a))
        strategy = follow(f, ins, self.mesh)
        fwd, bwd = op_time(f, strategy, self.cluster)
        seconds, memory, bucketed = fwd + bwd, 0.0, 0.0
        seconds += own_exchanges(f, strategy, self.cluster)
        for a, have, want, grad in zip(args, ins, strategy.ins, strategy.grads, strict=True):
            if have is None:
                if a.op == "placeholder":
                    values[a] = want.without_partial()
                    params.append(ParamUse(a, values[a], grad, want))
                continue
            if have != want:  # the move's backward sums the gradient too (backward_plan)
                seconds += move(a, have, want, self.cluster, pending_sum(want, grad), f)
                continue
            in_line, in_bucket = grad_reduce_parts(
                a, grad, want, self.cluster, leading=a in self.leading
            )
            seconds, bucketed = seconds + in_line + in_bucket, bucketed + in_bucket
        memory += saved_bytes(f, strategy)
        _set_outputs(f, strategy, values)
        return seconds, memory, (bucketed, bwd)

    def stored_layout(
        self, p: fx.Node, own: fx.Node, own_src: fx.Node, strategy: Strategy
    ) -> tuple[Layout, Layout]:
        """The layout a shared parameter is stored in under its owner's source's option, and
        the layout of its gradient from the owner."""
        if own is own_src:
            i = tensor_inputs(own).index(p)
            return strategy.ins[i].without_partial(), strategy.grads[i]
        values = self.price(own_src, strategy).values
        args = tensor_inputs(own)
        ins = [None if a is p else values.get(a, self.const_layout.get(a)) for a in args]
        return values[p], follow(own, ins, self.mesh).grads[args.index(p)]


def follow(node: fx.Node, ins: list[Layout | None], mesh: MeshInfo) -> Strategy:
    """``rule.follow``, shared by every node with the same op, arguments and input layouts."""
    follows_cache = cache("follows")
    key = (node_info(node).signature, tuple(ins), mesh)
    found = follows_cache.get(key)
    if found is None:
        found = follows_cache[key] = rule_for(node).follow(node, ins, mesh)
    return found


def _set_outputs(node: fx.Node, strategy: Strategy, values: dict[fx.Node, Layout]) -> None:
    if strategy.outs and strategy.outs[0] is not None:
        values[node] = strategy.outs[0]
    for user in node.users:
        if node_info(user).kind == "getitem":
            k = user.args[1]
            if k < len(strategy.outs) and strategy.outs[k] is not None:
                values[user] = strategy.outs[k]


def tied_grads(
    p: fx.Node, stored: Layout, own_grad: Layout, want: Layout, grad: Layout, cluster: ClusterSpec
) -> float:
    """Gradient sums of a parameter's second use beyond what its owner's term priced (one
    coalesced sum of the owner's gradient). As the planner does: when neither use moves the
    parameter and both gradients need the same sum, one deferred sum serves both; otherwise each
    use that needs a sum does its own, alone and in line: the least-bytes plan the lowered
    ``ReduceGrad`` runs and ``estimate`` prices, not the bucket's one all-reduce."""
    if not node_info(p).requires_grad or node_info(p).kind != "param":
        return 0.0
    own_needs = own_grad != stored
    needs = grad != want.without_partial()
    if own_needs and needs and want == stored and grad == own_grad:
        return 0.0
    seconds = transition(grad, want.without_partial(), cluster).seconds if needs else 0.0
    if own_needs:
        seconds += transition(own_grad, stored, cluster).seconds
        seconds -= sum(grad_reduce_parts(p, own_grad, stored, cluster))  # in line or bucketed
    return seconds


__all__ = [
    "ParamUse",
    "Priced",
    "Region",
    "priced_under",
    "zero_terms",
    "edge_row",
    "follow",
    "grad_reduce_parts",
    "move",
    "move_cost",
    "param_bytes",
    "param_time",
    "replicated",
    "tied_grads",
    "weight_layouts",
]
