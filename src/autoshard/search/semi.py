"""The semi-automatic planner: user strategies for some ops, the rules' defaults for the rest.

It walks the captured graph once, in order. A configured node takes its strategy from the user;
an unconfigured one follows its inputs (docs/strategies.md). Wherever a producer's layout differs
from what its consumer wants, a redistribution is recorded; wherever a consumer's gradient for an
input is a partial sum, a backward reduction is recorded (deferred to one per parameter where the
parameter is used in its stored layout).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from typing import Any

import torch.fx as fx

from autoshard.graph import OpGraph
from autoshard.layout import NOT_SPLIT, Factored, Layout, LayoutError, resplit
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy, StrategyError, node_title, rule_for, tensor_inputs
from autoshard.ops.contraction import Attention
from autoshard.search.plans import NodePlan, ParamPlan, Plan

# -- strategy lookup -------------------------------------------------------------------------------


def _owners(og: OpGraph) -> dict[str, fx.Node]:
    """Module path -> the node that consumes the module's weight (else its first parameter):
    what a strategy keyed by a module path configures."""
    owners: dict[str, fx.Node] = {}
    for p in og.state():
        if p.kind != "param":
            continue
        for name in p.names:
            module, _, leaf = name.rpartition(".")
            if not p.node.users or (leaf != "weight" and module in owners):
                continue
            # A tied weight has several consumers: take the one inside the module itself.
            inside = [u for u in p.node.users if og[u].path == module]
            owners[module] = (inside or list(p.node.users))[0]
    return owners


def match_strategies(
    og: OpGraph, strategies: Mapping[str, Any], strict: bool = True
) -> dict[str, Any]:
    """Node name -> strategy, from keys naming nodes, module paths (glob patterns) or op keys
    (``layers.*.mlp/linear.0``); with ``strict``, a key that matches nothing is an error."""
    owners = _owners(og) if any("/" not in k for k in strategies) else {}
    ops = og.ops()
    out: dict[str, Any] = {}
    for key, value in strategies.items():
        if "/" in key:
            glob, _, op = key.rpartition("/")
            pattern = re.compile(re.escape(glob).replace(r"\*", r"[^.]*"))
            hits = [i.node.name for i in ops if i.op == op and pattern.fullmatch(i.path)]
            if not hits and strict:
                raise StrategyError(f"strategy key '{key}' matches no op")
        else:
            hits = [
                n.name
                for n in og.graph.nodes
                if n.op == "call_function" and fnmatch.fnmatchcase(n.name, key)
            ]
            hits += [owners[m].name for m in owners if fnmatch.fnmatchcase(m, key)]
            if not hits and strict:
                raise StrategyError(
                    f"strategy key '{key}' matches no node and no module with parameters "
                    f"(modules: {', '.join(sorted(owners)[:8])}...)"
                )
        for hit in hits:
            out[hit] = value
    return out


def _is_tuple_form(value: Any) -> bool:
    return all(
        isinstance(t, tuple | list) and all(isinstance(e, int) for e in t) for t in value
    ) and not any(isinstance(e, Factored) for t in value for e in t)


def _configured(node: fx.Node, value: Any, mesh: MeshInfo) -> Strategy:
    rule = rule_for(node)
    if isinstance(value, Strategy):
        return value
    if isinstance(value, Mapping) and "space" in value:
        space = rule.space(node)
        if space is None:
            raise StrategyError(f"{node_title(node)}: this op has no iteration space")
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in value["space"])
        if len(spec) != len(space.sizes):
            raise StrategyError(
                f"{node_title(node)}: space strategy {spec} has {len(spec)} entries but the "
                f"op's iteration space has {len(space.sizes)} dims {space.sizes}"
            )
        return rule.from_space(node, spec, mesh)
    if not isinstance(value, tuple | list):
        raise StrategyError(f"{node_title(node)}: strategy {value!r} is not a tuple of tuples")
    if _is_tuple_form(value):
        return rule.from_tuple(node, value, mesh.num_devices)
    return rule.from_named(node, value, mesh.as_dict())


# -- the walk --------------------------------------------------------------------------------------


def _default_input(
    og: OpGraph, node: fx.Node, mesh: MeshInfo, sequence_parallel: bool = False
) -> Layout:
    """An input's batch dim (0) split over the data-parallel axes and its sequence dim (1)
    over the context-parallel ones (and, under sequence parallelism, the tensor-parallel
    ones). A dim of the batch's size (or the sequence's) that its axes do not divide is an
    error, since the mesh asked for that split; an input of other sizes (a mask of one
    sequence) is taken whole."""
    shape, dtype = og[node].shape, og[node].dtype
    batch, length = _leading(og)
    spec: list[Any] = [None] * len(shape)
    if _splits(node.name, shape, 0, mesh.dp, mesh, batch):
        spec[0] = mesh.dp
    seq = mesh.cp + (tensor_axes(mesh) if sequence_parallel else ())
    if _splits(node.name, shape, 1, seq, mesh, length):
        spec[1] = seq
    if all(s is None for s in spec):
        return Layout.replicated(shape, mesh.num_devices, dtype=dtype)
    return Layout.from_named(shape, spec, mesh.as_dict(), dtype=dtype)


def check_inputs(og: OpGraph, mesh: MeshInfo) -> None:
    """A mesh given to a search: a batch its data-parallel axes (a sequence its context-
    parallel ones) cannot split is the error ``plan_graph`` gives, not an input fed whole."""
    for node in og.graph.nodes:
        if node.op == "placeholder" and og[node].kind == "input":
            _default_input(og, node, mesh)


def _leading(og: OpGraph) -> tuple[int | None, int | None]:
    """The batch size and the sequence length: dims 0 and 1 of the first input having them."""
    shapes = [
        og[n].shape for n in og.graph.nodes if n.op == "placeholder" and og[n].kind == "input"
    ]
    batch = next((s[0] for s in shapes if len(s) >= 1), None)
    return batch, next((s[1] for s in shapes if len(s) >= 2), None)


def _splits(
    name: str, shape: tuple, dim: int, axes: tuple[str, ...], mesh: MeshInfo, size: int | None
) -> bool:
    """Whether input ``name``'s ``dim`` is split over ``axes``."""
    if not axes or len(shape) <= dim:
        return False
    n = mesh.size_of(axes)
    if shape[dim] % n == 0:
        return True
    if shape[dim] == size:
        what = "batch" if dim == 0 else "sequence"
        raise StrategyError(
            f"input {name} dim {dim} ({what}, size {shape[dim]}): not divisible by its split "
            f"{n} over axis {'*'.join(axes)} of mesh {mesh.describe()}; give a {what} that "
            f"{n} divides, or a mesh without that axis"
        )
    return False


