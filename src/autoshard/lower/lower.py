"""Lowering: the captured graph and its plan -> the torch.fx GraphModule one rank runs.

The rank's module reads only its parameter shards, runs each aten op on local tensors (shape
arguments rewritten to local shapes by the op's rule), and calls small submodules where the plan
inserts communication, so ``print(gm.code)`` reads as the rank's program.
"""

from __future__ import annotations

import itertools
import operator
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.graph import OpGraph, StageCut
from autoshard.layout import NOT_SPLIT, Layout
from autoshard.lower.recompute import TAG, Wrap, with_recompute
from autoshard.ops import local, rule_for, tensor_inputs
from autoshard.ops.regather import Gathered, regathered_linear, regathers
from autoshard.redistribution import backward_plan, execute, redistribute, redistribution_plan
from autoshard.search import Plan


@dataclass
class RunState:
    """What changes between calls of the same program: the dropout seed and step, and the
    micro-batch a pipeline stage runs (its elements' place in the whole batch)."""

    seed: int = 0
    step: int = 0
    microbatch: int = 0


class Redistribute(nn.Module):
    """A move; ``grad``: the reader's partial gradient, summed by the move's backward."""

    def __init__(self, src: Layout, dst: Layout, grad: Layout | None = None) -> None:
        super().__init__()
        self.src, self.dst, self.grad = src, dst, grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return redistribute(x, self.src, self.dst, self.grad)

    def extra_repr(self) -> str:
        text = f"{self.src} -> {self.dst}: {redistribution_plan(self.src, self.dst)}"
        if self.grad is not None:
            text += f"; backward from {self.grad}: {backward_plan(self.src, self.dst, self.grad)}"
        return text


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, partial: Layout, full: Layout) -> torch.Tensor:
        ctx.layouts = (partial, full)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        partial, full = ctx.layouts
        plan = redistribution_plan(partial.with_dtype(grad.dtype), full.with_dtype(grad.dtype))
        return execute(grad, plan, torch.distributed.get_rank()), None, None


class ReduceGrad(nn.Module):
    """Identity forward; backward sums the partial gradient (Megatron's ``f``)."""

    def __init__(self, partial: Layout, full: Layout) -> None:
        super().__init__()
        self.partial, self.full = partial, full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceGrad.apply(x, self.partial, self.full)

    def extra_repr(self) -> str:
        return f"grad {self.partial} -> {self.full}"


class Dropout(nn.Module):
    """native_dropout on a shard with the single device's mask (keyed by global index). The
    mask is made on the shard's device each call from the layout's per-dim ranges: nothing
    the size of the activation is kept between calls."""

    def __init__(self, p: float, train: bool, layout: Layout, rank: int, op: int, state: RunState):
        super().__init__()
        self.p, self.train_flag, self.op, self.state = p, train, op, state
        self.layout, self.rank = layout, rank
        self.where = layout.local_index(rank)  # a range (or a dim's few indices) per dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = local.dropout_key(self.state.seed, self.state.step, self.op)
        # micro-batch i of a batch cut along dim 0 follows i others
        offset = self.state.microbatch * self.layout.global_numel
        return local.dropout(x, self.p, self.train_flag, self.where, self.layout.shape, key, offset)

    def extra_repr(self) -> str:
        return f"p={self.p}, op={self.op}, {self.layout}"


class RegatheredLinear(nn.Module):
    """A linear that keeps its input's part for backward, which gathers it again
    (``ops/regather.py``: sequence parallelism's column-split linears)."""

    def __init__(self, gathered: Gathered) -> None:
        super().__init__()
        self.gathered = gathered

    def forward(
        self, whole: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, bias: Any
    ) -> torch.Tensor:
        return regathered_linear(whole, part, weight, bias, self.gathered)

    def extra_repr(self) -> str:
        return f"gathered again in backward: {self.gathered.src} -> {self.gathered.dst}"


