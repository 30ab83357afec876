"""Automatic strategy search over the cost model (docs/search.md).

``build_cost_graph`` turns a captured graph and a mesh into decision nodes with per-strategy
costs and per-edge cost matrices; ``solve_optimal`` (an integer program), ``solve_recursive`` and
``solve_propagate`` pick one strategy per decision node; ``search`` does that for every mesh shape
and keeps the fastest plan that fits in memory.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.model import (
    ADAM_STATES,
    differentiable,
    grad_sync,
    local_bytes,
    model_flops,
    op_time,
    optimizer_time,
    saves_output,
    transition,
)
from autoshard.graph.capture import Captured, module_path
from autoshard.layout import Layout, LayoutError
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy, StrategyError, rule_for, tensor_inputs
from autoshard.ops.base import FIXED, SUM, SpaceRule, shape_of

SEARCHES = ("optimal", "recursive", "propagate")


class PlanningError(ValueError):
    """No plan fits: names the smallest peak memory found and what would make one fit."""


# -- classification -------------------------------------------------------------------------------


def _kind(node: fx.Node) -> str | None:
    return node.meta.get("autoshard_kind") if node.op == "placeholder" else None


def _classify(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """(weight-like nodes, decision nodes). Weight-like: parameters, buffers and whatever is
    computed from them alone; decision: inputs and the ops docs/search.md lists."""
    weight: set[fx.Node] = set()
    decision: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            (decision if _kind(node) == "input" else weight).add(node)
            continue
        if node.op != "call_function":
            continue
        args = tensor_inputs(node)
        if all(a in weight for a in args):
            weight.add(node)
            continue
        if node.target is operator.getitem:
            continue
        rule = rule_for(node)
        if not isinstance(rule, SpaceRule):
            continue
        acts = {a for a in args if a not in weight}
        space = rule.space(node)
        contracts = SUM in space.kinds
        reads_matrix = any(a in weight and len(shape_of(a)) >= 2 for a in args)
        if contracts or reads_matrix or len(acts) >= 2:
            decision.add(node)
    return weight, decision


def _sources(graph: fx.Graph, weight: set[fx.Node], decision: set[fx.Node]) -> dict:
    """The decision node each follower's activations come from; a follower fed by two is
    promoted to a decision node when its rule has a space, else it is an error."""
    source: dict[fx.Node, fx.Node] = {n: n for n in decision if n.op == "placeholder"}
    for node in graph.nodes:
        if node.op != "call_function" or node in weight:
            continue
        if node in decision:
            source[node] = node
            continue
        found = {source[a] for a in tensor_inputs(node) if a not in weight}
        if len(found) == 1:
            source[node] = found.pop()
        elif node.target is operator.getitem:
            raise AssertionError(f"{node.name} reads no decision node")
        elif isinstance(rule_for(node), SpaceRule):
            decision.add(node)
            source[node] = node
        else:
            names = ", ".join(sorted(f.name for f in found))
            raise PlanningError(
                f"{node.name} ({node.target}) combines activations of {names} but has no "
                f"iteration space; the search cannot price it"
            )
    return source


# -- strategies -----------------------------------------------------------------------------------


@dataclass
class Option:
    """One strategy of a decision node: the axis -> iteration dim assignment it came from."""

    assign: tuple[int | None, ...]
    spec: tuple[Any, ...]
    strategy: Strategy


def _spec(assign: Sequence[int | None], axes: Sequence[str], ndims: int) -> tuple[Any, ...]:
    entries: list[list[str]] = [[] for _ in range(ndims)]
    for axis, d in zip(axes, assign, strict=True):
        if d is not None:
            entries[d].append(axis)
    return tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)


def _assignments(sizes: Sequence[int], allowed: Sequence[int], mesh: MeshInfo):
    axes = [(n, s) for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1]
    choices = [None, *allowed]
    for assign in itertools.product(choices, repeat=len(axes)):
        per_dim: dict[int, int] = defaultdict(lambda: 1)
        for (_, s), d in zip(axes, assign, strict=True):
            if d is not None:
                per_dim[d] *= s
        if all(sizes[d] % n == 0 for d, n in per_dim.items()):
            yield assign, _spec(assign, [n for n, _ in axes], len(sizes))


_STRATEGY_CACHE: dict[tuple, list[Option]] = {}
_NODE_OPTIONS: dict[tuple, list[Option]] = {}


def _signature(node: fx.Node, mesh: MeshInfo) -> tuple:
    def norm(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), value.dtype)
        if isinstance(value, fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("T", tuple(val.shape), val.dtype)
            return ("N", repr(val))
        if isinstance(value, list | tuple):
            return tuple(norm(v) for v in value)
        return repr(value)

    vals = node.meta.get("val")
    out = norm(list(vals) if isinstance(vals, list | tuple) else [vals]) if vals is not None else ()
    return (
        node.target,
        norm(node.args),
        tuple(sorted((k, norm(v)) for k, v in node.kwargs.items())),
        repr(out) if not isinstance(out, tuple) else out,
        mesh,
    )


def options(node: fx.Node, mesh: MeshInfo) -> list[Option]:
    """Every strategy of a decision node on ``mesh``: each axis on one splittable dim or none."""
    by_node = _NODE_OPTIONS.get((node, mesh))
    if by_node is not None:
        return by_node
    key = _signature(node, mesh) if node.op == "call_function" else None
    if key is not None and key in _STRATEGY_CACHE:
        _NODE_OPTIONS[(node, mesh)] = _STRATEGY_CACHE[key]
        return _STRATEGY_CACHE[key]
    axes = mesh.as_dict()
    out: list[Option] = []
    seen: set = set()
    if node.op == "placeholder":
        shape = shape_of(node)
        dtype = node.meta["val"].dtype
        allowed = [d for d, s in enumerate(shape) if s > 1]
        for assign, spec in _assignments(shape, allowed, mesh):
            layout = Layout.from_named(shape, spec, axes, dtype=dtype)
            out.append(Option(assign, spec, Strategy((), (layout,), ())))
        _NODE_OPTIONS[(node, mesh)] = out
        return out
    rule = rule_for(node)
    space = rule.space(node)
    allowed = [d for d, k in enumerate(space.kinds) if k != FIXED and space.sizes[d] > 1]
    for assign, spec in _assignments(space.sizes, allowed, mesh):
        try:
            strategy = rule.layouts(node, Layout.from_named(space.sizes, spec, axes))
        except (StrategyError, LayoutError):
            continue
        ident = (strategy.ins, strategy.outs, strategy.grads)
        if ident in seen:
            continue
        seen.add(ident)
        out.append(Option(assign, spec, strategy))
    if key is not None:
        _STRATEGY_CACHE[key] = out
    _NODE_OPTIONS[(node, mesh)] = out
    return out


# -- the cost graph -------------------------------------------------------------------------------


@dataclass
class CostGraph:
    """Decision nodes (representatives of repeated layers) with their options and costs.

    ``unary[i][s]`` is node i's seconds under option s (its compute, its followers', its
    gradient reductions, scaled by how many instances it stands for), ``memory[i][s]`` its bytes
    per device, ``edges[(i, j)][s, t]`` (i < j) the seconds of the redistributions between them."""

    mesh: MeshInfo
    names: list[str]
    options: list[list[Option]]
    unary: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    weight: list[float]
    instances: dict[str, str] = field(default_factory=dict)  # every decision node -> its rep
    const_time: float = 0.0
    const_memory: float = 0.0
    model_flops: float = 0.0
    build_seconds: float = 0.0

    def neighbours(self) -> list[list[tuple[int, np.ndarray]]]:
        """Per node: (other node, cost matrix oriented [this, other])."""
        out: list[list[tuple[int, np.ndarray]]] = [[] for _ in self.names]
        for (i, j), m in self.edges.items():
            out[i].append((j, m))
            out[j].append((i, m.T))
        return out

    def objective(self, choice: Sequence[int]) -> tuple[float, float]:
        """(seconds, bytes per device) of one option per node."""
        seconds = self.const_time + sum(u[c] for u, c in zip(self.unary, choice, strict=True))
        seconds += sum(m[choice[i], choice[j]] for (i, j), m in self.edges.items())
        memory = self.const_memory + sum(m[c] for m, c in zip(self.memory, choice, strict=True))
        return float(seconds), float(memory)

    @property
    def size(self) -> tuple[int, int, int]:
        """(nodes, options, edge entries): the integer program's size."""
        return (
            len(self.names),
            sum(len(o) for o in self.options),
            sum(m.size for m in self.edges.values()),
        )


