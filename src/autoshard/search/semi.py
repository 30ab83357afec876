"""The semi-automatic planner: user strategies for some ops, the rules' defaults for the rest.

It walks the captured graph once, in order. A configured node takes its strategy from the user;
an unconfigured one follows its inputs (docs/strategies.md). Wherever a producer's layout differs
from what its consumer wants, a redistribution is recorded; wherever a consumer's gradient for an
input is a partial sum, a backward reduction is recorded (deferred to one per parameter where the
parameter is used in its stored layout).
"""

from __future__ import annotations

import fnmatch
import hashlib
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autoshard.graph.capture import Captured, module_path
from autoshard.layout import Factored, Layout, LayoutError
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy, StrategyError, node_title, rule_for, tensor_inputs
from autoshard.ops.base import shape_of
from autoshard.redistribution import redistribution_plan


@dataclass
class NodePlan:
    node: str
    target: str
    module: str
    strategy: Strategy
    configured: bool
    moves: dict[int, tuple[Layout, Layout]] = field(default_factory=dict)
    grad_reduce: dict[int, tuple[Layout, Layout]] = field(default_factory=dict)

    def forward_bytes(self) -> int:
        return sum(redistribution_plan(s, d).bytes for s, d in self.moves.values())

    def backward_bytes(self) -> int:
        total = sum(
            redistribution_plan(d.without_partial(), s.without_partial()).bytes
            for s, d in self.moves.values()
        )
        return total + sum(redistribution_plan(p, f).bytes for p, f in self.grad_reduce.values())


@dataclass
class ParamPlan:
    fqn: str
    layout: Layout
    grad_partial: Layout | None = None  # deferred reduction: gradient layout before the sum


@dataclass
class Plan:
    mesh: MeshInfo
    nodes: dict[str, NodePlan]
    params: dict[str, ParamPlan]
    inputs: dict[str, Layout]
    outputs: list[tuple[Layout, Layout]]
    warnings: list[str]
    #: set by the automatic search: the plan as JSON (docs/search.md) and its predicted cost
    auto: dict[str, Any] | None = None
    predicted: Any = None

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256("\n".join(self.digests()).encode()).hexdigest()[:16]

    def digests(self) -> list[str]:
        """One line per decision, what ranks compare before the first collective."""
        lines = [f"mesh {self.mesh}"]
        lines += [f"input {k} {v!r}" for k, v in self.inputs.items()]
        lines += [f"param {k} {p.layout!r} {p.grad_partial!r}" for k, p in self.params.items()]
        lines += [
            f"node {n.node} {n.target} {n.strategy.ins!r} {n.strategy.outs!r}"
            for n in self.nodes.values()
        ]
        return lines

    def __str__(self) -> str:
        return format_plan(self)


def _mesh_desc(mesh: MeshInfo) -> str:
    return " x ".join(f"{n}({s})" for n, s in zip(mesh.names, mesh.sizes, strict=True))


def format_plan(plan: Plan) -> str:
    rows = [("op", "module", "strategy", "in -> out", "communication", "bytes/rank fwd+bwd")]
    for n in plan.nodes.values():
        if not (n.configured or n.moves or n.grad_reduce or n.strategy.replicated_fallback):
            continue
        comm = [
            f"in{i}: " + "+".join(s.kind for s in redistribution_plan(a, b).steps)
            for i, (a, b) in n.moves.items()
        ]
        comm += [f"in{i} grad: all_reduce" for i in n.grad_reduce]
        ins = ",".join(str(x) for x in n.strategy.ins)
        outs = ",".join(str(x) for x in n.strategy.outs if x is not None)
        mark = "*" if n.configured else ""
        rows.append(
            (
                f"{n.node}{mark}",
                n.module,
                n.strategy.describe(),
                f"{ins} -> {outs}",
                "; ".join(comm) or "-",
                f"{n.forward_bytes()}+{n.backward_bytes()}",
            )
        )
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    lines = [f"plan on mesh {_mesh_desc(plan.mesh)} ({plan.mesh.num_devices} devices)"]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    deferred = [p for p in plan.params.values() if p.grad_partial is not None]
    if deferred:
        grad_bytes = sum(redistribution_plan(p.grad_partial, p.layout).bytes for p in deferred)
        lines.append(f"gradient reduction: {len(deferred)} parameters, {grad_bytes} bytes/rank")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append("(* configured by the user)")
    return "\n".join(lines)


