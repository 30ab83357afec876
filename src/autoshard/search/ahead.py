"""The optimal search's meshes built ahead (docs/search.md): a helper process
(``search.helper``) builds the later half of the meshes' graphs without moves while this
process builds the rest; then, while this process works on the mesh its bounds rank first,
the helper prices the moves of its own meshes, as this process would, and solves each of
their ZeRO stages' linear relaxations under the memory limit. Where the search builds one of
those meshes' graphs, it takes the helper's moves and relaxations (waiting for them) instead
of making them; it decides with its own bounds which meshes to build and to solve, so the
plan is the one found without the helper."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from autoshard.cost import ClusterSpec
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.search.costgraph import CostGraph
from autoshard.search.helper import Helper, helper_cores
from autoshard.search.pruning import adopt, alike, bare_graphs, built_for, least_memory
from autoshard.search.solvers import learn_relaxed, lower_bound, relaxed_bound, relaxed_learnt

#: seconds the graphs without moves are expected to take to build, at least, for a helper
#: (``search.ahead``): below, forking costs more than it saves
AHEAD_AFTER_S = 0.1


class MeshesAhead:
    """A helper for the optimal search, where there is a core for it and its graphs are
    large enough (``helped``): it builds the graphs without moves of the later half of
    ``shapes`` (``bare``), then prices the moves of those meshes (in ``shapes`` order) and
    solves their ZeRO stages' relaxations; ``build(k)`` is ``whole`` for ``graphs[k]``, with
    the helper's moves and relaxations where it has them (waiting for them: the helper has
    those meshes' pricing, this process has not). Stopped at the end of a ``with`` block."""

    def __init__(
        self,
        og: OpGraph,
        cluster: ClusterSpec,
        how: tuple[list[MeshInfo], tuple[int, ...], Mapping[str, int] | None, float],
        whole: Callable[[CostGraph], CostGraph],
        limit: float,
        helped: bool = True,
    ) -> None:
        self.og, self.cluster, self.whole, self.limit = og, cluster, whole, limit
        self.how, self.helped = how, helped
        self.helper: Helper | None = None
        self.theirs: list[MeshInfo] = []  # the meshes whose graphs the helper builds
        self.relaxed: dict[MeshInfo, dict[int, Any]] = {}  # the helper's, by ZeRO stage

    def bare(self) -> tuple[list[CostGraph | None], list[float]]:
        """``bare_graphs`` of every shape: the first here, then, with a helper, the later
        half there (from the last) and the rest here meanwhile, and while the helper ends
        its half, the moves of the one of these with the least bound (the likely first)."""
        shapes, levels, depth, share = self.how
        og, cluster, limit = self.og, self.cluster, self.limit
        start = time.perf_counter()
        bare_graphs(og, shapes[:1], levels, cluster, depth, share, limit)
        took = (time.perf_counter() - start) * len(shapes)
        mine = 1 + (len(shapes) - 1) // 2
        if self.helped and took >= AHEAD_AFTER_S and len(shapes) > 1 and helper_cores() > 0:
            theirs = shapes[mine:][::-1]
            try:
                jobs = [("bare", m) for m in theirs] + [("moves", m) for m in theirs[::-1]]
                self.helper = Helper(jobs, self._run)
                self.theirs = theirs
            except (OSError, AssertionError, ValueError):  # no fork here (a daemonic process)
                self.helper = None
        graphs, _ = bare_graphs(og, shapes[:mine], levels, cluster, depth, share, limit)
        if self.helper is not None:  # meanwhile the moves of the likely first of these
            fits = [g for g in graphs if g is not None and least_memory(g) <= limit]
            if fits:
                self.whole(min(fits, key=lower_bound))
        for mesh in self.theirs:
            outcome = self.helper.take(("bare", mesh)) if self.helper is not None else None
            if outcome is not None and outcome[0] == "ok":
                adopt(og, cluster, outcome[1])
        return bare_graphs(og, shapes, levels, cluster, depth, share, limit)

    def _run(self, job: tuple[str, MeshInfo]) -> Any:
        """The helper's job: a mesh's graphs without moves, or its moves and relaxations."""
        kind, mesh = job
        _, levels, depth, share = self.how
        og, cluster, limit = self.og, self.cluster, self.limit
        graphs, _ = bare_graphs(og, [mesh], levels, cluster, depth, share, limit)
        if kind == "bare":
            return built_for(og, cluster, mesh)
        built = [g for g in graphs if g is not None and least_memory(g) <= limit]
        built.sort(key=lambda g: (lower_bound(g), -g.zero))  # as the search ranks them
        done: list[CostGraph] = []  # each stage relaxed but where an alike stage bounds it
        for bare in built:
            graph = self.whole(bare)
            if not any(alike(other, graph) for other in done):
                relaxed_bound(graph, limit)
                done.append(graph)
        learnt = [(g.zero, relaxed_learnt(g).get(limit)) for g in done]
        relaxed = [(zero, found) for zero, found in learnt if found is not None]
        return built_for(og, cluster, mesh, bare=False), relaxed

    def build(self, k: int) -> Callable[[CostGraph], CostGraph]:
        """``whole`` for ``graphs[k]``, taking its mesh's moves from the helper (only when
        the search builds it)."""

        def build(bare: CostGraph) -> CostGraph:
            job = ("moves", bare.mesh)
            outcome = self.helper.take(job) if self.helper is not None else None
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
