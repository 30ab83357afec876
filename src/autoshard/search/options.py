"""The options of a decision node: every strategy that puts each mesh axis on one splittable
iteration dim (or on none), deduplicated. Cached per node and, across graphs, per op signature.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autoshard.graph import node_info
from autoshard.layout import Layout, LayoutError
from autoshard.mesh import MeshInfo
from autoshard.ops import FIXED, Strategy, StrategyError, rule_for


@dataclass
class Option:
    """One strategy of a decision node: the axis -> iteration dim assignment it came from (a
    tuple of dims for an axis a joint option puts on several)."""

    assign: tuple[Any, ...]
    spec: tuple[Any, ...]
    strategy: Strategy


def _spec(assign: Sequence[int | None], axes: Sequence[str], ndims: int) -> tuple[Any, ...]:
    entries: list[list[str]] = [[] for _ in range(ndims)]
    for axis, d in zip(axes, assign, strict=True):
        if d is not None:
            entries[d].append(axis)
    return tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)


def _assignments(
    sizes: Sequence[int], allowed: Sequence[int], mesh: MeshInfo
) -> Iterator[tuple[tuple[int | None, ...], tuple[Any, ...]]]:
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


def options(node: fx.Node, mesh: MeshInfo) -> list[Option]:
    """Every strategy of a decision node on ``mesh``: each axis on one splittable dim or none."""
    by_node = _NODE_OPTIONS.get((node, mesh))
    if by_node is not None:
        return by_node
    key = (*node_info(node).signature, mesh) if node.op == "call_function" else None
    if key is not None and key in _STRATEGY_CACHE:
        _NODE_OPTIONS[(node, mesh)] = _STRATEGY_CACHE[key]
        return _STRATEGY_CACHE[key]
    axes = mesh.as_dict()
    out: list[Option] = []
    seen: set = set()
    if node.op == "placeholder":
        shape, dtype = node_info(node).shape, node_info(node).dtype
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
    for spec, strategy in rule.joint_options(node, mesh):
        out.append(Option(_joint_assign(spec, mesh), spec, strategy))
    if key is not None:
        _STRATEGY_CACHE[key] = out
    _NODE_OPTIONS[(node, mesh)] = out
    return out


def _joint_assign(spec: Sequence[Any], mesh: MeshInfo) -> tuple[Any, ...]:
    """Per mesh axis (of size > 1) the iteration dim it splits, or a tuple of the dims it
    splits together (an axis on two dims of a joint option), or None."""
    out: list[Any] = []
    for name, size in zip(mesh.names, mesh.sizes, strict=True):
        if size == 1:
            continue
        dims = tuple(
            d for d, e in enumerate(spec) if e == name or (isinstance(e, tuple) and name in e)
        )
        out.append(dims[0] if len(dims) == 1 else dims or None)
    return tuple(out)


def clear_caches() -> None:
    """Forget the options cached per graph node (those cached per op signature stay)."""
    _NODE_OPTIONS.clear()


__all__ = ["Option", "clear_caches", "options"]
