"""The cost graph: decision nodes with per-option costs and per-edge cost matrices (docs/search.md).

``build_cost_graph`` turns a captured graph and a mesh into decision nodes (inputs and the ops
that choose a split) with, per option, their seconds and bytes per device (their own and those of
the ops that follow them, ``pricing``), and per pair of connected decision nodes the seconds of
the redistributions between their options. Repeated layers are priced once through a
representative block and scaled to the model's depth.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx

from autoshard.cost import ADAM_STATES, ClusterSpec
from autoshard.cost.compute import local_bytes, op_time, saves_output
from autoshard.graph import OpGraph, node_info
from autoshard.mesh import MeshInfo
from autoshard.ops import SUM, SpaceRule, Strategy, rule_for, tensor_inputs
from autoshard.search import pricing
from autoshard.search.options import Option, options
from autoshard.search.params import ParamTerms
from autoshard.search.plans import PlanningError
from autoshard.search.state import search_session

# -- classification -------------------------------------------------------------------------------


def _classify(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """(weight-like nodes, decision nodes). Weight-like: parameters, buffers and whatever is
    computed from them alone; decision: inputs and the ops docs/search.md lists."""
    weight: set[fx.Node] = set()
    decision: set[fx.Node] = set()
    for node in graph.nodes:
        if node_info(node).from_state:
            weight.add(node)
            continue
        if node.op == "placeholder":
            decision.add(node)
        if node.op != "call_function" or node_info(node).kind == "getitem":
            continue
        args, rule = tensor_inputs(node), rule_for(node)
        if not isinstance(rule, SpaceRule):
            continue
        acts = {a for a in args if a not in weight}
        reads_matrix = any(a in weight and len(node_info(a).shape) >= 2 for a in args)
        # a cat of one decision node's activations (a rotary embedding's halves) follows
        # it; ``_sources`` promotes a cat of two decision nodes' to one of its own
        joins = len(acts) >= 2 and not rule.is_shape_op
        if SUM in rule.space(node).kinds or reads_matrix or joins:
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
        elif node_info(node).kind == "getitem":
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
    #: block list prefix -> its real number of blocks, when fewer were captured
    depth: Mapping[str, int] | None = None
    #: the ZeRO stage its parameters are priced at
    zero: int = 0
    #: per node and option: the bucketed gradient sums among ``unary`` (they run beside
    #: backward) and the backward compute they can hide behind (docs/search.md)
    overlap: list[np.ndarray] = field(default_factory=list)
    window: list[np.ndarray] = field(default_factory=list)
    const_window: float = 0.0
    #: what its linear relaxations learnt, by memory limit (``solvers.relaxed_bound``)
    relaxed: dict[float, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def neighbours(self) -> list[list[tuple[int, np.ndarray]]]:
        """Per node: (other node, cost matrix oriented [this, other])."""
        out: list[list[tuple[int, np.ndarray]]] = [[] for _ in self.names]
        for (i, j), m in self.edges.items():
            out[i].append((j, m))
            out[j].append((i, m.T))
        return out

    def objective(self, choice: Sequence[int]) -> tuple[float, float]:
        """(seconds, bytes per device) of one option per node: its terms summed, but the
        bucketed gradient sums only as far as they outlast the backward compute, which they
        run beside (``hidden``)."""
        seconds = self.const_time + sum(u[c] for u, c in zip(self.unary, choice, strict=True))
        seconds += sum(m[choice[i], choice[j]] for (i, j), m in self.edges.items())
        seconds -= self.hidden(choice)
        memory = self.const_memory + sum(m[c] for m, c in zip(self.memory, choice, strict=True))
        return float(seconds), float(memory)

    def hidden(self, choice: Sequence[int]) -> float:
        """Seconds of bucketed gradient sums the backward compute hides: all of them, up to
        the backward's length (the leading parameters' sums, ready last, are in line)."""
        if not self.overlap:
            return 0.0
        bucketed = sum(o[c] for o, c in zip(self.overlap, choice, strict=True))
        window = self.const_window + sum(w[c] for w, c in zip(self.window, choice, strict=True))
        return float(min(bucketed, window))

    @property
    def size(self) -> tuple[int, int, int]:
        """(nodes, options, edge entries): the integer program's size."""
        return (
            len(self.names),
            sum(len(o) for o in self.options),
            sum(m.size for m in self.edges.values()),
        )


