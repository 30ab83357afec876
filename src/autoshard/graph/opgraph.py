"""The OpGraph: one mode's captured aten graph with what every later stage asks about its nodes.

Capture builds it once. Each node carries a :class:`NodeInfo` (its kind, module path, op key,
repeated-block identity, shapes and dtypes, parameter names, FLOPs), so the planner, the searches,
the cost model and the lowering read these facts instead of deriving them again.

Op keys name an op stably across depths and between the train and eval graphs:
``layers.3.mlp/linear.0`` is the first ``linear`` that module ``layers.3.mlp`` calls directly
(the root module's path is empty). A node inside a repeated block list (``layers.<i>``, every
block the same ops) has a block identity ``("layers", 3)``, and its key pattern
``layers.*.mlp/linear.0`` names the same op in every block.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx

from autoshard.ops import SpaceRule, rule_for, tensor_inputs

#: the node meta key holding each node's NodeInfo
INFO = "autoshard_info"
#: the node meta key capture stamps on placeholders ("input", "param", "buffer"); op rules read it
KIND = "autoshard_kind"

# The first numbered component of a module path: ``layers.3.mlp`` is block 3 of ``layers``.
_BLOCK = re.compile(r"^(.*?)\.(\d+)(?=\.|$)")


def _norm(value: Any) -> Any:
    """Arguments with tensors and graph values replaced by (shape, dtype): equal for the same op
    on the same shapes anywhere in the graph."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype)
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("T", tuple(val.shape), val.dtype)
        return ("N", repr(val))
    if isinstance(value, list | tuple):
        return tuple(_norm(v) for v in value)
    return repr(value)


def _vals(node: fx.Node) -> list[Any]:
    val = node.meta.get("val")
    return list(val) if isinstance(val, list | tuple) else [val]


def _tensor_facts(values: list[Any]) -> tuple[tuple, tuple]:
    tensors = [v if isinstance(v, torch.Tensor) else None for v in values]
    shapes = tuple(None if t is None else tuple(int(s) for s in t.shape) for t in tensors)
    dtypes = tuple(None if t is None else t.dtype for t in tensors)
    return shapes, dtypes