_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _blocks(decision: Sequence[fx.Node]) -> dict[fx.Node, tuple[str, int]]:
    """Decision nodes inside repeated blocks (``prefix.<i>``...) whose blocks are identical."""
    by_block: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node in decision:
        if node.op == "placeholder":
            continue
        match = _BLOCK.match(module_path(node))
        if match:
            by_block[(match.group(1), int(match.group(2)))].append(node)
    prefixes: dict[str, list[int]] = defaultdict(list)
    for prefix, index in by_block:
        prefixes[prefix].append(index)
    out: dict[fx.Node, tuple[str, int]] = {}
    for prefix, indices in prefixes.items():
        if len(indices) < 2:
            continue

        def sig(nodes: list[fx.Node], index: int, prefix: str = prefix) -> tuple:
            head = f"{prefix}.{index}"
            return tuple(
                (module_path(n)[len(head) :], n.target, _signature(n, None)[1:4]) for n in nodes
            )

        first = sig(by_block[(prefix, indices[0])], indices[0])
        if all(sig(by_block[(prefix, i)], i) == first for i in indices[1:]):
            for i in indices:
                for node in by_block[(prefix, i)]:
                    out[node] = (prefix, i)
    return out


def build_cost_graph(
    captured: Captured,
    mesh: MeshInfo,
    cluster: ClusterSpec,
    *,
    depth: Mapping[str, int] | None = None,
    group_layers: bool = True,
    optimizer_states: int = ADAM_STATES,
) -> CostGraph:
    """The cost graph of ``captured`` on ``mesh``. ``depth`` prices a repeated block list as if
    it held more blocks than were captured (``{"layers": 80}`` with two blocks captured)."""
    start = time.perf_counter()
    graph = captured.graph
    weight, decision = _classify(graph)
    source = _sources(graph, weight, decision)
    order = [n for n in graph.nodes if n in decision]
    blocks = _blocks(order) if group_layers else {}
    firsts: dict[str, int] = {}
    for prefix, i in blocks.values():
        firsts[prefix] = min(firsts.get(prefix, i), i)
    # representatives: block i's k-th decision node -> block first's k-th
    rep: dict[fx.Node, fx.Node] = {}
    per_block: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node in order:
        if node in blocks:
            per_block[blocks[node]].append(node)
    for (prefix, _), nodes in per_block.items():
        for k, node in enumerate(nodes):
            rep[node] = per_block[(prefix, firsts[prefix])][k]
    reps = [n for n in order if rep.get(n, n) is n]
    index = {n: i for i, n in enumerate(reps)}
    counts = {p: len({i for (q, i) in per_block if q == p}) for p in firsts}

    def scale(nodes: Sequence[fx.Node]) -> float:
        """How many copies of a term the real model has, per captured copy: a term inside a
        block is in every block, one between neighbouring blocks in every pair; a term reaching
        outside the blocks (the embedding into the first, the last into the head) is once."""
        if not depth or any(n not in blocks for n in nodes):
            return 1.0
        spots = {blocks[n] for n in nodes if n in blocks}
        prefixes = {p for p, _ in spots}
        if len(prefixes) != 1:
            return 1.0
        prefix = prefixes.pop()
        real, got = depth.get(prefix), counts[prefix]
        if real is None or real == got:
            return 1.0
        if len(spots) == 1:
            return real / got
        return (real - 1) / (got - 1) if got > 1 else 1.0

    opts = [options(n, mesh) for n in reps]
    unary = [np.zeros(len(o)) for o in opts]
    memory = [np.zeros(len(o)) for o in opts]
    edges: dict[tuple[int, int], np.ndarray] = {}
    weights = [0.0 for _ in reps]

    # Weight-like values have one layout whatever the plan (as the planner gives them).
    const_layout, owner = _weight_layouts(graph, weight, mesh)
    const_time = 0.0
    const_memory = 0.0
    for node in graph.nodes:
        if node in weight and node.op == "call_function" and node.target is not operator.getitem:
            const_time += sum(op_time(node, _replicated_strategy(node, mesh), cluster))
            if saves_output(node) and node in const_layout:
                const_memory += local_bytes(const_layout[node])
    for p, layout in const_layout.items():
        if _kind(p) in ("param", "buffer") and owner.get(p) in weight:
            const_memory += _param_bytes(p, layout, optimizer_states)
            const_time += _param_time(p, layout, cluster)
    for p in graph.nodes:  # stored but unused: no gradient, no optimizer state or step
        if p.op == "placeholder" and _kind(p) in ("param", "buffer") and not p.users:
            fqn = p.meta["autoshard_fqn"]
            if len(captured.aliases.get(fqn, ())) > 1:
                continue  # a tied name stored under another placeholder
            val = p.meta["val"]
            const_memory += val.numel() * val.element_size()

    # Followers of each decision node, in graph order.
    followers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node not in decision and node in source:
            followers[source[node]].append(node)
    consumers = {n: list(n.users) for n in graph.nodes}
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = set(a for a in tensor_inputs(out_node))
    total_flops = 0.0

    for node in order:
        r = index[rep.get(node, node)]
        k = scale([node])
        flops = model_flops(node) if node.op == "call_function" else 0.0
        total_flops += k * flops + sum(k * model_flops(f) for f in followers[node])
        weights[r] += k * (flops + sum(model_flops(f) for f in followers[node]))
        region_opts = options(node, mesh)
        edge_terms: dict[fx.Node, np.ndarray] = {}
        for s, opt in enumerate(region_opts):
            seconds, mem, values = _region(
                node,
                opt.strategy,
                followers[node],
                const_layout,
                owner,
                weight,
                mesh,
                cluster,
                optimizer_states,
                outputs,
            )
            # the decision node's own inputs: constants, and parameters it owns
            if node.op == "call_function":
                for i, arg in enumerate(tensor_inputs(node)):
                    want = opt.strategy.ins[i]
                    if arg in weight:
                        if owner.get(arg) is node and arg.op == "placeholder":
                            mem += _param_bytes(arg, want.without_partial(), optimizer_states)
                            seconds += _param_time(arg, want.without_partial(), cluster)
                            seconds += _grad_reduce(arg, opt.strategy.grads[i], want, cluster)
                        else:
                            src = const_layout.get(arg)
                            if src is None:  # a parameter owned by another decision node
                                continue
                            seconds += _move(arg, src, want, cluster)
                            seconds += _grad_reduce(arg, opt.strategy.grads[i], want, cluster)
                    else:
                        seconds += _grad_reduce(arg, opt.strategy.grads[i], want, cluster)
            unary[r][s] += k * seconds
            memory[r][s] += k * mem
            # edges to consumers of this region's values
            for value, layout in values.items():
                for user in consumers[value]:
                    if user not in decision or user is node:
                        continue
                    for i, arg in enumerate(tensor_inputs(user)):
                        if arg is not value:
                            continue
                        mat = edge_terms.setdefault(user, _empty(len(region_opts), user, mesh))
                        mat[s] += _edge_row(value, layout, user, i, mesh, cluster)
        for user, mat in edge_terms.items():
            _add_edge(edges, unary, index, rep, node, user, mat * scale([node, user]))
    # parameters shared by two decision nodes (tied weights): an edge between their owners
    for p, own in owner.items():
        if own in weight or p.op != "placeholder":
            continue
        for user in consumers[p]:
            if user is own or user not in decision:
                continue
            own_src = source[own]
            mat = _empty(len(options(own_src, mesh)), user, mesh)
            for s, sopt in enumerate(options(own_src, mesh)):
                stored, own_grad = _stored_layout(
                    p,
                    own,
                    own_src,
                    sopt.strategy,
                    followers,
                    const_layout,
                    owner,
                    weight,
                    mesh,
                    cluster,
                    outputs,
                )
                for t, uopt in enumerate(options(user, mesh)):
                    i = tensor_inputs(user).index(p)
                    want = uopt.strategy.ins[i]
                    mat[s, t] = _move(p, stored, want, cluster)
                    mat[s, t] += _tied_grads(
                        p, stored, own_grad, want, uopt.strategy.grads[i], cluster
                    )
            _add_edge(edges, unary, index, rep, own_src, user, mat * scale([own_src, user]))
    return CostGraph(
        mesh=mesh,
        names=[n.name for n in reps],
        options=[options(n, mesh) for n in reps],
        unary=unary,
        memory=memory,
        edges=edges,
        weight=weights,
        instances={n.name: rep.get(n, n).name for n in order},
        const_time=const_time,
        const_memory=const_memory,
        model_flops=total_flops,
        build_seconds=time.perf_counter() - start,
    )


