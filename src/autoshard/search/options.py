"""The options of a decision node: every strategy that puts each mesh axis on one splittable
iteration dim (or on none), deduplicated, with the other ways a rule computes one of them
(``OpRule.variants``: ring attention beside the all-gather). Cached per node and, across
graphs, per op signature. An input's options put the context-parallel axes on its sequence.
Inside :func:`searching` an attention keeps only the options computing its split rows by
the method given, and context-parallel axes stay on the sequence.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autoshard.graph import node_info
from autoshard.layout import Layout, LayoutError
from autoshard.mesh import MeshInfo
from autoshard.ops import FIXED, Strategy, StrategyError, rule_for
from autoshard.ops.contraction import ATTENTION_METHODS, Attention
from autoshard.search.state import cache, search_session, state


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
    sizes: Sequence[int], allowed: Sequence[int], mesh: MeshInfo, heads: int | None = None
) -> Iterator[tuple[tuple[int | None, ...], tuple[Any, ...]]]:
    """Each axis on one allowed dim or none; inside :func:`searching` with a sequence
    length, a context-parallel axis only on dims the sequence makes (a multiple of its
    length) or on attention's ``heads``."""
    axes = [(n, s) for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1]
    choices = [None, *allowed]
    seq = state().context["sequence"]
    along = [None, *(d for d in allowed if seq and (sizes[d] % seq == 0 or d == heads))]
    per_axis = [along if seq and n in mesh.cp else choices for n, _ in axes]
    for assign in itertools.product(*per_axis):
        per_dim: dict[int, int] = defaultdict(lambda: 1)
        for (_, s), d in zip(axes, assign, strict=True):
            if d is not None:
                per_dim[d] *= s
        if all(sizes[d] % n == 0 for d, n in per_dim.items()):
            yield assign, _spec(assign, [n for n, _ in axes], len(sizes))


@contextmanager
def searching(
    attention: str | None = None, sequence: int | None = None, sequence_parallel: bool = False
) -> Iterator[None]:
    """Options made inside compute every attention over a split sequence by ``attention``
    (``ATTENTION_METHODS``; ``ulysses``: its heads split, the sequence whole; None: any), put
    context-parallel axes only on dims of ``sequence`` (or attention's heads), and under
    ``sequence_parallel`` split every op over the tensor-parallel axes where it can be (no
    activation kept whole on a tensor-parallel group: Megatron's sequence parallelism)."""
    if attention is not None and attention not in ATTENTION_METHODS:
        raise StrategyError(
            f"attention={attention!r}: expected one of {', '.join(ATTENTION_METHODS)}"
        )
    with search_session() as under_way:
        kept = dict(under_way.context)
        under_way.context.update(
            attention=attention, sequence=sequence, sequence_parallel=sequence_parallel
        )
        under_way.forget("node_options")
        try:
            yield
        finally:
            under_way.context.update(kept)
            under_way.forget("node_options")


def options(node: fx.Node, mesh: MeshInfo) -> list[Option]:
    """Every strategy of a decision node on ``mesh``: each axis on one splittable dim or none."""
    node_options_cache, strategies_cache = cache("node_options"), cache("strategies")
    by_node = node_options_cache.get((node, mesh))
    if by_node is not None:
        return by_node
    context = tuple(state().context.values())
    key = (*node_info(node).signature, mesh, context) if node.op == "call_function" else None
    if key is not None and key in strategies_cache:
        node_options_cache[(node, mesh)] = strategies_cache[key]
        return strategies_cache[key]
    if node.op == "placeholder":
        out = _input_options(node, mesh)
        node_options_cache[(node, mesh)] = out
        return out
    axes = mesh.as_dict()
    out: list[Option] = []
    seen: set = set()
    rule = rule_for(node)
    space = rule.space(node)
    allowed = [d for d, k in enumerate(space.kinds) if k != FIXED and space.sizes[d] > 1]
    heads = len(space.sizes) - 5 if isinstance(rule, Attention) else None
    # other ways to compute a strategy (the ring) where a context-parallel axis or the
    # method asks for them: elsewhere they would slow every search for little
    variants = bool(mesh.cp) or state().context["attention"] == "ring"
    for assign, spec in _assignments(space.sizes, allowed, mesh, heads):
        try:
            strategy = rule.layouts(node, Layout.from_named(space.sizes, spec, axes))
        except (StrategyError, LayoutError):
            continue
        ident = (strategy.ins, strategy.outs, strategy.grads)
        if ident in seen:
            continue
        seen.add(ident)
        out.append(Option(assign, spec, strategy))
        for other, variant in rule.variants(node, spec, strategy) if variants else ():
            out.append(Option(_joint_assign(other, mesh), other, variant))
    for spec, strategy in rule.joint_options(node, mesh):
        out.append(Option(_joint_assign(spec, mesh), spec, strategy))
    if isinstance(rule, Attention) and state().context["attention"] is not None:
        out = [o for o in out if _by_method(rule, node, o, mesh, state().context["attention"])]
    if state().context["sequence_parallel"]:
        out = _over_tensor_axes(out, mesh)
    if key is not None:
        strategies_cache[key] = out
    node_options_cache[(node, mesh)] = out
    return out


def _by_method(rule: Attention, node: fx.Node, option: Option, mesh: MeshInfo, method: str) -> bool:
    """Whether ``option`` computes a split sequence by ``method`` (or splits none), with the
    context-parallel axes on its rows (on its heads for Ulysses)."""
    has = rule.method(node, option.strategy)
    if has != "local" and (has != method or method == "ulysses"):
        return False
    cp = {n for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1 and n in mesh.cp}
    if not cp:
        return True
    nb = len(option.spec) - 4
    where = option.spec[nb - 1 if method == "ulysses" else nb]
    return cp <= set(where if isinstance(where, tuple) else (where,))


def _over_tensor_axes(out: list[Option], mesh: MeshInfo) -> list[Option]:
    """The options that split over every tensor-parallel axis, where any does."""
    split = [n for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1]
    tp = [i for i, n in enumerate(split) if n == "tp" or n.startswith("tp_")]
    kept = [o for o in out if all(o.assign[i] is not None for i in tp)]
    return kept or out


def _input_options(node: fx.Node, mesh: MeshInfo) -> list[Option]:
    """An input's splits; the context-parallel axes split its sequence (dim 1) only."""
    shape, dtype = node_info(node).shape, node_info(node).dtype
    allowed = [d for d, s in enumerate(shape) if s > 1]
    split = [n for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1]
    cp = [i for i, n in enumerate(split) if n in mesh.cp]
    out = []
    for assign, spec in _assignments(shape, allowed, mesh, 1):
        layout = Layout.from_named(shape, spec, mesh.as_dict(), dtype=dtype)
        out.append(Option(assign, spec, Strategy((), (layout,), ())))
    on_sequence = [o for o in out if all(o.assign[i] == 1 for i in cp)]
    return on_sequence or out


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


__all__ = ["Option", "options", "searching"]