@dataclass(frozen=True)
class _Fetched:
    """A parameter the program gets by calling ``source`` (not yet called)."""

    source: nn.Module
    fqn: str


def attr_name(fqn: str) -> str:
    return fqn.replace(".", "__")


class _Lowerer:
    def __init__(self, plan: Plan, rank: int, device: torch.device, state: RunState) -> None:
        self.plan, self.rank, self.device, self.state = plan, rank, device, state
        self.graph = fx.Graph()
        self.root = nn.Module()
        self._count = itertools.count()
        self.env: dict[fx.Node, Any] = {}
        #: moved values by (value, source, target, gradient summed): a later reader's move of
        #: the same value alike (``NodePlan.reuses``) takes the first one's
        self.moved: dict[tuple, fx.Node] = {}
        #: the moves gathered again in backward, by the same key, and their readers so far
        self.gathered: dict[tuple, Gathered] = {}

    def value(self, node: fx.Node) -> Any:
        """What the program holds for ``node``; a parameter read through a module (a ZeRO
        gather) is called here, just before its first reader, not where the graph lists it."""
        v = self.env[node]
        if isinstance(v, _Fetched):
            v = self.env[node] = self.module(v.source, (), f"fetch_{attr_name(v.fqn)}")
        return v

    def call(self, target: Any, args: Any, kwargs: dict) -> fx.Node:
        return self.graph.call_function(target, tuple(args), kwargs)

    def module(self, module: nn.Module, args: tuple, hint: str) -> fx.Node:
        name = f"{hint}_{next(self._count)}"
        self.root.add_module(name, module)
        return self.graph.call_module(name, args)

    def group(self, space: Layout, dims: list[int]) -> list[int]:
        """The ranks that share this rank's coordinates except on the axes splitting ``dims``."""
        axes = sorted({a for d in dims for _, a in space.factors[d] if a != NOT_SPLIT})
        coords = list(space.coordinates(self.rank))
        members = []
        for combo in itertools.product(*[range(space.mesh[a]) for a in axes]):
            for a, v in zip(axes, combo, strict=True):
                coords[a] = v
            position = 0
            for c, size in zip(coords, space.mesh, strict=True):
                position = position * size + c
            members.append(space.ranks[position])
        return members

    def dropout(self, node: fx.Node, x: fx.Node, p: float, train: bool, layout: Layout) -> fx.Node:
        op = zlib.crc32(node.name.encode())
        return self.module(Dropout(p, train, layout, self.rank, op, self.state), (x,), "dropout")


def _replace(value: Any, new: list[Any]) -> Any:
    """``value`` with its fx nodes replaced, in tensor_inputs order, by ``new`` (consumed)."""
    if isinstance(value, fx.Node):
        return new.pop(0)
    if isinstance(value, list | tuple):
        return type(value)(_replace(v, new) for v in value)
    return value