# -- strategy lookup -------------------------------------------------------------------------------


def match_strategies(
    captured: Captured, strategies: Mapping[str, Any], strict: bool = True
) -> dict[str, Any]:
    """Node name -> strategy, from keys naming nodes or module paths (glob patterns); with
    ``strict``, a key that matches nothing is an error."""
    nodes = [n for n in captured.graph.nodes if n.op == "call_function"]
    params = [n for n in captured.graph.nodes if n.meta.get("autoshard_kind") == "param"]
    owners: dict[str, fx.Node] = {}
    for p in params:
        for name in captured.aliases.get(p.meta["autoshard_fqn"], [p.meta["autoshard_fqn"]]):
            module, _, leaf = name.rpartition(".")
            if not p.users or (leaf != "weight" and module in owners):
                continue
            # A tied weight has several consumers: take the one inside the module itself.
            inside = [u for u in p.users if module_path(u) == module]
            owners[module] = (inside or list(p.users))[0]
    out: dict[str, Any] = {}
    op_keys = op_key_parts(captured) if any("/" in k for k in strategies) else {}
    for key, value in strategies.items():
        if "/" in key:
            glob, _, op = key.rpartition("/")
            pattern = re.compile(re.escape(glob).replace(r"\*", r"[^.]*"))
            hits = [
                n for n, (path, name) in op_keys.items() if name == op and pattern.fullmatch(path)
            ]
            if not hits and strict:
                raise StrategyError(f"strategy key '{key}' matches no op")
            for hit in hits:
                out[hit] = value
            continue
        hits = [n.name for n in nodes if fnmatch.fnmatchcase(n.name, key)]
        hits += [owners[m].name for m in owners if fnmatch.fnmatchcase(m, key)]
        if not hits and strict:
            raise StrategyError(
                f"strategy key '{key}' matches no node and no module with parameters "
                f"(modules: {', '.join(sorted(owners)[:8])}...)"
            )
        for hit in hits:
            out[hit] = value
    return out