# -- building -------------------------------------------------------------------------------------


class _Builder:
    """One cost graph in the making: the classified graph, the representatives of repeated
    blocks, and the arrays the terms are added into."""

    def __init__(
        self,
        og: OpGraph,
        mesh: MeshInfo,
        cluster: ClusterSpec,
        depth: Mapping[str, int] | None,
        group_layers: bool,
        optimizer_states: int,
        step_share: float = 1.0,
    ) -> None:
        self.og, self.mesh, self.cluster = og, mesh, cluster
        self.depth, self.optimizer_states = depth, optimizer_states
        self.step_share = step_share
        graph = og.graph
        self.weight, self.decision = _classify(graph)
        self.source = _sources(graph, self.weight, self.decision)
        self.order = [n for n in graph.nodes if n in self.decision]
        self.blocks: dict[fx.Node, tuple[str, int]] = {}
        if group_layers:
            self.blocks = {
                n: og[n].block
                for n in self.order
                if n.op != "placeholder" and og.is_repeated(og[n])
            }
        self._representatives()
        self.opts = [options(n, mesh) for n in self.reps]
        self.offsets = np.cumsum([0] + [len(o) for o in self.opts]).tolist()
        self.unary = [np.zeros(len(o)) for o in self.opts]
        self.memory = [np.zeros(len(o)) for o in self.opts]
        self.overlap = [np.zeros(len(o)) for o in self.opts]
        self.window = [np.zeros(len(o)) for o in self.opts]
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.diagonal = [np.zeros(len(o)) for o in self.opts]  # moves within a representative
        self.weights = [0.0 for _ in self.reps]
        # Weight-like values have one layout whatever the plan (as the planner gives them).
        self.const_layout, self.owner = pricing.weight_layouts(graph, self.weight, mesh)
        self.followers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function" and node not in self.decision and node in self.source:
                self.followers[self.source[node]].append(node)
        out_node = next(n for n in graph.nodes if n.op == "output")
        self.outputs = set(tensor_inputs(out_node))
        self.region = pricing.Region(
            self.followers, self.const_layout, self.owner, mesh, cluster, self.outputs
        )
        lead = self.region.leading  # the leading parameters, and values made from them alone
        for n in graph.nodes:
            if og[n].fqn in og.leading or n in self.weight and lead.intersection(tensor_inputs(n)):
                lead.add(n)
        self.params = ParamTerms(cluster, optimizer_states, self.region.leading)

    def _representatives(self) -> None:
        """Block i's k-th decision node stands for block first's k-th."""
        firsts: dict[str, int] = {}
        for prefix, i in self.blocks.values():
            firsts[prefix] = min(firsts.get(prefix, i), i)
        self.rep: dict[fx.Node, fx.Node] = {}
        per_block: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
        for node in self.order:
            if node in self.blocks:
                per_block[self.blocks[node]].append(node)
        for (prefix, _), nodes in per_block.items():
            for k, node in enumerate(nodes):
                self.rep[node] = per_block[(prefix, firsts[prefix])][k]
        self.reps = [n for n in self.order if self.rep.get(n, n) is n]
        self.index = {n: i for i, n in enumerate(self.reps)}
        self.counts = {p: len({i for (q, i) in per_block if q == p}) for p in firsts}

    def scale(self, nodes: Sequence[fx.Node]) -> float:
        """How many copies of a term the real model has, per captured copy: a term inside a
        block is in every block, one between neighbouring blocks in every pair; a term reaching
        outside the blocks (the embedding into the first, the last into the head) is once."""
        if not self.depth or any(n not in self.blocks for n in nodes):
            return 1.0
        spots = {self.blocks[n] for n in nodes if n in self.blocks}
        prefixes = {p for p, _ in spots}
        if len(prefixes) != 1:
            return 1.0
        prefix = prefixes.pop()
        real, got = self.depth.get(prefix), self.counts[prefix]
        if real is None or real == got:
            return 1.0
        if len(spots) == 1:
            return real / got
        return (real - 1) / (got - 1) if got > 1 else 1.0

    def constants(self) -> tuple[float, float, float]:
        """Seconds and bytes that no option changes: weight-like ops, parameters whose layout
        weight-like ops decide, and stored parameters nothing uses; and the backward compute
        among those seconds."""
        const_time = const_memory = const_window = 0.0
        for node in self.og.graph.nodes:
            if node in self.weight and self.og[node].kind == "op":
                fwd, bwd = op_time(node, pricing.replicated(node, self.mesh), self.cluster)
                const_time, const_window = const_time + fwd + bwd, const_window + bwd
                if saves_output(node) and node in self.const_layout:
                    const_memory += local_bytes(self.const_layout[node])
        for p, layout in self.const_layout.items():
            if self.og[p].is_state and self.owner.get(p) in self.weight:
                const_memory += pricing.param_bytes(p, layout, self.optimizer_states)
                const_time += pricing.param_time(p, layout, self.cluster)
        for info in self.og.state():  # stored but unused: no gradient, no optimizer state or step
            if info.node.users or len(self.og.aliases.get(info.fqn, ())) > 1:
                continue  # used, or a tied name stored under another placeholder
            const_memory += info.node.meta["val"].numel() * info.node.meta["val"].element_size()
        return const_time, const_memory, const_window

    def add_edge(self, u: fx.Node, v: fx.Node, mat: np.ndarray) -> None:
        i, j = self.index[self.rep.get(u, u)], self.index[self.rep.get(v, v)]
        if i == j:
            self.diagonal[i] += np.diag(mat)
        elif i < j:
            self.edges[(i, j)] = self.edges.get((i, j), 0) + mat
        else:
            self.edges[(j, i)] = self.edges.get((j, i), 0) + mat.T

    def own_inputs(
        self, node: fx.Node, strategy: Strategy, seconds: float
    ) -> tuple[float, float, list[pricing.ParamUse]]:
        """A decision op's own inputs under one option: moves of weight-like values, gradient
        sums, added to the region's ``seconds``; the bucketed gradient sums among the seconds
        added; and the parameters it owns (their bytes, optimizer step and gradient sum are
        priced apart, ``ParamTerms``)."""
        bucketed, owned = 0.0, []
        for i, arg in enumerate(tensor_inputs(node)):
            want, grad = strategy.ins[i], strategy.grads[i]
            if arg in self.weight and self.owner.get(arg) is node and arg.op == "placeholder":
                owned.append(pricing.ParamUse(arg, want.without_partial(), grad, want))
                continue
            if arg in self.weight and arg in self.const_layout:
                have = self.const_layout[arg]
                if have != want:  # the move's backward sums the gradient too (backward_plan)
                    pending = pricing.pending_sum(want, grad)
                    seconds += pricing.move(arg, have, want, self.cluster, pending)
                    continue
            elif arg in self.weight:
                continue  # a parameter owned by another decision node
            in_line, in_bucket = pricing.grad_reduce_parts(
                arg, grad, want, self.cluster, None, arg in self.region.leading
            )
            if self.og[arg].from_state:  # a parameter's sum: once a step, not a micro-batch
                in_line, in_bucket = self.step_share * in_line, self.step_share * in_bucket
            seconds, bucketed = seconds + in_line + in_bucket, bucketed + in_bucket
        return seconds, bucketed, owned

    def decision_node(self, node: fx.Node) -> float:
        """Add a decision node's region under each option; returns its model FLOPs."""
        r = self.index[self.rep.get(node, node)]
        k = self.scale([node])
        own = self.og[node].flops
        follow = [self.og[f].flops for f in self.followers[node]]
        self.weights[r] += k * (own + sum(follow))
        for s, opt in enumerate(options(node, self.mesh)):
            seconds, mem, _, (bucketed, backward), owned = self.region.price(node, opt.strategy)
            if node.op == "call_function":
                seconds, own_bucketed, mine = self.own_inputs(node, opt.strategy, seconds)
                bucketed, owned = bucketed + own_bucketed, owned + tuple(mine)
            for use in owned:  # its step and gradient sum: once a step, not a micro-batch
                self.params.add(self.offsets[r] + s, use, k, self.step_share)
            self.unary[r][s] += k * seconds
            self.memory[r][s] += k * mem
            self.overlap[r][s] += k * bucketed
            self.window[r][s] += k * backward
        return k * own + sum(k * f for f in follow)

    def moves(self, node: fx.Node) -> None:
        """Add the edges from a decision node to the decision nodes that consume its values
        (the layouts of its region's values are its options' prices, made already)."""
        region_opts = options(node, self.mesh)
        edge_terms: dict[fx.Node, np.ndarray] = {}
        for s, opt in enumerate(region_opts):
            for value, layout in self.region.price(node, opt.strategy).values.items():
                for user in value.users:
                    if user not in self.decision or user is node:
                        continue
                    for i, arg in enumerate(tensor_inputs(user)):
                        if arg is not value:
                            continue
                        mat = edge_terms.setdefault(user, _empty(len(region_opts), user, self.mesh))
                        mat[s] += pricing.edge_row(value, layout, user, i, self.mesh, self.cluster)
        for user, mat in edge_terms.items():
            self.add_edge(node, user, mat * self.scale([node, user]))

    def tied_parameters(self) -> None:
        """Parameters shared by two decision nodes (tied weights): an edge between their owners."""
        for p, own in self.owner.items():
            if own in self.weight or p.op != "placeholder":
                continue
            own_src = self.source[own]
            for user in p.users:
                if user is own or user not in self.decision:
                    continue
                mat = _empty(len(options(own_src, self.mesh)), user, self.mesh)
                i = tensor_inputs(user).index(p)
                for s, sopt in enumerate(options(own_src, self.mesh)):
                    stored, own_grad = self.region.stored_layout(p, own, own_src, sopt.strategy)
                    for t, uopt in enumerate(options(user, self.mesh)):
                        want = uopt.strategy.ins[i]
                        mat[s, t] = pricing.move(p, stored, want, self.cluster)
                        mat[s, t] += pricing.tied_grads(
                            p, stored, own_grad, want, uopt.strategy.grads[i], self.cluster
                        )
                self.add_edge(own_src, user, mat * self.scale([own_src, user]))