def lower(
    og: OpGraph,
    plan: Plan,
    rank: int,
    device: torch.device,
    tensors: dict[str, torch.Tensor],
    state: RunState,
    stage: tuple[StageCut, int] | None = None,
    recompute: str | dict[str, str] = "none",
    weights: bool = False,
    wrap: Wrap | None = None,
) -> fx.GraphModule:
    """The rank's program; ``tensors`` holds its parameter and buffer shards by name, or a
    module that returns the parameter's local tensor when called (ZeRO's gather).
    ``stage`` (a cut and a stage of it): the program of that pipeline stage only, taking the
    model's inputs and then the values it receives (``cut.receives``), and returning the
    values it sends (``cut.sends``), or the model's outputs from the last stage.
    ``recompute``: which repeated blocks backward runs again (``lower/recompute.py``).
    ``weights`` (with ``stage``): the program also returns, after those, the (first) output
    of every op of the stage that reads a parameter (``weight_readers``), where a backward
    split in two finds the gradients its weight half starts from. ``wrap``: a module glob and
    what wraps each block it matches (``lower/recompute.py``; the activation offload)."""
    low = _Lowerer(plan, rank, device, state)
    for fqn, tensor in tensors.items():
        if isinstance(tensor, nn.Parameter):
            low.root.register_parameter(attr_name(fqn), tensor)
        elif not isinstance(tensor, nn.Module):
            low.root.register_buffer(attr_name(fqn), tensor)
    received = _placeholders(low, og, stage)
    tagging = recompute != "none" or wrap is not None
    for node in og.graph.nodes:
        if og[node].kind == "input" or node.name in received:
            continue
        if stage is not None and not _in_stage(og, node, *stage):
            continue
        before = len(low.graph.nodes)
        if node.op == "output":
            _output(low, og, node, stage, weights)
        elif node.op == "placeholder":
            _param(low, og, node, tensors)
        else:
            low.env[node] = _op(low, og, node)
            if isinstance(low.env[node], fx.Node):  # what runs the program can find it by
                low.env[node].meta.setdefault("captured", node.name)
        if node.name in plan.shared_reduce:  # one sum for all readers' gradient parts
            reduce = ReduceGrad(*plan.shared_reduce[node.name])
            low.env[node] = low.module(reduce, (low.value(node),), "reduce_grad")
        if tagging:
            _tag(low.graph, len(low.graph.nodes) - before, _block_of(og, node))
    gm = fx.GraphModule(low.root, low.graph, class_name=f"Rank{rank}")
    return with_recompute(gm, recompute, wrap) if tagging else gm


def _placeholders(low: _Lowerer, og: OpGraph, stage: tuple[StageCut, int] | None) -> tuple:
    """The program's inputs: the model's, then (in a stage) the values it receives, whose
    names it returns."""
    for node in og.graph.nodes:
        if og[node].kind == "input":
            low.env[node] = low.graph.placeholder(node.name)
    if stage is None:
        return ()
    cut, s = stage
    for name in cut.receives[s]:
        low.env[og.by_name[name]] = low.graph.placeholder(f"recv_{name}")
    return cut.receives[s]


def _param(low: _Lowerer, og: OpGraph, node: fx.Node, tensors: dict) -> None:
    """A parameter or buffer as the program reads it."""
    info = og[node]
    stored = tensors.get(info.fqn)
    if isinstance(stored, nn.Module):
        low.env[node] = _Fetched(stored, info.fqn)  # in the compute dtype already
    elif info.fqn in low.plan.params:
        value = low.graph.get_attr(attr_name(info.fqn))
        if stored is not None and stored.is_floating_point() and stored.dtype != info.dtype:
            # mixed precision: the master copy, cast where the program reads it
            value = low.call(local.cast, (value, info.dtype), {})
        low.env[node] = value


def _op(low: _Lowerer, og: OpGraph, node: fx.Node) -> fx.Node:
    if og[node].kind == "getitem":
        return low.call(operator.getitem, (low.value(node.args[0]), node.args[1]), {})
    return _lower_node(low, node)


def _output(
    low: _Lowerer, og: OpGraph, node: fx.Node, stage: tuple[StageCut, int] | None, weights: bool
) -> None:
    """The program's outputs: a stage's sends, or the model's outputs in their planned
    layouts; then, where asked, the weight readers' values (``weight_readers``)."""
    extra = _weight_values(low, og, *stage) if weights and stage is not None else ()
    if stage is not None and stage[1] < stage[0].num_stages - 1:
        cut, s = stage
        low.graph.output(tuple(low.value(og.by_name[n]) for n in cut.sends(s)) + extra)
        return
    values = []
    for value, (src, dst) in zip(node.args[0], low.plan.outputs, strict=True):
        v = low.value(value)
        if src != dst:
            v = low.module(Redistribute(src, dst), (v,), "redistribute")
        values.append(v)
    low.graph.output(tuple(values) + extra)


def weight_readers(og: OpGraph, cut: StageCut, s: int) -> list[fx.Node]:
    """The ops of stage ``s`` that read a parameter or buffer, in graph order."""
    return [
        n
        for n in og.graph.nodes
        if og[n].kind == "op" and og[n].params and cut.stage_of[n.name] == s
    ]