def op_key_parts(captured: Captured) -> dict[str, tuple[str, str]]:
    """Node name -> (module path, ``<op>.<k>``): the k-th call of that aten op made directly by
    that module (the root module's path is empty). Stable across depths and modes."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for node in captured.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        path = module_path(node)
        path = "" if path == "the model" else path
        op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        k = seen.get((path, op), 0)
        seen[(path, op)] = k + 1
        out[node.name] = (path, f"{op}.{k}")
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
        return rule.layouts(node, Layout.from_named(space.sizes, spec, mesh.as_dict()))
    if not isinstance(value, tuple | list):
        raise StrategyError(f"{node_title(node)}: strategy {value!r} is not a tuple of tuples")
    if _is_tuple_form(value):
        return rule.from_tuple(node, value, mesh.num_devices)
    return rule.from_named(node, value, mesh.as_dict())


# -- the walk --------------------------------------------------------------------------------------


def _default_input(node: fx.Node, mesh: MeshInfo) -> Layout:
    shape = shape_of(node)
    dtype = node.meta["val"].dtype
    if mesh.dp and shape and shape[0] % mesh.size_of(mesh.dp) == 0:
        spec = [mesh.dp] + [None] * (len(shape) - 1)
        return Layout.from_named(shape, spec, mesh.as_dict(), dtype=dtype)
    return Layout.replicated(shape, mesh.num_devices, dtype=dtype)


def plan_graph(
    captured: Captured,
    mesh: MeshInfo,
    strategies: Mapping[str, Any] | None = None,
    *,
    input_layouts: Mapping[str, Layout] | None = None,
    param_layouts: Mapping[str, Layout] | None = None,
    strict: bool = True,
) -> Plan:
    """Plan every node of ``captured`` on ``mesh`` (``param_layouts`` pins stored layouts, as
    the eval graph must share the train graph's parameters)."""
    configured = match_strategies(captured, strategies or {}, strict)
    layouts: dict[fx.Node, list[Layout | None]] = {}
    stored: dict[fx.Node, Layout] = {}
    nodes: dict[str, NodePlan] = {}
    inputs: dict[str, Layout] = {}
    deferred: dict[fx.Node, list[tuple[NodePlan, int, Layout]]] = {}
    warnings = []
    for node in captured.graph.nodes:
        if node.op == "placeholder":
            kind = node.meta["autoshard_kind"]
            if kind == "input":
                layout = (input_layouts or {}).get(node.name) or _default_input(node, mesh)
                inputs[node.name] = layout
                layouts[node] = [layout]
            else:
                fqn = node.meta["autoshard_fqn"]
                if param_layouts and fqn in param_layouts:
                    stored[node] = param_layouts[fqn]
                layouts[node] = [stored.get(node)]
            continue
        if node.op == "output":
            continue
        if node.target is operator.getitem:
            layouts[node] = [layouts[node.args[0]][node.args[1]]]
            continue
        args = tensor_inputs(node)
        ins = [layouts[a][0] if a in layouts else None for a in args]
        try:
            if node.name in configured:
                strategy = _configured(node, configured[node.name], mesh)
            else:
                strategy = rule_for(node).follow(node, ins, mesh)
        except LayoutError as err:
            raise StrategyError(f"{node_title(node)}: {err}") from None
        plan = NodePlan(
            node.name,
            str(node.target),
            module_path(node),
            strategy,
            node.name in configured,
        )
        if strategy.replicated_fallback:
            warnings.append(f"{node_title(node)} has no rule: it runs replicated")
        for i, (arg, want) in enumerate(zip(args, strategy.ins, strict=True)):
            if arg.op == "placeholder" and arg.meta["autoshard_kind"] != "input":
                if arg not in stored:
                    stored[arg] = want.without_partial()
                    layouts[arg] = [stored[arg]]
            src = layouts[arg][0]
            if src != want:
                plan.moves[i] = (src, want)
            grad = strategy.grads[i]
            is_buffer = arg.meta.get("autoshard_kind") == "buffer"
            if grad != want.without_partial() and _differentiable(arg) and not is_buffer:
                if (
                    arg.op == "placeholder"
                    and arg.meta["autoshard_kind"] == "param"
                    and i not in (plan.moves)
                ):
                    deferred.setdefault(arg, []).append((plan, i, grad))
                else:
                    plan.grad_reduce[i] = (grad, want.without_partial())
        layouts[node] = list(strategy.outs)
        nodes[node.name] = plan
    params = _param_plans(captured, stored, deferred, mesh)
    outputs = _output_moves(captured, layouts, stored, mesh)
    return Plan(mesh, nodes, params, inputs, outputs, warnings)


def _differentiable(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.is_complex())


def _param_plans(
    captured: Captured,
    stored: dict[fx.Node, Layout],
    deferred: dict[fx.Node, list[tuple[NodePlan, int, Layout]]],
    mesh: MeshInfo,
) -> dict[str, ParamPlan]:
    params: dict[str, ParamPlan] = {}
    for node in captured.graph.nodes:
        if node.op != "placeholder" or node.meta["autoshard_kind"] == "input":
            continue
        fqn = node.meta["autoshard_fqn"]
        if node not in stored:
            if not node.users and fqn in captured.aliases and len(captured.aliases[fqn]) > 1:
                continue  # a tied name whose storage is another placeholder
            stored[node] = Layout.replicated(
                shape_of(node), mesh.num_devices, dtype=node.meta["val"].dtype
            )
        uses = deferred.get(node, [])
        grads = {g for _, _, g in uses}
        uses_all = sum(1 for u in node.users for a in tensor_inputs(u) if a is node)
        plan = ParamPlan(fqn, stored[node])
        if len(grads) == 1 and len(uses) == uses_all:
            plan.grad_partial = grads.pop()
        else:
            for node_plan, i, grad in uses:
                node_plan.grad_reduce[i] = (grad, node_plan.strategy.ins[i])
        params[fqn] = plan
    return params


def _output_moves(
    captured: Captured,
    layouts: dict[fx.Node, list[Layout | None]],
    stored: dict[fx.Node, Layout],
    mesh: MeshInfo,
) -> list[tuple[Layout, Layout]]:
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    by_fqn = {n.meta.get("autoshard_fqn"): n for n in stored}
    moves = []
    for i, value in enumerate(out_node.args[0]):
        src = layouts[value][0]
        if i in captured.mutations:
            dst = stored[by_fqn[captured.mutations[i]]]
        else:
            dst = Layout.replicated(src.shape, mesh.num_devices, dtype=src.dtype)
        moves.append((src, dst))
    return moves


__all__ = ["NodePlan", "ParamPlan", "Plan", "format_plan", "match_strategies", "plan_graph"]