def _empty(rows: int, user: fx.Node, mesh: MeshInfo) -> np.ndarray:
    return np.zeros((rows, len(options(user, mesh))))


@dataclass(frozen=True)
class Moves:
    """What ``ByZero.moves`` adds to a graph priced without them: the moves
    between decision nodes' options, which depend on the mesh and not on the ZeRO stage
    (the parameters' layouts are the options' own), so one mesh's serve all its stages."""

    edges: dict[tuple[int, int], np.ndarray]
    #: per node and option: moves between instances of one representative (neighbouring
    #: blocks), which land on its own options
    diagonal: list[np.ndarray]


def with_moves(bare: CostGraph, moves: Moves) -> CostGraph:
    """``bare`` (built with ``edges=False``) with a mesh's ``moves``, as if built with them."""
    unary = [u + d for u, d in zip(bare.unary, moves.diagonal, strict=True)]
    return dataclasses.replace(bare, unary=unary, edges=moves.edges)


def build_cost_graph(
    og: OpGraph,
    mesh: MeshInfo,
    cluster: ClusterSpec,
    *,
    zero: int = 0,
    edges: bool = True,
    **how: Any,
) -> CostGraph:
    """The cost graph of ``og`` on ``mesh`` with its parameters at ZeRO stage ``zero``
    (docs/zero.md); ``how``: ``cost_graphs``'s keywords. ``edges=False``: the options' own
    costs only, without the moves between them (most of the pricing; a lower bound still
    holds, since moves cost nothing less than zero)."""
    # one search's caches for the build: outside a search, each lookup of a node's options
    # and of a move's price would otherwise start from nothing, thousands of times a graph
    with search_session():
        priced = cost_graphs(og, mesh, cluster, **how)
        return with_moves(priced.at(zero), priced.moves()) if edges else priced.at(zero)


