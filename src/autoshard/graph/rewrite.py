"""Rewrites of a captured graph that change no value but let more layouts through.

``rows_through_views``: a linear whose input is a view merging leading dims and whose output is
viewed back to those dims runs on the unmerged dims instead. A linear treats its leading dims as
independent rows, so the result is the same; but a split on an inner factor of the merged dim
(``nn.MultiheadAttention``'s ``(seq, batch)`` flattened with the batch split) is no longer a
split inside one dim, which a layout cannot hold without moving it.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def rows_through_views(graph: fx.Graph) -> int:
    """Rewrite every ``view(x, [M, K]) -> linear -> view(., [*lead, N])`` whose ``lead``
    multiplies to ``M`` and begins ``x``'s shape into ``linear(view(x, [*lead, K]))``; returns
    how many were rewritten."""
    done = 0
    for lin in list(graph.nodes):
        if lin.op != "call_function" or lin.target is not aten.linear.default:
            continue
        found = _pattern(lin)
        if found is None:
            continue
        merged, src, back, lead, k = found
        with graph.inserting_before(lin):
            rows = graph.call_function(aten.view.default, (src, [*lead, k]))
        rows.meta = dict(merged.meta)
        value = src.meta["val"]
        with value.fake_mode:
            rows.meta["val"] = value.view(*lead, k)
        lin.args = (rows, *lin.args[1:])
        lin.meta["val"] = back.meta["val"]
        back.replace_all_uses_with(lin)
        graph.erase_node(back)
        if not merged.users:
            graph.erase_node(merged)
        done += 1
    return done


def _pattern(lin: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[int], int] | None:
    """(the merging view, its source, the view back, the leading dims, the row width) of a
    linear that matches, else None."""
    merged = lin.args[0]
    if not isinstance(merged, fx.Node) or merged.target not in _VIEWS or len(lin.users) != 1:
        return None
    back = next(iter(lin.users))
    if back.op != "call_function" or back.target not in _VIEWS:
        return None
    src = merged.args[0]
    shapes = [_shape(n) for n in (src, merged, back)]
    if any(s is None for s in shapes):
        return None
    have, flat, out = shapes
    if len(flat) != 2 or len(out) < 3:
        return None
    lead = list(out[:-1])
    if math.prod(lead) != flat[0] or list(have[: len(lead)]) != lead:
        return None
    if math.prod(have[len(lead) :]) != flat[1]:
        return None
    return merged, src, back, lead, flat[1]


def _shape(node: object) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return tuple(int(d) for d in value.shape)
    except TypeError:  # a symbolic size
        return None


__all__ = ["rows_through_views"]