def tensor_axes(mesh: MeshInfo) -> tuple[str, ...]:
    """The mesh's tensor-parallel axes (``tp``, ``tp_*``): what sequence parallelism splits
    the sequence over between them."""
    return tuple(n for n in mesh.names if n == "tp" or n.startswith("tp_"))


class _Walk:
    """The state of one pass over the graph: every value's layouts, the parameters' stored
    layouts, and the parameter uses whose gradient sum may be deferred to one per parameter."""

    def __init__(
        self,
        og: OpGraph,
        mesh: MeshInfo,
        configured: dict[str, Any],
        attention: str | None,
        sequence_parallel: bool = False,
    ) -> None:
        self.og, self.mesh, self.configured = og, mesh, configured
        self.attention, self.sequence_parallel = attention, sequence_parallel
        #: the layout an op's readers take its value in when not its own (after Ulysses)
        self.preferred: dict[fx.Node, Layout] = {}
        self.layouts: dict[fx.Node, list[Layout | None]] = {}
        self.stored: dict[fx.Node, Layout] = {}
        self.nodes: dict[str, NodePlan] = {}
        self.inputs: dict[str, Layout] = {}
        self.deferred: dict[fx.Node, list[tuple[NodePlan, int, Layout]]] = {}
        self.at_params: dict[str, tuple[Layout, Layout, str]] = {}
        self.riders: dict[fx.Node, list[tuple[str, Layout, Layout]]] = {}  # ``_to_params``
        self.warnings: list[str] = []

    def placeholder(self, node: fx.Node, input_layouts: Mapping, param_layouts: Mapping) -> None:
        info = self.og[node]
        if info.kind == "input":
            layout = input_layouts.get(node.name) or _default_input(
                self.og, node, self.mesh, self.sequence_parallel
            )
            self.inputs[node.name] = layout
            self.layouts[node] = [layout]
            return
        if info.fqn in param_layouts:
            self.stored[node] = param_layouts[info.fqn]
        self.layouts[node] = [self.stored.get(node)]

    def op(self, node: fx.Node) -> None:
        args = tensor_inputs(node)
        ins = [
            self.preferred.get(a) or (self.layouts[a][0] if a in self.layouts else None)
            for a in args
        ]
        configured = node.name in self.configured
        if self.sequence_parallel and not configured:
            ins = [self._scattered(a, layout) for a, layout in zip(args, ins, strict=True)]
        rule = rule_for(node)
        try:
            if configured:
                strategy = _configured(node, self.configured[node.name], self.mesh)
            else:
                strategy = rule.follow(node, ins, self.mesh)
                if self.attention is not None and isinstance(rule, Attention):
                    strategy, hint = rule.as_method(node, strategy, self.attention)
                    if hint is not None:
                        self.preferred[node] = hint
        except LayoutError as err:
            raise StrategyError(f"{node_title(node)}: {err}") from None
        plan = NodePlan(node.name, str(node.target), self.og[node].where, strategy, configured)
        if strategy.replicated_fallback:
            self.warnings.append(f"{node_title(node)} has no rule: it runs replicated")
        for i, (arg, want) in enumerate(zip(args, strategy.ins, strict=True)):
            self._input(plan, i, arg, want, strategy.grads[i])
        self.layouts[node] = list(strategy.outs)
        self.nodes[node.name] = plan

    def _scattered(self, arg: fx.Node, layout: Layout | None) -> Layout | None:
        """Sequence parallelism: an activation pending a sum (a row-split linear's output, a
        split vocabulary's lookup) is taken summed and split by sequence (dim 1) over the
        axes it is pending on, one reduce-scatter, where it would be all-reduced; the ops
        after it follow the split until a linear configured to read it whole gathers it."""
        if layout is None or not layout.partial or self.og[arg].is_state:
            return layout
        shape = layout.shape
        axes = sorted(layout.partial)
        n = math.prod(layout.mesh[a] for a in axes)
        if len(shape) < 3 or shape[1] % n or any(a != NOT_SPLIT for _, a in layout.factors[1]):
            return layout
        split = (*((layout.mesh[a], a) for a in axes), (shape[1] // n, NOT_SPLIT))
        return resplit(layout, {1: split}, partial=())

    def _input(self, plan: NodePlan, i: int, arg: fx.Node, want: Layout, grad: Layout) -> None:
        info = self.og[arg]
        if info.is_state and arg not in self.stored:
            self.stored[arg] = want.without_partial()
            self.layouts[arg] = [self.stored[arg]]
        if self.layouts[arg][0] != want:
            plan.moves[i] = (self.layouts[arg][0], want)
        if grad == want.without_partial() or not info.requires_grad:
            return
        if i in plan.moves:
            plan.grad_reduce[i] = (grad, want.without_partial())
        else:  # summed at a parameter where it can be (``_to_params``), else in line
            self.deferred.setdefault(arg, []).append((plan, i, grad))

    def _to_params(self) -> None:
        """Sums pending on an op's outputs (last op first) go on to its one input that needs a
        gradient where ``_onto`` allows (a weight split into q and kv, an embedding's weight):
        backward is linear, so that input's gradient is partial over the same axes, and a
        parameter's is summed once in a bucket beside backward (``params``); else in line."""
        for node in (n for n in reversed(self.og.graph.nodes) if self.og[n].kind == "op"):
            outs = [node, *(u for u in node.users if self.og[u].kind == "getitem")]
            uses = [(v, use) for v in outs for use in self.deferred.pop(v, [])]
            riders = [r for v in outs for r in self.riders.pop(v, [])]
            riders += [(v.name, g, p.strategy.ins[i].without_partial()) for v, (p, i, g) in uses]
            onto = self._onto(node, outs, uses) if uses else None
            for _, (plan, i, grad) in uses if onto is None else ():
                plan.grad_reduce[i] = (grad, plan.strategy.ins[i].without_partial())
            if onto is not None:
                arg = tensor_inputs(node)[onto[0]]
                self.deferred.setdefault(arg, []).append((self.nodes[node.name], *onto))
                self.riders.setdefault(arg, []).extend(riders)

    def _onto(self, node: fx.Node, outs: list[fx.Node], uses: list) -> tuple[int, Layout] | None:
        """(input, its partial gradient) for ``_to_params``: the op's one input that needs a
        gradient, made from parameters alone, when every reader leaves the same axes pending on
        its layout and the op runs alike on their ranks (no move, no sum of its own); or None."""
        args, og = tensor_inputs(node), self.og
        needs = [og[a].requires_grad for a in args]
        reads = sum(
            1
            for v in outs
            for u in v.users
            if og[u].kind != "getitem"
            for a in tensor_inputs(u)
            if a is v
        )
        axes = {g.partial for _, (_, _, g) in uses}
        if needs.count(True) != 1 or reads != len(uses) or len(axes) != 1:
            return None
        (axes,), j, plan = axes, needs.index(True), self.nodes[node.name]
        have = plan.strategy.ins[j].without_partial()
        if not og[args[j]].from_state or j in plan.moves or plan.strategy.grads[j] != have:
            return None
        if any(a in axes for f in have.factors for _, a in f):
            return None
        for _, (reader, i, g) in uses:  # partial axes: positions in the same mesh
            same = (g.mesh, g.ranks) == (have.mesh, have.ranks)
            if not same or g.without_partial() != reader.strategy.ins[i]:
                return None
        return j, resplit(have, {}, partial=axes)

    def params(self) -> dict[str, ParamPlan]:
        """Each parameter's stored layout and, when every use needs the same sum of a gradient
        in the stored layout, that sum deferred to one per parameter."""
        self._to_params()
        params: dict[str, ParamPlan] = {}
        for info in self.og.state():
            node = info.node
            if node not in self.stored:
                if not node.users and len(self.og.aliases.get(info.fqn, ())) > 1:
                    continue  # a tied name whose storage is another placeholder
                self.stored[node] = Layout.replicated(
                    info.shape, self.mesh.num_devices, dtype=info.dtype
                )
            uses = self.deferred.get(node, [])
            grads = {g for _, _, g in uses}
            uses_all = sum(1 for u in node.users for a in tensor_inputs(u) if a is node)
            plan = ParamPlan(info.fqn, self.stored[node])
            if len(grads) == 1 and len(uses) == uses_all:
                plan.grad_partial, plan.from_value = grads.pop(), node in self.riders
                self.at_params.update({r[0]: (*r[1:], info.fqn) for r in self.riders.get(node, ())})
            else:
                for node_plan, i, grad in uses:
                    node_plan.grad_reduce[i] = (grad, node_plan.strategy.ins[i])
            params[info.fqn] = plan
        return params

    def share_moves(self) -> None:
        """A value several readers move alike (the same layouts and gradient sum: a norm's
        output gathered for column-split q, k and v under sequence parallelism) is moved once:
        the later readers take the first one's result (``NodePlan.reuses``), and its backward
        sums all their gradient parts at once."""
        first: dict[tuple, str] = {}
        for plan in self.nodes.values():
            node = self.og.by_name[plan.node]
            args = tensor_inputs(node)
            for i, (src, dst) in plan.moves.items():
                key = (args[i], src, dst, plan.grad_source(i))
                if key in first:
                    plan.reuses[i] = first[key]
                else:
                    first[key] = plan.node

    def share_reductions(self) -> dict[str, tuple[Layout, Layout]]:
        """Values every reader of which needs the same sum of its gradient part, with no move
        in between: one sum, once autograd has added the parts (the input of column-split q, k
        and v: one all-reduce, not three), taken off the readers."""
        shared: dict[str, tuple[Layout, Layout]] = {}
        for node in self.og.graph.nodes:
            if node.op == "placeholder" or not self.og[node].requires_grad:
                continue
            uses = [
                (self.nodes.get(user.name), i)
                for user in node.users
                for i, arg in enumerate(tensor_inputs(user))
                if arg is node
            ]
            if len(uses) < 2 or any(p is None or i in p.moves for p, i in uses):
                continue
            if any(u.op == "output" for u in node.users):
                continue
            sums = {p.grad_reduce.get(i) for p, i in uses}
            if len(sums) != 1 or None in sums:
                continue
            for p, i in uses:
                del p.grad_reduce[i]
            shared[node.name] = sums.pop()
        return shared

    def outputs(self, out_node: fx.Node) -> list[tuple[Layout, Layout]]:
        """Outputs go back to whole tensors; buffer updates to their buffer's layout."""
        by_fqn = {self.og[n].fqn: n for n in self.stored}
        moves = []
        for i, value in enumerate(out_node.args[0]):
            src = self.layouts[value][0]
            if i in self.og.mutations:
                dst = self.stored[by_fqn[self.og.mutations[i]]]
            else:
                dst = Layout.replicated(src.shape, self.mesh.num_devices, dtype=src.dtype)
            moves.append((src, dst))
        return moves


def plan_graph(
    og: OpGraph,
    mesh: MeshInfo,
    strategies: Mapping[str, Any] | None = None,
    *,
    input_layouts: Mapping[str, Layout] | None = None,
    param_layouts: Mapping[str, Layout] | None = None,
    strict: bool = True,
    attention: str | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """Plan every node of ``og`` on ``mesh`` (``param_layouts`` pins stored layouts, as the eval
    graph must share the train graph's parameters). ``attention``: how an attention not
    configured computes query rows split by sequence (``ATTENTION_METHODS``; default every
    key gathered). ``sequence_parallel``: the values pending a sum over tensor-parallel axes
    are reduce-scattered by sequence and stay split until a configured op reads them
    (Megatron's sequence parallelism; docs/parallelism/sequence.md)."""
    configured = match_strategies(og, strategies or {}, strict)
    walk = _Walk(og, mesh, configured, attention, sequence_parallel)
    out_node = None
    for node in og.graph.nodes:
        if node.op == "placeholder":
            walk.placeholder(node, input_layouts or {}, param_layouts or {})
        elif node.op == "output":
            out_node = node
        elif og[node].kind == "getitem":
            walk.layouts[node] = [walk.layouts[node.args[0]][node.args[1]]]
        else:
            walk.op(node)
    params = walk.params()
    outputs = walk.outputs(out_node)
    walk.share_moves()
    shared = walk.share_reductions()
    nodes, inputs = walk.nodes, walk.inputs
    return Plan(
        mesh,
        nodes,
        params,
        inputs,
        outputs,
        walk.warnings,
        shared_reduce=shared,
        graph=og,
        summed_at_params=walk.at_params,
    )


__all__ = ["check_inputs", "match_strategies", "plan_graph"]