_ROWS: dict[tuple, np.ndarray] = {}
_WANTS: dict[tuple, tuple[list[Layout], np.ndarray]] = {}


def _edge_row(value, layout, user, i, mesh, cluster) -> np.ndarray:  # noqa: ANN001
    """Seconds of moving ``value`` in ``layout`` to what each option of ``user`` wants."""
    backward = differentiable(value) and _kind(value) != "buffer"
    key = (layout, user, i, mesh, id(cluster), backward)
    row = _ROWS.get(key)
    if row is None:
        wants, where = _wants(user, i, mesh)
        row = np.array([_move_cost(layout, w, backward, cluster) for w in wants])[where]
        _ROWS[key] = row
    return row


def _wants(user: fx.Node, i: int, mesh: MeshInfo) -> tuple[list[Layout], np.ndarray]:
    """The distinct layouts ``user``'s options want for input ``i``, and which each wants."""
    key = (user, i, mesh)
    found = _WANTS.get(key)
    if found is None:
        index: dict[Layout, int] = {}
        where = [index.setdefault(o.strategy.ins[i], len(index)) for o in options(user, mesh)]
        found = _WANTS[key] = (list(index), np.array(where, dtype=np.intp))
    return found


def _empty(rows: int, user: fx.Node, mesh: MeshInfo) -> np.ndarray:
    return np.zeros((rows, len(options(user, mesh))))


