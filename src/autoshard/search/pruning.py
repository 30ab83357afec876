"""What spares the search most of its work: the ZeRO stages another stage of their mesh
dominates, each mesh's moves priced once for all its stages, and the bounds that skip a mesh
before its moves are priced or its integer program solved (docs/search.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from autoshard.cost import ClusterSpec
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.search.costgraph import (
    CostGraph,
    Moves,
    build_cost_graph,
    dominates,
    moves_of,
    with_moves,
)
from autoshard.search.solvers import lower_bound, relaxed_bound


def moves_once(
    og: OpGraph, cluster: ClusterSpec, depth: Mapping[str, int] | None, step_share: float
) -> Any:
    """A graph built without its moves -> the graph with them; each mesh's moves priced once
    for all its ZeRO stages."""
    moves: dict[MeshInfo, Moves] = {}

    def whole(bare: CostGraph) -> CostGraph:
        if bare.mesh not in moves:
            built = build_cost_graph(
                og, bare.mesh, cluster, depth=depth, zero=bare.zero, step_share=step_share
            )
            moves[bare.mesh] = moves_of(built, bare)
        return with_moves(bare, moves[bare.mesh])

    return whole


def undominated(graphs: list[CostGraph], tried: list[dict[str, Any]]) -> list[int]:
    """The graphs no other graph of their mesh dominates (``dominates``: ZeRO 2 beside 1 where
    both send the same bytes); of equal ones the first. The others are rows of ``tried``."""
    kept: list[int] = []
    for k, graph in enumerate(graphs):
        by = next(
            (j for j, other in enumerate(graphs)
             if j != k and dominates(other, graph) and (j < k or not dominates(graph, other))),
            None,
        )  # fmt: skip
        if by is None:
            kept.append(k)
        else:
            row = {"mesh": graph.mesh.as_dict(), "zero": graph.zero}
            tried.append(row | {"skipped": f"dominated by ZeRO {graphs[by].zero}"})
    return kept


def whole_within(
    graphs: list[CostGraph],
    k: int,
    past: float,
    row: dict[str, Any],
    build: Any,
    limit: float = math.inf,
) -> CostGraph | None:
    """Mesh ``k``'s cost graph with its moves (``build`` of the one without, which
    ``graphs[k]`` holds until then), or None when a lower bound shows no plan on it under
    ``limit`` bytes comes in under ``past`` seconds (``row`` says so)."""
    row["bound_s"] = lower_bound(graphs[k])
    if row["bound_s"] < past:
        graphs[k] = build(graphs[k])
        row["bound_s"] = max(row["bound_s"], lower_bound(graphs[k]))
    if row["bound_s"] < past and math.isfinite(past):  # the relaxation where it can tell
        row["bound_s"] = max(row["bound_s"], relaxed_bound(graphs[k], limit) * (1 - 1e-6))
    if row["bound_s"] >= past:
        row["skipped"] = "bound"
        return None
    return graphs[k]


__all__ = ["moves_once", "undominated", "whole_within"]