def _weight_values(low: _Lowerer, og: OpGraph, cut: StageCut, s: int) -> tuple:
    out = []
    for n in weight_readers(og, cut, s):
        v = low.value(n)
        if isinstance(n.meta.get("val"), list | tuple):  # a tuple: its first tensor
            v = low.call(operator.getitem, (v, 0), {})
        out.append(v)
    return tuple(out)


def _block_of(og: OpGraph, node: fx.Node) -> str | None:
    block = og[node].block
    return f"{block[0]}.{block[1]}" if block and block[0] in og.repeated else None


def _tag(graph: fx.Graph, count: int, block: str | None) -> None:
    """Tag the last ``count`` nodes of ``graph`` (what lowering one node made) with its block."""
    for n, _ in zip(reversed(graph.nodes), range(count), strict=False):
        if n.op != "output":
            n.meta[TAG] = block


def _in_stage(og: OpGraph, node: fx.Node, cut: StageCut, s: int) -> bool:
    """Whether ``node`` is part of stage ``s``'s program (its ops, the parameters they read,
    the output)."""
    if node.op == "output":
        return True
    if node.op == "placeholder":
        return og[node].fqn in cut.params[s]
    return cut.runs(node.name, s)


def _lower_node(low: _Lowerer, node: fx.Node) -> fx.Node:
    node_plan = low.plan.nodes[node.name]
    values = []
    regather: tuple[fx.Node, Gathered] | None = None
    for i, arg in enumerate(tensor_inputs(node)):
        v = low.value(arg)
        if i in node_plan.moves:  # its backward sums the gradient too (NodePlan.grad_source)
            key = (arg, *node_plan.moves[i], node_plan.grad_source(i))
            if key not in low.moved:
                move = Redistribute(*node_plan.moves[i], node_plan.grad_source(i))
                low.moved[key] = low.module(move, (v,), "redistribute")
            if regathers(node, i, *node_plan.moves[i]):
                gathered = low.gathered.setdefault(key, Gathered(*node_plan.moves[i], 0, low.rank))
                gathered.readers += 1
                gathered.reset()
                regather = (v, gathered)
            v = low.moved[key]
        elif i in node_plan.grad_reduce:
            v = low.module(ReduceGrad(*node_plan.grad_reduce[i]), (v,), "reduce_grad")
        values.append(v)
    if _needless_copy(node):
        return values[0]
    args = _replace(tuple(node.args), values)
    kwargs = {k: _replace(v, values) for k, v in node.kwargs.items()}
    rule = rule_for(node)
    out = rule.lower(low, node, node_plan.strategy, list(args), kwargs)
    return out if regather is None else _regathered(low, out, *regather)


def _regathered(low: _Lowerer, out: fx.Node, part: fx.Node, gathered: Gathered) -> fx.Node:
    """The linear ``out`` as one that keeps ``part`` of its gathered input for backward."""
    assert out.op == "call_function" and out.target is torch.ops.aten.linear.default, out
    x, weight, *rest = out.args
    bias = rest[0] if rest else out.kwargs.get("bias")
    low.graph.erase_node(out)
    return low.module(RegatheredLinear(gathered), (x, part, weight, bias), "linear")


def _needless_copy(node: fx.Node) -> bool:
    """A clone that keeps the layout of an op's result: the captured graph is functional (no
    op writes into a tensor), so nothing can tell the copy from the original. Export leaves one
    for every dropout of p=0, which eager skips."""
    if node.target is not torch.ops.aten.clone.default or node.args[0].op == "placeholder":
        return False
    return node.kwargs.get("memory_format", torch.preserve_format) == torch.preserve_format


__all__ = [
    "Dropout",
    "Redistribute",
    "ReduceGrad",
    "RegatheredLinear",
    "RunState",
    "attr_name",
    "lower",
    "weight_readers",
]
