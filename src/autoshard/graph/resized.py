"""A traced graph at a batch size it was not traced at, from traces at other sizes.

A pipeline search asks for the model's graph at every micro-batch size it tries (GPT-3 175B:
seven), and one trace of two GPT-3 blocks costs about 0.7 s of CPU. Where traces at a few
sizes are the same graph but for integers that are each one line in the batch size (a view's
``[b * s, h]``, every value's shape and strides), the graph at another size is theirs with
those lines read at it: no op is run again. Anything else (another node, a float or other
argument that differs, a slope that is not whole, a symbolic value) answers None, and the
size is traced; so is a batch of one, which torch's broadcasting treats apart (transformers'
Llama slices its positions at batch 1 where it expands them at 2 or more).

What three traces cannot show is a model that branches in Python on its batch size past a
size none of them has: such a model is captured with ``AUTOSHARD_CAPTURE=export``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

#: traces a line is read from: two make a line, a third checks it is one
SAMPLES = 3


class _Differs(Exception):
    """The samples are not one graph with integers on lines in the batch size."""


def at_size(samples: Sequence[tuple[int, fx.Graph]], size: int) -> fx.Graph | None:
    """The graph ``samples`` (batch size, its traced graph; :data:`SAMPLES` of them at other
    sizes) make at batch ``size``, a copy with each value made again as a fake tensor; None
    where they are not one graph on lines in the batch."""
    sizes = [b for b, _ in samples]
    if len(samples) < 2 or len(set(sizes)) < len(sizes) or size in sizes or min(size, *sizes) < 2:
        return None  # (a dim of size 1 broadcasts: torch's ops and strides treat it apart)
    (_, first), *others = samples
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    result, output = graph.graph_copy(first, copies, return_output_node=True)
    graph.output(result).meta = dict(output.meta)
    twins = [list(g.nodes) for _, g in others]
    line = _Line(sizes, size, copies)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            for i, node in enumerate(first.nodes):
                same = [nodes[i] if i < len(nodes) else None for nodes in twins]
                if node.op == "output":
                    continue
                if any(t is None or (t.op, t.target, t.name) != (node.op, node.target, node.name)
                       for t in same):  # fmt: skip
                    raise _Differs(node.name)
                new = copies[node]
                new.args, new.kwargs = line.read(
                    (node.args, node.kwargs), [(t.args, t.kwargs) for t in same]
                )
                _meta(new, node, same, line)
    except _Differs:
        return None
    if any(len(nodes) != len(first.nodes) for nodes in twins):
        return None
    return graph


def _meta(new: fx.Node, node: fx.Node, same: list[fx.Node], line: _Line) -> None:
    """``new``'s value and tensor metadata read at the size; its other facts (module path,
    torch function) the samples' own, which must agree."""
    for key, value in node.meta.items():
        if key == "val":
            new.meta[key] = line.read(value, [t.meta.get(key) for t in same])
        elif key == "tensor_meta" and value is not None:
            shape = line.read(tuple(value.shape), [tuple(t.meta[key].shape) for t in same])
            stride = line.read(tuple(value.stride), [tuple(t.meta[key].stride) for t in same])
            new.meta[key] = value._replace(shape=torch.Size(shape), stride=stride)
        elif any(t.meta.get(key) != value for t in same):
            raise _Differs(f"{node.name}: {key}")
    if any(set(t.meta) != set(node.meta) for t in same):
        raise _Differs(node.name)


class _Line:
    """Reading a value of the first sample and its twins in the others at ``size``."""

    def __init__(self, sizes: list[int], size: int, copies: dict[fx.Node, fx.Node]) -> None:
        self.sizes, self.size, self.copies = sizes, size, copies

    def read(self, value: Any, twins: list[Any]) -> Any:
        kind = type(value)
        if any(type(t) is not kind for t in twins):
            raise _Differs(f"{value!r}: types differ")
        if kind is fx.Node:
            if any(t.name != value.name for t in twins):
                raise _Differs(value.name)
            return self.copies[value]
        if kind is int:
            return self.integer([value, *twins])
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):  # fx's own too
            if any(len(t) != len(value) for t in twins):
                raise _Differs(f"{value!r}: lengths differ")
            return kind([self.read(v, [t[i] for t in twins]) for i, v in enumerate(value)])
        if isinstance(value, dict):
            if any(t.keys() != value.keys() for t in twins):
                raise _Differs(f"{value!r}: keys differ")
            return kind({k: self.read(v, [t[k] for t in twins]) for k, v in value.items()})
        if isinstance(value, torch.Tensor):
            return self.tensor(value, twins)
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            raise _Differs(f"{value!r}: symbolic")
        if any(not (t == value) for t in twins):  # floats, bools, dtypes, devices, strings
            raise _Differs(f"{value!r}: differs")
        return value

    def integer(self, values: list[int]) -> int:
        (b0, b1), (v0, v1) = self.sizes[:2], values[:2]
        slope, rest = divmod(v1 - v0, b1 - b0)
        if rest or any(v - v0 != slope * (b - b0) for b, v in zip(self.sizes, values, strict=True)):
            raise _Differs(f"{values}: not one whole line in the batch {self.sizes}")
        return v0 + slope * (self.size - b0)

    def tensor(self, value: torch.Tensor, twins: list[Any]) -> torch.Tensor:
        if any((t.dtype, t.device, t.requires_grad) != (value.dtype, value.device,
               value.requires_grad) for t in twins):  # fmt: skip
            raise _Differs(f"{value!r}: dtypes, devices or gradients differ")
        shape = self.read(tuple(value.shape), [tuple(t.shape) for t in twins])
        stride = self.read(value.stride(), [t.stride() for t in twins])
        if any(s < 0 for s in (*shape, *stride)):
            raise _Differs(f"{value!r}: a negative size at {self.size}")
        made = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
        return made.requires_grad_(value.requires_grad)


__all__ = ["SAMPLES", "at_size"]
