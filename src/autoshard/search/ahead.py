"""The optimal search's meshes priced ahead (docs/search.md): while this process works on the
mesh its bounds rank first, a helper process (``search.helper``) prices the moves of the
others in the same order, as this process would, and solves each of their ZeRO stages' linear
relaxations under the memory limit. Where the search builds a mesh's graph, it takes the
helper's moves and relaxations (waiting for them where the helper has begun them) instead of
making them; it decides with its own bounds which meshes to build and to solve, so the plan
is the one found without the helper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autoshard.cost import ClusterSpec
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.search.costgraph import CostGraph
from autoshard.search.helper import Helper, helper_cores
from autoshard.search.pruning import adopt, alike, built_for, least_memory
from autoshard.search.solvers import learn_relaxed, relaxed_bound, relaxed_learnt


class MeshesAhead:
    """The meshes ranked after the first (``ranked``: indices into ``graphs``, several per
    mesh, one per ZeRO stage) offered to a helper, which prices their moves in that order
    (``helped``; where there is a core for it); ``build(k)`` is ``whole`` for ``graphs[k]``,
    with the helper's moves where it has them. Stopped at the end of a ``with`` block."""

    def __init__(
        self,
        og: OpGraph,
        cluster: ClusterSpec,
        graphs: list[CostGraph | None],
        ranked: list[int],
        whole: Callable[[CostGraph], CostGraph],
        limit: float,
        helped: bool = True,
    ) -> None:
        self.og, self.cluster, self.whole, self.limit = og, cluster, whole, limit
        self.helper: Helper | None = None
        self.relaxed: dict[MeshInfo, dict[int, Any]] = {}  # the helper's, by ZeRO stage
        if not helped:
            return
        first: dict[MeshInfo, int] = {}  # each mesh's first graph to be built, in rank order
        for k in ranked:
            graph = graphs[k]
            if graph is not None and least_memory(graph) <= limit:
                first.setdefault(graph.mesh, k)
        jobs = list(first)[1:]  # the first mesh's are this process's to price

        def run(mesh: MeshInfo) -> Any:
            whole(graphs[first[mesh]])
            return built_for(og, cluster, mesh, bare=False), relaxations(mesh)

        def relaxations(mesh: MeshInfo) -> list[tuple[int, Any]]:
            """Each stage's relaxation but where an alike stage's bounds it (``whole_within``)."""
            done: list[CostGraph] = []
            for k in ranked:
                bare = graphs[k]
                if bare is None or bare.mesh != mesh or least_memory(bare) > limit:
                    continue
                graph = whole(bare)
                if not any(alike(other, graph) for other in done):
                    relaxed_bound(graph, limit)
                    done.append(graph)
            learnt = [(g.zero, relaxed_learnt(g).get(limit)) for g in done]
            return [(zero, relaxed) for zero, relaxed in learnt if relaxed is not None]

        if jobs and helper_cores() > 0:
            try:
                self.helper = Helper([], run)
            except (OSError, AssertionError, ValueError):  # no fork here (a daemonic process)
                return
            self.helper.offer(jobs)

    def build(self, k: int) -> Callable[[CostGraph], CostGraph]:
        """``whole`` for ``graphs[k]``, taking its mesh's moves from the helper (only when
        the search builds it)."""

        def build(bare: CostGraph) -> CostGraph:
            outcome = self.helper.take(bare.mesh) if self.helper is not None else None
            if outcome is not None and outcome[0] == "ok":
                adopt(self.og, self.cluster, outcome[1][0])
                self.relaxed[bare.mesh] = dict(outcome[1][1])
            graph = self.whole(bare)
            relaxed = self.relaxed.get(bare.mesh, {}).get(graph.zero)
            if relaxed is not None:  # solved by the helper on a graph equal to this one
                learn_relaxed(graph, self.limit, relaxed)
            return graph

        return build

    def __enter__(self) -> MeshesAhead:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.helper is not None:
            self.helper.stop()


__all__ = ["MeshesAhead"]