@dataclass(eq=False)
class NodeInfo:
    """What the stages after capture know about one node of the graph."""

    node: fx.Node
    #: "input", "param", "buffer", "op", "getitem" or "output"
    kind: str
    #: the module that made the call (``layers.3.mlp``; empty for the root module)
    path: str = ""
    #: ``<aten op>.<k>``: the k-th call of that op made directly by the module (ops only)
    op: str = ""
    #: (block list prefix, block index) when the node sits in a numbered block
    block: tuple[str, int] | None = None
    in_shapes: tuple = ()
    in_dtypes: tuple = ()
    out_shapes: tuple = ()
    out_dtypes: tuple = ()
    #: a parameter's or buffer's name, and every name it has (tied weights)
    fqn: str | None = None
    names: tuple[str, ...] = ()
    #: the parameters and buffers an op reads directly, by name
    params: tuple[str, ...] = ()
    #: a constant tensor torch.export lifted out of the code (not part of the model's state)
    constant: torch.Tensor | None = None
    #: (target, arguments, keyword arguments, outputs) with values as (shape, dtype)
    signature: tuple = field(default=(), repr=False)
    #: whether autograd makes a gradient for this value: a trainable parameter, or a floating
    #: value computed from one (buffers, inputs and integer values never)
    requires_grad: bool = False
    #: computed from parameters, buffers and constants alone (a weight split into q and kv,
    #: a transposed weight, a causal mask, a lookup of positions made by ``arange``): the same
    #: value whatever the batch, priced and planned as weight-like (docs/search.md)
    from_state: bool = False

    @property
    def key(self) -> str:
        """The op key, ``layers.3.mlp/linear.0``."""
        return f"{self.path}/{self.op}"

    @property
    def where(self) -> str:
        """How messages name the module: its path, or "the model" for the root."""
        return self.path or "the model"

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the (first) output."""
        return self.out_shapes[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtypes[0]

    @property
    def is_state(self) -> bool:
        """A parameter or buffer."""
        return self.kind in ("param", "buffer")

    @cached_property
    def forward_backward_flops(self) -> tuple[float, float]:
        """Model FLOPs of the op's forward and backward on one device: its matrix products
        (``Contraction``), as torch's FlopCounterMode counts them; backward only for the
        operands whose gradient is needed."""
        if self.kind != "op":
            return 0.0, 0.0
        rule = rule_for(self.node)
        if not isinstance(rule, SpaceRule):
            return 0.0, 0.0
        needs = [node_info(a).requires_grad for a in tensor_inputs(self.node)]
        return rule.flops(self.node, rule.space(self.node).sizes, needs)

    @property
    def flops(self) -> float:
        """FLOPs of one training step of this op on one device (forward and backward)."""
        return sum(self.forward_backward_flops)


def node_info(node: fx.Node) -> NodeInfo:
    """The NodeInfo capture attached to ``node``."""
    return node.meta[INFO]


@dataclass
class OpGraph:
    """One mode's graph (dropout's train flag is baked in), its calling convention, and the
    NodeInfo of every node (``og[node]``)."""

    graph: fx.Graph
    train: bool
    in_spec: Any
    out_spec: Any
    #: the placeholder names of the user's inputs, in order
    inputs: list[str]
    #: which graph outputs are the model's outputs
    outputs: list[int]
    #: graph output index -> the buffer it updates (batch norm's running stats)
    mutations: dict[int, str]
    #: every name of each parameter and buffer, keyed by each of its names
    aliases: dict[str, list[str]] = field(default_factory=dict)
    #: block list prefix -> its block indices, for lists whose blocks are the same ops
    repeated: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __getitem__(self, node: fx.Node) -> NodeInfo:
        return node.meta[INFO]

    def __iter__(self) -> Iterator[NodeInfo]:
        return (node.meta[INFO] for node in self.graph.nodes)

    def ops(self) -> list[NodeInfo]:
        """The op nodes (not getitem), in graph order."""
        return [i for i in self if i.kind == "op"]

    def state(self) -> list[NodeInfo]:
        """The parameter and buffer placeholders, in graph order."""
        return [i for i in self if i.is_state]

    @cached_property
    def by_name(self) -> dict[str, fx.Node]:
        return {node.name: node for node in self.graph.nodes}

    @cached_property
    def constants(self) -> dict[str, torch.Tensor]:
        """Tensors torch.export lifted out of the code (an empty KV cache), by name."""
        return {i.fqn: i.constant for i in self if i.constant is not None}

    @cached_property
    def first_use(self) -> dict[str, int]:
        """Each trainable parameter's first reader: its index among the graph's nodes."""
        first: dict[str, int] = {}
        for index, node in enumerate(self.graph.nodes):
            for arg in node.all_input_nodes:
                info = self[arg]
                if info.kind == "param" and info.requires_grad:
                    first.setdefault(info.fqn, index)
        return first

    @cached_property
    def gradient_order(self) -> list[str]:
        """Trainable parameters in the order backward completes their gradients: the reverse
        of their first use in forward (a tied weight is complete at its earliest use). The
        runtime's buckets and the cost model's overlap both follow it."""
        return sorted(self.first_use, key=lambda fqn: -self.first_use[fqn])

    @cached_property
    def leading(self) -> frozenset[str]:
        """Trainable parameters first read before the first block of a repeated block list
        (the embeddings): backward completes their gradients last, so their sums have no
        backward left to run beside. Empty when no block list repeats."""
        nodes = list(self.graph.nodes)
        start = next((i for i, n in enumerate(nodes) if self.is_repeated(self[n])), None)
        if start is None:
            return frozenset()
        return frozenset(fqn for fqn, i in self.first_use.items() if i < start)

    def is_repeated(self, info: NodeInfo) -> bool:
        """Whether the node sits in a block list whose blocks are all the same ops."""
        return info.block is not None and info.block[0] in self.repeated

    def key_pattern(self, info: NodeInfo) -> str:
        """The op key with the block index written ``*`` for a node in a repeated block list."""
        if not self.is_repeated(info):
            return info.key
        prefix, index = info.block
        rest = info.path[len(f"{prefix}.{index}") :]
        return f"{prefix}.*{rest}/{info.op}"


def module_path(node: fx.Node) -> str:
    """The module a node came from (its innermost ``nn_module_stack`` entry; "" for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def annotate(
    og: OpGraph,
    kinds: dict[str, str],
    fqns: dict[str, str],
    constants: dict[str, torch.Tensor],
    frozen: set[str],
) -> None:
    """Attach a NodeInfo to every node of ``og`` (placeholders' kinds, names and constants given
    by node name; ``frozen``: parameters that need no gradient) and find the repeated block
    lists."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    for node in og.graph.nodes:
        ins_shapes, ins_dtypes = _tensor_facts([a.meta.get("val") for a in tensor_inputs(node)])
        out_shapes, out_dtypes = _tensor_facts(_vals(node)) if node.op != "output" else ((), ())
        info = NodeInfo(
            node,
            _kind(node, kinds),
            in_shapes=ins_shapes,
            in_dtypes=ins_dtypes,
            out_shapes=out_shapes,
            out_dtypes=out_dtypes,
        )
        if node.op == "placeholder":
            node.meta[KIND] = info.kind
            info.fqn = fqns.get(node.name)
            info.names = tuple(og.aliases.get(info.fqn, [info.fqn])) if info.fqn else ()
            info.constant = constants.get(node.name)
            info.requires_grad = info.kind == "param" and info.fqn not in frozen
            info.from_state = info.kind != "input"
        elif node.op == "call_function":
            info.path = module_path(node)
            match = _BLOCK.match(info.path)
            info.block = (match.group(1), int(match.group(2))) if match else None
            info.signature = (
                node.target,
                _norm(node.args),
                tuple(sorted((k, _norm(v)) for k, v in node.kwargs.items())),
                _out_signature(node),
            )
            info.requires_grad = _requires_grad(node)
            info.from_state = all(node_info(a).from_state for a in tensor_inputs(node))
            if info.kind == "op":
                op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
                info.op = f"{op}.{seen[(info.path, op)]}"
                seen[(info.path, op)] += 1
        node.meta[INFO] = info
    for node in og.graph.nodes:
        info = node.meta[INFO]
        if info.kind == "op":
            args = tensor_inputs(node)
            info.params = tuple(node_info(a).fqn for a in args if node_info(a).is_state)
    og.repeated = _repeated_blocks(og)


def _requires_grad(node: fx.Node) -> bool:
    """A floating output of an op with an input that requires a gradient (autograd's rule)."""
    if node.target in _NO_GRAD:
        return False
    if not any(node_info(a).requires_grad for a in tensor_inputs(node)):
        return False
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in _vals(node))


# Ops whose outputs never carry a gradient, whatever their inputs.
_NO_GRAD = {torch.ops.aten.detach.default}


def _kind(node: fx.Node, kinds: dict[str, str]) -> str:
    if node.op == "placeholder":
        return kinds[node.name]
    if node.op == "output":
        return "output"
    return "getitem" if node.target is operator.getitem else "op"


def _out_signature(node: fx.Node) -> Any:
    vals = node.meta.get("val")
    if vals is None:
        return ()
    out = _norm(list(vals) if isinstance(vals, list | tuple) else [vals])
    return repr(out) if not isinstance(out, tuple) else out


def _repeated_blocks(og: OpGraph) -> dict[str, tuple[int, ...]]:
    """Block lists of two or more blocks whose ops are the same (by relative path, target and
    argument shapes) in every block."""
    by_block: dict[tuple[str, int], list[NodeInfo]] = defaultdict(list)
    for info in og:
        if info.kind == "op" and info.block is not None:
            by_block[info.block].append(info)
    prefixes: dict[str, list[int]] = defaultdict(list)
    for prefix, index in by_block:
        prefixes[prefix].append(index)
    out = {}
    for prefix, indices in prefixes.items():
        if len(indices) < 2:
            continue

        def sig(index: int, prefix: str = prefix) -> tuple:
            head = len(f"{prefix}.{index}")
            return tuple((i.path[head:], i.signature) for i in by_block[(prefix, index)])

        first = sig(indices[0])
        if all(sig(i) == first for i in indices[1:]):
            out[prefix] = tuple(indices)
    return out


__all__ = ["INFO", "KIND", "NodeInfo", "OpGraph", "annotate", "module_path", "node_info"]