def _add_edge(edges, unary, index, rep, u, v, mat) -> None:  # noqa: ANN001
    i, j = index[rep.get(u, u)], index[rep.get(v, v)]
    if i == j:
        unary[i] += np.diag(mat)
    elif i < j:
        edges[(i, j)] = edges.get((i, j), 0) + mat
    else:
        edges[(j, i)] = edges.get((j, i), 0) + mat.T


def _param_bytes(p: fx.Node, layout: Layout, optimizer_states: int) -> float:
    size = local_bytes(layout)
    return size * (2 + optimizer_states) if _kind(p) == "param" else size


def _param_time(p: fx.Node, layout: Layout, cluster: ClusterSpec) -> float:
    return optimizer_time(layout, cluster) if _kind(p) == "param" else 0.0


_MOVES: dict[tuple, float] = {}


def _move(value: fx.Node, src: Layout, want: Layout, cluster: ClusterSpec) -> float:
    """Forward redistribution and, for a differentiable value, its mirror in backward."""
    if src == want:
        return 0.0
    return _move_cost(src, want, differentiable(value) and _kind(value) != "buffer", cluster)


def _move_cost(src: Layout, want: Layout, backward: bool, cluster: ClusterSpec) -> float:
    if src == want:
        return 0.0
    key = (src, want, backward, id(cluster))
    seconds = _MOVES.get(key)
    if seconds is None:
        seconds = transition(src, want, cluster).seconds
        if backward:
            seconds += transition(want.without_partial(), src.without_partial(), cluster).seconds
        _MOVES[key] = seconds
    return seconds


def _grad_reduce(arg: fx.Node, grad: Layout, want: Layout, cluster: ClusterSpec) -> float:
    if not differentiable(arg) or _kind(arg) == "buffer":
        return 0.0
    param = _kind(arg) == "param"
    key = (grad, want, "param grad" if param else "grad", id(cluster))
    seconds = _MOVES.get(key)
    if seconds is None:
        whole = want.without_partial()
        if grad == whole:
            seconds = 0.0
        elif param:  # summed in the backward's coalesced all-reduce
            seconds = grad_sync(grad, whole, cluster)[0]
        else:
            seconds = transition(grad, whole, cluster).seconds
        _MOVES[key] = seconds
    return seconds


def _replicated_strategy(node: fx.Node, mesh: MeshInfo) -> Strategy:
    ins = [None for _ in tensor_inputs(node)]
    return rule_for(node).follow(node, ins, mesh)


def _weight_layouts(graph: fx.Graph, weight: set[fx.Node], mesh: MeshInfo):  # noqa: ANN202
    """Layouts of weight-like values (as the planner's walk gives them) and each parameter's
    first consumer, which decides its stored layout."""
    layouts: dict[fx.Node, Layout] = {}
    all_outs: dict[fx.Node, tuple] = {}
    owner: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for a in tensor_inputs(node):
            if a.op == "placeholder" and _kind(a) != "input":
                owner.setdefault(a, node)
        if node not in weight:
            continue
        if node.target is operator.getitem:
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


