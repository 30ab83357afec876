"""Plans in words: every op's layouts with named dims, ``x[b@dp, s, in] weight[out@tp, in] ->
[b@dp, s, out@tp]``.

A dim is named by the iteration space of the op that makes it (``b``, ``s``, ``out``,
``heads``, ``q_len``, ...); an op without names passes on the names of an input of its rank;
a model's input is ``[b, s]`` token ids, or ``[b, h]``, ``[b, s, h]``, ``[b, c, h, w]`` values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.fx as fx

from autoshard.graph import OpGraph
from autoshard.layout import Layout
from autoshard.layout.text import named_str
from autoshard.ops import Space, SpaceRule, Strategy, rule_for, tensor_inputs

#: the names of a model input's dims by its number of dims: token ids, then floating values
TOKEN_NAMES = {1: ("b",), 2: ("b", "s")}
VALUE_NAMES = {1: ("b",), 2: ("b", "h"), 3: ("b", "s", "h"), 4: ("b", "c", "h", "w")}


def numbered(rank: int) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(rank))


def _space(node: fx.Node) -> Space | None:
    """The node's iteration space when its rule has named dims."""
    try:
        rule = rule_for(node)
        space = rule.space(node) if isinstance(rule, SpaceRule) else None
    except Exception:  # an op no rule describes by a space: its names come from its inputs
        return None
    return space if space is not None and space.names else None


def dim_names(og: OpGraph) -> dict[fx.Node, tuple[str, ...]]:
    """The names of each value's dims (its first output's)."""
    names: dict[fx.Node, tuple[str, ...]] = {}
    for node in og.graph.nodes:
        info = og[node]
        if not info.out_shapes or info.out_shapes[0] is None:
            continue
        rank = len(info.out_shapes[0])
        space = _space(node) if node.op == "call_function" else None
        if space is not None and len(space.outs[0]) == rank:
            names[node] = tuple(space.names[d] for d in space.outs[0])
        elif info.kind == "input":
            floating = info.out_dtypes[0] is not None and info.out_dtypes[0].is_floating_point
            names[node] = (VALUE_NAMES if floating else TOKEN_NAMES).get(rank, numbered(rank))
        else:
            given = [names[a] for a in tensor_inputs(node) if len(names.get(a, ())) == rank]
            names[node] = given[0] if given else numbered(rank)
    return names


def describe_op(
    og: OpGraph, node: fx.Node, strategy: Strategy, names: Mapping[fx.Node, tuple[str, ...]]
) -> str:
    """The op's input layouts, named by the role of each input (a parameter by its own name,
    ``x``, ``y``, ... the others), and its output's."""
    space = _space(node)
    letters = iter("xyzuvw")
    own = names.get(node, ())
    parts = []
    for k, (arg, layout) in enumerate(zip(tensor_inputs(node), strategy.ins, strict=False)):
        info = og[arg]
        label = info.fqn.rpartition(".")[2] if info.fqn else next(letters, f"in{k}")
        if space is not None and k < len(space.ins):
            dims = tuple("1" if d is None else space.names[d] for d in space.ins[k])
        elif 0 < len(layout.shape) <= len(own):  # broadcast onto the output: its dims' names
            dims = own[len(own) - len(layout.shape) :]
        else:
            dims = names.get(arg, ())
        parts.append(label + _named(layout, dims))
    out = strategy.outs[0] if strategy.outs else None
    if out is None:
        return " ".join(parts)
    return " ".join(parts) + " -> " + _named(out, names.get(node, ()))


def _named(layout: Layout, dims: Sequence[str]) -> str:
    if len(dims) != len(layout.shape):
        dims = numbered(len(layout.shape))
    return named_str(layout, dims)


def describe_input(layout: Layout, node: fx.Node, names: Mapping[fx.Node, tuple[str, ...]]):
    """A model input's layout with named dims."""
    return _named(layout, names.get(node, ()))


__all__ = ["TOKEN_NAMES", "VALUE_NAMES", "describe_input", "describe_op", "dim_names", "numbered"]
