"""What spares the search most of its work: each mesh's moves priced once for all its ZeRO
stages (and, in a session, for all its searches), and the bounds that skip a mesh before its
moves are priced or its integer program solved (docs/search.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from autoshard.cost import ClusterSpec
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.search.costgraph import (
    CostGraph,
    cost_graphs,
    with_moves,
)
from autoshard.search.solvers import Solution, lower_bound, relaxed_bound, relaxed_known
from autoshard.search.state import search_session, state


def priced_as(context: tuple) -> None:
    """What a search prices under (its options' context and precision policy): what the
    search state holds was priced under another, it is forgotten (the caches keyed by an
    op's signature stay)."""
    under_way = state()
    if context != under_way.priced_as:
        # what is priced per graph node (what is keyed by an op's signature stays)
        under_way.forget("node_options", "rows", "wants", "moves", "parts", "zero", "prices")
        under_way.bare.clear()
        under_way.priced.clear()
        under_way.moves.clear()
        under_way.priced_as = context


def bare_graph(
    og: OpGraph,
    mesh: MeshInfo,
    cluster: ClusterSpec,
    depth: Mapping[str, int] | None,
    zero: int,
    step_share: float,
) -> CostGraph:
    """``build_cost_graph`` without the moves, once a session for its arguments; priced once
    for all ZeRO stages but for the parameters' terms (``cost_graphs``)."""
    under_way = state()
    key = (id(og), mesh, id(cluster), _items(depth), zero, step_share)
    if key not in under_way.bare:
        stages = (id(og), mesh, id(cluster), _items(depth), step_share)
        if stages not in under_way.priced:
            priced = cost_graphs(og, mesh, cluster, depth=depth, step_share=step_share)
            under_way.priced[stages] = ((og, cluster), priced)
        under_way.bare[key] = ((og, cluster), under_way.priced[stages][1].at(zero))
    return under_way.bare[key][1]


def bare_graphs(
    og: OpGraph,
    shapes: list[MeshInfo],
    levels: tuple[int, ...],
    cluster: ClusterSpec,
    depth: Mapping[str, int] | None,
    step_share: float,
    limit: float,
) -> tuple[list[CostGraph | None], list[float]]:
    """Each (mesh, ZeRO stage)'s graph without its moves, in ``meshes`` order; None for the
    stages of a mesh on which ZeRO 3 does not fit: every option holds fewest bytes at ZeRO 3
    (a parameter's state there is its share of what any lower stage holds whole or in part),
    so no stage fits (``floors``: the ZeRO 3 graph's least memory, a floor for all of them)."""
    graphs: list[CostGraph | None] = []
    floors: list[float] = []
    for m in shapes:
        floor = 0.0
        if 3 in levels and len(levels) > 1:
            floor = least_memory(bare_graph(og, m, cluster, depth, 3, step_share))
        fits = floor <= limit
        for z in levels:
            graphs.append(
                bare_graph(og, m, cluster, depth, z, step_share) if fits or z == 3 else None
            )
            floors.append(floor)
    return graphs, floors


def _items(depth: Mapping[str, int] | None) -> tuple:
    return tuple(sorted((depth or {}).items()))


def moves_once(
    og: OpGraph, cluster: ClusterSpec, depth: Mapping[str, int] | None, step_share: float
) -> Any:
    """A graph built without its moves -> the graph with them; each mesh's moves priced once
    a session for all its ZeRO stages, memory limits and step shares."""

    def whole(bare: CostGraph) -> CostGraph:
        under_way = state()
        key = (id(og), bare.mesh, id(cluster), _items(depth))
        if key not in under_way.moves:  # (the bare graph's pricing holds what they need)
            priced = under_way.priced[(*key, step_share)][1]
            under_way.moves[key] = ((og, cluster), priced.moves())
        return with_moves(bare, under_way.moves[key][1])

    return whole


def solved_alike(
    solved: list[tuple[CostGraph, Solution, float]], graph: CostGraph, room: float
) -> Solution | None:
    """The optimum of ``graph`` under ``room`` bytes, read off an optimum already found
    (``solved``: graph, its optimum, the room it was found under) where that graph prices
    every plan the same and in no more bytes (ZeRO 2 beside 1 of one mesh): the plans that
    fit ``graph`` fit it too, so its optimum, if it fits ``graph``, is ``graph``'s."""
    for other, sol, other_room in solved:
        if other_room < room or not alike(other, graph):
            continue
        seconds, memory = graph.objective(sol.choice)
        if memory <= room:
            return Solution(list(sol.choice), seconds, memory, sol.search, 0.0)
    return None


def alike(a: CostGraph, b: CostGraph) -> bool:
    """Every plan takes as long on ``a`` as on ``b``, in no more bytes."""
    if a.mesh != b.mesh or a.edges is not b.edges:
        return False
    if (a.const_time, a.const_window) != (b.const_time, b.const_window):
        return False
    same = all(
        np.array_equal(x, y)
        for xs, ys in ((a.unary, b.unary), (a.overlap, b.overlap), (a.window, b.window))
        for x, y in zip(xs, ys, strict=True)
    )
    fewer = a.const_memory <= b.const_memory and all(
        bool(np.all(x <= y)) for x, y in zip(a.memory, b.memory, strict=True)
    )
    return same and fewer


def _alike_bound(graphs: list[CostGraph | None], k: int, limit: float) -> float:
    """The largest relaxed bound under ``limit`` known of a graph alike ``graphs[k]`` in no
    more bytes, which bounds ``graphs[k]`` as well (0: none is known)."""
    bounds = [
        relaxed_known(g, limit)
        for g in graphs
        if g is not None and g is not graphs[k] and g.mesh == graphs[k].mesh and alike(g, graphs[k])
    ]
    return max((b for b in bounds if b is not None), default=0.0)


def least_memory(graph: CostGraph) -> float:
    """No plan on this graph holds fewer bytes: each node at its option of least memory (the
    memory row of the integer program is this sum; moves hold none)."""
    return graph.const_memory + sum(float(m.min()) for m in graph.memory if len(m))


def whole_within(
    graphs: list[CostGraph],
    k: int,
    past: float,
    row: dict[str, Any],
    build: Any,
    limit: float = math.inf,
    relax: bool = False,
    solved: list[tuple[CostGraph, Solution, float]] = (),  # type: ignore[assignment]
) -> CostGraph | None:
    """Mesh ``k``'s cost graph with its moves (``build`` of the one without, which
    ``graphs[k]`` holds until then), or None when a lower bound shows no plan on it under
    ``limit`` bytes comes in under ``past`` seconds, or that none fits in ``limit`` (``row``
    says which). ``relax``: the linear relaxation is solved even with nothing to beat
    (``past`` infinite), for the optimum it may prove on its way (``relaxed_bound``): the
    optimal search's first mesh. The relaxation is spared where ``solved`` holds the optimum
    already (``solved_alike``), or a graph alike with no more bytes has a relaxed bound
    (that graph's plans include every plan of this one, as fast) past ``past``."""
    row["bound_s"] = lower_bound(graphs[k])
    least = least_memory(graphs[k])
    if least > limit:  # every option's own bytes, each node at its least: nothing fits
        row.update(skipped="memory", least_memory=least)
        return None
    if row["bound_s"] < past:
        graphs[k] = build(graphs[k])
        row["bound_s"] = max(row["bound_s"], lower_bound(graphs[k]))
    if row["bound_s"] < past and (math.isfinite(past) or relax):  # where it can tell
        known = solved_alike(solved, graphs[k], limit)
        if known is not None:
            return graphs[k]
        row["bound_s"] = max(row["bound_s"], _alike_bound(graphs, k, limit) * (1 - 1e-6))
    if row["bound_s"] < past and (math.isfinite(past) or relax):
        row["bound_s"] = max(row["bound_s"], relaxed_bound(graphs[k], limit) * (1 - 1e-6))
    if row["bound_s"] >= past:
        row["skipped"] = "bound"
        return None
    return graphs[k]


__all__ = [
    "alike",
    "bare_graph",
    "bare_graphs",
    "least_memory",
    "moves_once",
    "priced_as",
    "search_session",
    "solved_alike",
    "whole_within",
]