def _region(
    node: fx.Node,
    strategy: Strategy,
    followers: list[fx.Node],
    const_layout: dict[fx.Node, Layout],
    owner: dict[fx.Node, fx.Node],
    weight: set[fx.Node],
    mesh: MeshInfo,
    cluster: ClusterSpec,
    optimizer_states: int,
    outputs: set[fx.Node],
) -> tuple[float, float, dict[fx.Node, Layout]]:
    """Seconds and bytes of a decision node and its followers under one option, and the
    layouts of every value the region produces."""
    values: dict[fx.Node, Layout] = {}
    seconds = memory = 0.0
    if node.op == "placeholder":
        values[node] = strategy.outs[0]
        memory += local_bytes(strategy.outs[0])
    else:
        fwd, bwd = op_time(node, strategy, cluster)
        seconds += fwd + bwd
        if saves_output(node):
            memory += sum(local_bytes(o) for o in strategy.outs)
        _set_outputs(node, strategy, values)
    for f in followers:
        if f.target is operator.getitem:
            continue  # its layout came with its producer's outputs
        args = tensor_inputs(f)
        ins: list[Layout | None] = []
        for a in args:
            if a in values:
                ins.append(values[a])
            elif a.op == "placeholder" and owner.get(a) is f:
                ins.append(None)
            else:
                ins.append(const_layout.get(a))
        fstrategy = _follow(f, ins, mesh)
        fwd, bwd = op_time(f, fstrategy, cluster)
        seconds += fwd + bwd
        for a, have, want, grad in zip(args, ins, fstrategy.ins, fstrategy.grads, strict=True):
            if have is None:
                if a.op == "placeholder":
                    values[a] = want.without_partial()
                    memory += _param_bytes(a, want.without_partial(), optimizer_states)
                    seconds += _param_time(a, want.without_partial(), cluster)
                    seconds += _grad_reduce(a, grad, want, cluster)
                continue
            seconds += _move(a, have, want, cluster)
            seconds += _grad_reduce(a, grad, want, cluster)
        if saves_output(f):
            memory += sum(local_bytes(o) for o in fstrategy.outs)
        _set_outputs(f, fstrategy, values)
    for value in outputs & set(values):
        src = values[value]
        seconds += transition(
            src, Layout.replicated(src.shape, mesh.num_devices, dtype=src.dtype), cluster
        ).seconds
    return seconds, memory, values


_FOLLOWS: dict[tuple, Strategy] = {}
_SIGNATURES: dict[fx.Node, tuple] = {}


def _follow(node: fx.Node, ins: list[Layout | None], mesh: MeshInfo) -> Strategy:
    """``rule.follow``, shared by every node with the same op, arguments and input layouts."""
    sig = _SIGNATURES.get(node)
    if sig is None:
        sig = _SIGNATURES[node] = _signature(node, None)
    key = (sig, tuple(ins), mesh)
    found = _FOLLOWS.get(key)
    if found is None:
        found = _FOLLOWS[key] = rule_for(node).follow(node, ins, mesh)
    return found


def _set_outputs(node: fx.Node, strategy: Strategy, values: dict[fx.Node, Layout]) -> None:
    if strategy.outs and strategy.outs[0] is not None:
        values[node] = strategy.outs[0]
    for user in node.users:
        if user.target is operator.getitem:
            k = user.args[1]
            if k < len(strategy.outs) and strategy.outs[k] is not None:
                values[user] = strategy.outs[k]


def _stored_layout(
    p, own, own_src, strategy, followers, const_layout, owner, weight, mesh, cluster, outputs
):  # noqa: ANN001, ANN202
    """The layout a shared parameter is stored in under its owner's source's option, and the
    layout of its gradient from the owner."""
    if own is own_src:
        i = tensor_inputs(own).index(p)
        return strategy.ins[i].without_partial(), strategy.grads[i]
    _, _, values = _region(
        own_src,
        strategy,
        followers[own_src],
        const_layout,
        owner,
        weight,
        mesh,
        cluster,
        0,
        outputs,
    )
    args = tensor_inputs(own)
    ins = [None if a is p else values.get(a, const_layout.get(a)) for a in args]
    return values[p], _follow(own, ins, mesh).grads[args.index(p)]


def _tied_grads(
    p: fx.Node, stored: Layout, own_grad: Layout, want: Layout, grad: Layout, cluster: ClusterSpec
) -> float:
    """Gradient sums of a parameter's second use beyond what its owner's term priced (one
    coalesced sum of the owner's gradient). As the planner does: when neither use moves the
    parameter and both gradients need the same sum, one deferred sum serves both; otherwise each
    use that needs a sum does its own, alone."""
    if not differentiable(p) or _kind(p) != "param":
        return 0.0
    own_needs = own_grad != stored
    needs = grad != want.without_partial()
    if own_needs and needs and want == stored and grad == own_grad:
        return 0.0
    seconds = transition(grad, want.without_partial(), cluster).seconds if needs else 0.0
    if own_needs:
        seconds += transition(own_grad, stored, cluster).seconds
        seconds -= _grad_reduce(p, own_grad, stored, cluster)
    return seconds


# -- solvers --------------------------------------------------------------------------------------


@dataclass
class Solution:
    choice: list[int]
    seconds: float
    memory: float
    search: str
    solve_seconds: float = 0.0