def cost_graphs(
    og: OpGraph,
    mesh: MeshInfo,
    cluster: ClusterSpec,
    *,
    depth: Mapping[str, int] | None = None,
    group_layers: bool = True,
    optimizer_states: int = ADAM_STATES,
    step_share: float = 1.0,
) -> ByZero:
    """The cost graph of ``og`` on ``mesh`` at every ZeRO stage (``ByZero.at``), priced
    once but for the parameters' terms, and without the moves between the options
    (``ByZero.moves``). ``depth`` prices a repeated block list as if it held more blocks
    than were captured (``{"layers": 80}`` with two blocks captured). ``step_share``: the
    weight of what runs once a step (parameters' gradient sums, the optimizer) against
    what runs once a batch: ``1 / microbatches`` for a pipeline stage's micro-batch."""
    start = time.perf_counter()
    b = _Builder(og, mesh, cluster, depth, group_layers, optimizer_states, step_share)
    constants = b.constants()
    flops = sum(b.decision_node(node) for node in b.order)
    return ByZero(b, constants, flops, time.perf_counter() - start)


class ByZero:
    """A mesh's cost graph priced but for the parameters' terms, which ``at`` adds for one
    ZeRO stage (they are all the stage changes: ``params.ParamTerms``)."""

    def __init__(
        self, b: _Builder, constants: tuple[float, float, float], flops: float, seconds: float
    ) -> None:
        self.b, self.constants, self.flops, self.seconds = b, constants, flops, seconds
        self.made: Moves | None = None

    def moves(self) -> Moves:
        """The moves between the options, priced once (``with_moves`` adds them to a graph
        ``at`` makes: they are the same at every ZeRO stage)."""
        if self.made is None:
            start, b = time.perf_counter(), self.b
            for node in b.order:
                b.moves(node)
            b.tied_parameters()
            self.made = Moves(b.edges, b.diagonal)
            self.seconds += time.perf_counter() - start
        return self.made

    def at(self, zero: int) -> CostGraph:
        """The graph at ZeRO stage ``zero``, without its moves (``with_moves`` adds them)."""
        start, b = time.perf_counter(), self.b
        seconds, memory, bucketed = b.params.at(zero, b.offsets[-1])
        cuts = b.offsets[1:-1]
        const_time, const_memory, const_window = self.constants
        # hidden = e * min(bucketed, backward) = min(e * bucketed, e * backward): the
        # efficiency scales both sides (docs/search.md); a step's gradient sums run beside
        # its last micro-batch's backward only (as the pipeline prices them), so a micro-
        # batch's window is its step share of its backward
        e = b.cluster.overlap_efficiency
        w = e * b.step_share
        return CostGraph(
            mesh=b.mesh,
            names=[n.name for n in b.reps],
            options=b.opts,
            unary=[u + x for u, x in zip(b.unary, np.split(seconds, cuts), strict=True)],
            memory=[m + x for m, x in zip(b.memory, np.split(memory, cuts), strict=True)],
            edges={},
            weight=b.weights,
            instances={n.name: b.rep.get(n, n).name for n in b.order},
            const_time=const_time,
            const_memory=const_memory,
            model_flops=self.flops,
            overlap=[e * (o + x) for o, x in zip(b.overlap, np.split(bucketed, cuts), strict=True)],
            window=[w * x for x in b.window],
            const_window=w * const_window,
            build_seconds=self.seconds + time.perf_counter() - start,
            depth=dict(b.depth) if b.depth else None,
            zero=zero,
        )


__all__ = [
    "ByZero",
    "CostGraph",
    "Moves",
    "build_cost_graph",
    "cost_graphs",
    "with_moves",
]