def solve_optimal(graph: CostGraph, memory_limit: float = math.inf) -> Solution | None:
    """The exact optimum of the cost graph under the memory limit (None when nothing fits):
    binaries per (node, option), continuous edge variables tied to both ends."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    start = time.perf_counter()
    offsets, n = [], 0
    for opts in graph.options:
        offsets.append(n)
        n += len(opts)
    num_x = n
    edge_offsets = {}
    for key, m in graph.edges.items():
        edge_offsets[key] = n
        n += m.size
    scale = 1e3  # milliseconds keep the objective's coefficients near 1
    c = np.zeros(n)
    for i, u in enumerate(graph.unary):
        c[offsets[i] : offsets[i] + len(u)] = u * scale
    for key, m in graph.edges.items():
        c[edge_offsets[key] : edge_offsets[key] + m.size] = m.ravel() * scale
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for i, opts in enumerate(graph.options):  # one option per node
        for s in range(len(opts)):
            rows.append(r)
            cols.append(offsets[i] + s)
            vals.append(1.0)
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    for (i, j), m in graph.edges.items():  # edge marginals: each row (column) sums to x
        base = edge_offsets[(i, j)]
        si, sj = m.shape
        cells = np.arange(si * sj).reshape(si, sj) + base
        for node, groups in ((i, cells), (j, cells.T)):
            for s, group in enumerate(groups):
                rows.extend([r] * (len(group) + 1))
                cols.extend([*group.tolist(), offsets[node] + s])
                vals.extend([1.0] * len(group) + [-1.0])
                lo.append(0.0)
                hi.append(0.0)
                r += 1
    if math.isfinite(memory_limit):
        mem_scale = max(1.0, max((float(m.max()) for m in graph.memory), default=1.0))
        for i, m in enumerate(graph.memory):
            for s, v in enumerate(m):
                rows.append(r)
                cols.append(offsets[i] + s)
                vals.append(v / mem_scale)
        lo.append(-np.inf)
        hi.append((memory_limit - graph.const_memory) / mem_scale)
        r += 1
    a = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    integrality = np.zeros(n)
    integrality[:num_x] = 1
    result = milp(
        c,
        constraints=LinearConstraint(a, lo, hi),
        integrality=integrality,
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 1e-9, "presolve": True},
    )
    if result.x is None:
        return None
    choice = [
        int(np.argmax(result.x[offsets[i] : offsets[i] + len(o)]))
        for i, o in enumerate(graph.options)
    ]
    seconds, memory = graph.objective(choice)
    return Solution(choice, seconds, memory, "optimal", time.perf_counter() - start)


def brute_force(graph: CostGraph, memory_limit: float = math.inf, limit: int = 4_000_000):
    """Every combination of options (small graphs only): the reference for ``solve_optimal``."""
    sizes = [len(o) for o in graph.options]
    if math.prod(sizes) > limit:
        raise ValueError(f"{math.prod(sizes)} combinations: too many to enumerate")
    k = len(sizes)

    def along(i: int, v: np.ndarray) -> np.ndarray:
        shape = [1] * k
        shape[i] = len(v)
        return v.reshape(shape)

    total = np.full(sizes, graph.const_time)
    mem = np.full(sizes, graph.const_memory)
    for i in range(k):
        total = total + along(i, graph.unary[i])
        mem = mem + along(i, graph.memory[i])
    for (i, j), m in graph.edges.items():
        shape = [1] * k
        shape[i], shape[j] = m.shape
        total = total + m.reshape(shape)
    total = np.where(mem <= memory_limit, total, np.inf)
    flat = int(np.argmin(total))
    if not np.isfinite(total.flat[flat]):
        return None
    choice = [int(c) for c in np.unravel_index(flat, sizes)]
    seconds, memory = graph.objective(choice)
    return Solution(choice, seconds, memory, "brute_force")


def _local_cost(graph, nbrs, i, s, choice, lam):  # noqa: ANN001, ANN202
    cost = graph.unary[i][s] + lam * graph.memory[i][s]
    for j, m in nbrs[i]:
        if choice[j] is not None:
            cost += m[s, choice[j]]
    return cost


def solve_recursive(graph: CostGraph, memory_limit: float = math.inf, sweeps: int = 20):
    """Axis by axis, ops by FLOPs choose the dim each axis splits given their neighbours (in
    both axis orders, and from the all-data-parallel and the cheapest-op starts); then sweeps of
    local re-choice until nothing changes; the best wins. Memory: a price per byte (Lagrangian),
    raised until a plan fits and then bisected down to the cheapest price that still fits, and
    the best fitting plan re-chosen op by op for time within the limit. Each pass is linear in
    the graph."""
    start = time.perf_counter()
    nbrs = graph.neighbours()
    order = sorted(range(len(graph.names)), key=lambda i: -graph.weight[i])
    num_axes = len(graph.options[0][0].assign) if graph.options and graph.options[0] else 0

    def attempt(lam: float) -> tuple[Solution | None, list[int]]:
        starts = [
            _by_axes(graph, nbrs, order, num_axes, reversed(range(num_axes)), lam),
            _by_axes(graph, nbrs, order, num_axes, range(num_axes), lam),
            [_data_parallel_option(opts) for opts in graph.options],
            [int(np.argmin(u + lam * m)) for u, m in zip(graph.unary, graph.memory, strict=True)],
        ]
        fits = []
        for choice in starts:
            for _ in range(sweeps):
                _sweep(graph, nbrs, order, choice, lam, sweeps)
                if not _pair_sweep(graph, nbrs, choice, lam):
                    break
            seconds, memory = graph.objective(choice)
            if memory <= memory_limit:
                fits.append(Solution(list(choice), seconds, memory, "recursive"))
        return (min(fits, key=lambda s: s.seconds) if fits else None), starts[0]

    best, first = attempt(0.0)
    lam_lo, lam_hi = 0.0, 0.0
    for _ in range(40):
        if best is not None:
            break
        seconds, memory = graph.objective(first)
        lam_lo, lam_hi = lam_hi, max(lam_hi * 4, seconds / max(memory, 1.0))
        best, first = attempt(lam_hi)
    if best is not None and lam_hi > 0:
        for _ in range(8):  # the cheapest price of memory that still fits
            lam = (lam_lo + lam_hi) / 2
            found, _ = attempt(lam)
            if found is None:
                lam_lo = lam
                continue
            lam_hi = lam
            if found.seconds < best.seconds:
                best = found
        _fit_sweep(graph, nbrs, order, best, memory_limit)
    if best is not None:
        best.solve_seconds = time.perf_counter() - start
    return best


def _fit_sweep(graph, nbrs, order, sol: Solution, memory_limit: float) -> None:  # noqa: ANN001
    """Re-choose op by op for time alone, among the options that keep the plan in the limit."""
    choice = sol.choice
    memory = sol.memory
    for _ in range(20):
        changed = False
        for i in order:
            c = choice[i]
            room = memory_limit - (memory - graph.memory[i][c])
            costs = [
                _local_cost(graph, nbrs, i, s, choice, 0.0)
                if graph.memory[i][s] <= room
                else math.inf
                for s in range(len(graph.options[i]))
            ]
            s = int(np.argmin(costs))
            if costs[s] < costs[c] - 1e-15:
                memory += graph.memory[i][s] - graph.memory[i][c]
                choice[i], changed = s, True
        if not changed:
            break
    sol.seconds, sol.memory = graph.objective(choice)


def _by_axes(graph, nbrs, order, num_axes, axes, lam) -> list[int]:  # noqa: ANN001
    """Each axis in turn: every op (heaviest first) picks the dim it splits, the other axes as
    already chosen (later ones unsplit)."""
    assign: list[list[int | None]] = [[None] * num_axes for _ in graph.names]
    by_assign = [{o.assign: s for s, o in enumerate(opts)} for opts in graph.options]
    choice: list[int | None] = [by_assign[i].get(tuple(a)) for i, a in enumerate(assign)]
    for axis in axes:
        for i in order:
            best_s, best_c = choice[i], math.inf
            for s, opt in enumerate(graph.options[i]):
                if any(opt.assign[a] != assign[i][a] for a in range(num_axes) if a != axis):
                    continue
                c = _local_cost(graph, nbrs, i, s, choice, lam)
                if c < best_c:
                    best_s, best_c = s, c
            choice[i] = best_s
            if best_s is not None:
                assign[i] = list(graph.options[i][best_s].assign)
    return [0 if c is None else c for c in choice]


def _data_parallel_option(opts: list[Option]) -> int:
    """The option that puts every axis on the first dim (else the one splitting the most)."""
    for s, opt in enumerate(opts):
        if opt.assign and all(d == 0 for d in opt.assign):
            return s
    return max(range(len(opts)), key=lambda s: sum(d is not None for d in opts[s].assign))


def _pair_sweep(graph, nbrs, choice, lam) -> bool:  # noqa: ANN001
    """Every edge re-chooses both its ends together, the rest fixed; True if anything moved."""
    changed = False
    for (i, j), m in graph.edges.items():
        ui = graph.unary[i] + lam * graph.memory[i]
        uj = graph.unary[j] + lam * graph.memory[j]
        for k, mk in nbrs[i]:
            if k != j:
                ui = ui + mk[:, choice[k]]
        for k, mk in nbrs[j]:
            if k != i:
                uj = uj + mk[:, choice[k]]
        total = ui[:, None] + uj[None, :] + m
        s, t = np.unravel_index(int(np.argmin(total)), total.shape)
        if total[s, t] < total[choice[i], choice[j]] - 1e-15:
            choice[i], choice[j] = int(s), int(t)
            changed = True
    return changed


def _sweep(graph, nbrs, order, choice, lam, sweeps) -> None:  # noqa: ANN001
    for _ in range(sweeps):
        changed = False
        for i in order:
            costs = [
                _local_cost(graph, nbrs, i, s, choice, lam) for s in range(len(graph.options[i]))
            ]
            s = int(np.argmin(costs))
            if costs[s] < costs[choice[i]] - 1e-15:
                choice[i], changed = s, True
        if not changed:
            return


def solve_propagate(
    graph: CostGraph, fixed: Mapping[int, int] | None = None, memory_limit: float = math.inf
):
    """Sharding propagation: fixed nodes keep their option; the others, breadth-first, take the
    option with the least edge cost to the nodes already decided (compute breaks ties)."""
    start = time.perf_counter()
    nbrs = graph.neighbours()
    choice: list[int | None] = [None] * len(graph.names)
    queue: deque[int] = deque()
    for i, s in (fixed or {}).items():
        choice[i] = s
        queue.append(i)
    while None in choice:
        if not queue:
            seed = max(
                (i for i, c in enumerate(choice) if c is None), key=lambda i: graph.weight[i]
            )
            choice[seed] = int(np.argmin(graph.unary[seed]))
            queue.append(seed)
        while queue:
            i = queue.popleft()
            for j, _ in nbrs[i]:
                if choice[j] is not None:
                    continue
                costs = []
                for t in range(len(graph.options[j])):
                    edge = sum(m[t, choice[k]] for k, m in nbrs[j] if choice[k] is not None)
                    costs.append((edge, graph.unary[j][t]))
                choice[j] = min(range(len(costs)), key=costs.__getitem__)
                queue.append(j)
    seconds, memory = graph.objective(choice)
    if memory > memory_limit:
        return None
    return Solution(list(choice), seconds, memory, "propagate", time.perf_counter() - start)


def lower_bound(graph: CostGraph) -> float:
    """No plan on this mesh is faster: each edge is charged to one of its ends at the cheapest
    cost that end's option allows, and each node takes its cheapest option with the edges it
    was charged (the larger of charging every edge to its first or to its second end)."""
    best = -math.inf
    for end in (0, 1):
        totals = [u.copy() for u in graph.unary]
        for key, m in graph.edges.items():
            totals[key[end]] += m.min(axis=1 - end)
        best = max(best, sum(float(t.min()) for t in totals))
    return graph.const_time + best


# -- mesh shapes and the result -------------------------------------------------------------------


def mesh_shapes(
    num_devices: int, cluster: ClusterSpec, tp_across_nodes: bool = False
) -> list[MeshInfo]:
    """Every ``dp x tp`` factorization of the devices, ``tp`` inside a node unless allowed."""
    out = []
    for tp in range(1, num_devices + 1):
        if num_devices % tp:
            continue
        if tp > cluster.devices_per_node and not tp_across_nodes:
            continue
        out.append(MeshInfo(("dp", "tp"), (num_devices // tp, tp), ("dp",)))
    return out


@dataclass
class SearchResult:
    """The chosen mesh and one option per decision node, with the cost graph it came from."""

    mesh: MeshInfo
    graph: CostGraph
    solution: Solution
    tried: list[dict[str, Any]]
    search_seconds: float

    def strategies(self) -> dict[str, Strategy]:
        """Every decision node's strategy (repeated layers share their representative's)."""
        rep_index = {name: i for i, name in enumerate(self.graph.names)}
        out = {}
        for name, rep in self.graph.instances.items():
            i = rep_index[rep]
            out[name] = self.graph.options[i][self.solution.choice[i]]
        return out


def search(
    captured: Captured,
    num_devices: int,
    cluster: ClusterSpec,
    *,
    search: str = "optimal",
    mesh: MeshInfo | None = None,
    memory_limit: float | None = None,
    tp_across_nodes: bool = False,
    depth: Mapping[str, int] | None = None,
    fixed: Mapping[str, Any] | None = None,
) -> SearchResult:
    """The fastest plan that fits, over every mesh shape (or the given ``mesh``)."""
    if search not in SEARCHES:
        raise ValueError(f"search={search!r}: expected one of {', '.join(SEARCHES)}")
    start = time.perf_counter()
    clear_caches()
    limit = cluster.memory_bytes if memory_limit is None else memory_limit
    meshes = [mesh] if mesh is not None else mesh_shapes(num_devices, cluster, tp_across_nodes)
    graphs = [build_cost_graph(captured, m, cluster, depth=depth) for m in meshes]
    ranked = sorted(range(len(meshes)), key=lambda k: lower_bound(graphs[k]))
    best: tuple[int, Solution] | None = None
    tried: list[dict[str, Any]] = []
    smallest = math.inf
    for k in ranked:
        graph = graphs[k]
        row: dict[str, Any] = {"mesh": graph.mesh.as_dict(), "bound_s": lower_bound(graph)}
        smallest = min(smallest, graph.const_memory + sum(float(m.min()) for m in graph.memory))
        if best is not None and row["bound_s"] >= best[1].seconds:
            row["skipped"] = "bound"
            tried.append(row)
            continue
        if search == "optimal":
            sol = solve_optimal(graph, limit)
        elif search == "recursive":
            sol = solve_recursive(graph, limit)
        else:
            sol = solve_propagate(graph, _fixed_options(graph, fixed or {}), limit)
        if sol is None:
            row["fits"] = False
        else:
            row.update(step_s=sol.seconds, memory=sol.memory, solve_s=sol.solve_seconds)
            # equal times (all axes on the batch: the same plan on any shape): fewer tp
            if best is None or (sol.seconds, meshes[k].sizes[-1]) < (
                best[1].seconds * (1 - 1e-9),
                meshes[best[0]].sizes[-1],
            ):
                best = (k, sol)
        tried.append(row)
    if best is None:
        raise PlanningError(
            f"no plan fits in {limit / 2**30:.2f} GiB per device on {num_devices} devices: the "
            f"smallest peak found is {smallest / 2**30:.2f} GiB. Add devices, or shard the "
            f"optimizer state (ZeRO), split the layers into pipeline stages, or recompute "
            f"activations"
        )
    k, sol = best
    return SearchResult(meshes[k], graphs[k], sol, tried, time.perf_counter() - start)


def clear_caches() -> None:
    """Forget what was cached per graph node (the caches keyed by op signature stay)."""
    for cache in (_NODE_OPTIONS, _ROWS, _WANTS, _SIGNATURES, _MOVES):
        cache.clear()


def _fixed_options(graph: CostGraph, fixed: Mapping[str, Any]) -> dict[int, int]:
    out = {}
    for name, strategy in fixed.items():
        if name not in graph.names:
            continue
        i = graph.names.index(name)
        for s, opt in enumerate(graph.options[i]):
            if opt.strategy.ins == strategy.ins and opt.strategy.outs == strategy.outs:
                out[i] = s
                break
    return out


__all__ = [
    "SEARCHES",
    "CostGraph",
    "PlanningError",
    "SearchResult",
    "Solution",
    "brute_force",
    "build_cost_graph",
    "mesh_shapes",
    "search",
    "solve_optimal",
    "solve_propagate",
    "solve_recursive",
]
