"""The search driver: every mesh shape's cost graph solved, the fastest plan that fits kept,
and ``autoshard.plan``, from a model to a searched :class:`Plan` (docs/search.md)."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from autoshard.cost import ClusterSpec
from autoshard.cost.offload import Offload
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.options import SEARCHES
from autoshard.precision import Precision
from autoshard.search import options, pricing
from autoshard.search.costgraph import CostGraph
from autoshard.search.offloading import offloaded
from autoshard.search.plans import ZERO_LEVELS, Plan, PlanningError
from autoshard.search.pruning import (
    bare_graphs,
    moves_once,
    priced_as,
    search_session,
    solved_alike,
    whole_within,
)
from autoshard.search.result_plan import SearchResult, build_plan
from autoshard.search.solvers import (
    Solution,
    lower_bound,
    restricted,
    solve_optimal,
    solve_propagate,
    solve_recursive,
)
from autoshard.search.state import state


def mesh_shapes(
    num_devices: int,
    cluster: ClusterSpec,
    tp_across_nodes: bool = False,
    cp: int = 1,
    tp_degree: int | None = None,
) -> list[MeshInfo]:
    """Every ``dp x tp`` factorization of the devices, ``tp`` inside a node unless allowed;
    ``dp x cp x tp`` with ``cp`` fixed when it is more than 1 (the inputs' sequence over it,
    ``cp x tp`` inside a node where it fits); only ``tp_degree`` when given."""
    out = []
    if cp < 1 or num_devices % cp:
        raise PlanningError(f"cp {cp} does not divide the {num_devices} devices")
    if tp_degree is not None and (tp_degree < 1 or (num_devices // cp) % tp_degree):
        leaves = " a context-parallel group leaves" if cp > 1 else ""
        raise PlanningError(
            f"tp {tp_degree} does not divide the {num_devices // cp} devices{leaves}"
        )
    for tp in range(1, num_devices // cp + 1):
        if (num_devices // cp) % tp or (tp_degree is not None and tp != tp_degree):
            continue
        if tp > cluster.devices_per_node and not tp_across_nodes and tp_degree is None:
            continue
        if cp == 1:
            out.append(MeshInfo(("dp", "tp"), (num_devices // tp, tp), ("dp",)))
        else:
            sizes = (num_devices // (cp * tp), cp, tp)
            out.append(MeshInfo(("dp", "cp", "tp"), sizes, ("dp",), ("cp",)))
    return out


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for a search: the search makes millions of small
    acyclic objects (layouts, grid states, priced steps) and keeps many in its caches, so each
    automatic full collection walks them all again (a quarter of GPT-3 175B's planning time).
    What the search leaves is freed by reference counting; cycles wait for the next collection
    after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_search(
    og: OpGraph,
    num_devices: int,
    cluster: ClusterSpec,
    *,
    search: str = "optimal",
    mesh: MeshInfo | None = None,
    memory_limit: float | None = None,
    tp_across_nodes: bool = False,
    depth: Mapping[str, int] | None = None,
    fixed: Mapping[str, Any] | None = None,
    zero: int | None = None,
    step_share: float = 1.0,
    cp: int = 1,
    attention: str | None = None,
    sequence_parallel: bool = False,
    precision: Precision | None = None,
    tp: int | None = None,
    offload: Mapping[str, Any] | str | None = None,
) -> SearchResult:
    """The fastest plan that fits, over every mesh shape (or the given ``mesh``, or those of
    tensor-parallel degree ``tp``) and ZeRO stage (or the given ``zero``); ``step_share``:
    see ``build_cost_graph``. ``cp``: a context-parallel axis of that size in every mesh;
    ``attention``: the one method attention over a split sequence may use
    (``ATTENTION_METHODS``; None: the search's choice); ``sequence_parallel``: every op split
    over the tensor-parallel axes where it can be; ``precision``: the mixed precision policy
    a run keeps the parameters under (``og`` captured in its compute dtype; the master
    weights in its resolved ``master``); ``offload``: what is kept off the device (None:
    nothing; "auto": searched, ``search.offloading``)."""
    if search not in SEARCHES:
        raise ValueError(f"search={search!r}: expected one of {', '.join(SEARCHES)}")
    # The pricing caches are keyed by graph nodes and id(cluster): they belong to this search
    # alone, emptied before it and after it (nodes and clusters of another could share ids),
    # or to the searches of one ``search_session`` (a pipeline search's)
    with search_session():
        mesh_list = [mesh] if mesh else mesh_shapes(num_devices, cluster, tp_across_nodes, cp, tp)
        sequence = _sequence(og, mesh_list)

        def searched(choice: Offload, level: int | None) -> SearchResult:
            priced_as((attention, sequence, sequence_parallel, precision, choice))
            context = options.searching(attention, sequence, sequence_parallel)
            with paused_gc(), context, pricing.priced_under(precision, choice or None):
                return _run_search(
                    og,
                    num_devices,
                    cluster,
                    search,
                    mesh_list,
                    memory_limit,
                    depth,
                    fixed,
                    level,
                    step_share,
                    precision,
                    choice,
                )

        built = (lambda r: build_plan(og, r, cluster)) if step_share == 1 else None
        return offloaded(searched, offload, zero, built, cluster)


def _sequence(og: OpGraph, meshes: list[MeshInfo]) -> int | None:
    """The inputs' sequence length (dim 1), which a context-parallel axis follows; None
    when no mesh has one."""
    if not any(m.cp for m in meshes):
        return None
    shapes = [info.shape for info in og if info.kind == "input" and len(info.shape) > 1]
    return shapes[0][1] if shapes else None


def _run_search(
    og: OpGraph,
    num_devices: int,
    cluster: ClusterSpec,
    search: str,
    shapes: list[MeshInfo],
    memory_limit: float | None,
    depth: Mapping[str, int] | None,
    fixed: Mapping[str, Any] | None,
    zero: int | None,
    step_share: float = 1.0,
    precision: Precision | None = None,
    offload: Offload | None = None,
) -> SearchResult:
    start = time.perf_counter()
    limit = cluster.memory_bytes if memory_limit is None else memory_limit
    levels = ZERO_LEVELS if zero is None else (zero,)
    meshes = [m for m in shapes for _ in levels]
    tried: list[dict[str, Any]] = []
    solved: list[tuple[CostGraph, Solution, float]] = state().caches["optima"].setdefault(0, [])
    best: tuple[int, Solution] | None = None
    found: list[tuple[int, Solution, dict[str, Any]]] = []
    estimated = _Estimates(og, cluster, precision, offload)
    whole = moves_once(og, cluster, depth, step_share)
    # first each mesh's options without the moves between them (cheap): a lower bound
    # that orders the meshes (at a tie the higher ZeRO stage first: its optimum may serve
    # the lower's) and skips those that cannot win before their moves are priced
    graphs, floors = bare_graphs(og, shapes, levels, cluster, depth, step_share, limit)
    ranked = sorted(range(len(meshes)), key=lambda k: _rank(graphs[k], floors[k]))
    for k in ranked:
        row: dict[str, Any] = {"mesh": meshes[k].as_dict(), "zero": levels[k % len(levels)]}
        if graphs[k] is None:  # not built: ZeRO 3 on this mesh does not fit: nothing does
            tried.append({**row, "skipped": "memory", "least_memory": floors[k]})
            continue
        past = math.inf if best is None else best[1].seconds * (1 + FINALIST_MARGIN)
        graph = whole_within(
            graphs, k, past, row, whole, limit, relax=search == "optimal", solved=solved
        )
        if graph is None:
            tried.append(row)
            continue
        solve = _solver(search, graph, fixed, solved)
        sol = _fitting(estimated, solve, graph, meshes[k], limit)
        if sol is None:
            row["fits"] = False
        else:
            row.update(step_s=sol.seconds, memory=sol.memory, solve_s=sol.solve_seconds)
            found.append((k, sol, row))
            if best is None or _better(sol, meshes[k], best[1], meshes[best[0]]):
                best = (k, sol)
        tried.append(row)
    if best is None:
        raise PlanningError(_nothing_fits(og, graphs, meshes, cluster, limit, num_devices))
    k, sol = _final(estimated, found, best, meshes, graphs)
    seconds = time.perf_counter() - start
    made = estimated.made(graphs[k], sol)
    return SearchResult(meshes[k], graphs[k], sol, tried, seconds, precision, made, offload)


def _rank(graph: CostGraph | None, floor: float) -> tuple[bool, float, int]:
    """The order meshes are tried in: by lower bound, the higher ZeRO stage first at a tie;
    the graphs not built last, by their floor."""
    if graph is None:
        return (True, floor, 0)
    return (False, lower_bound(graph), -graph.zero)


#: a ratio: solutions whose search objective is within (1 + this) of the best one are the
#: finalists the estimate prices, whose timeline sees the overlap a sum over ops cannot
#: (ZeRO's gathers in forward); a mesh whose lower bound is past it is not searched
FINALIST_MARGIN = 0.05


class _Estimates:
    """``build_plan`` of a search's solutions, once each (``_fitting``'s, then ``_final``'s)."""

    def __init__(
        self, og: OpGraph, cluster: ClusterSpec, precision: Precision | None, offload: Any = None
    ) -> None:
        self.og, self.cluster, self.precision, self.offload = og, cluster, precision, offload
        self.built: dict[tuple, Plan] = {}

    def __call__(self, mesh: MeshInfo, graph: CostGraph, sol: Solution) -> Plan:
        key = (id(graph), tuple(sol.choice))  # (the graphs outlive the search)
        if key not in self.built:
            result = SearchResult(mesh, graph, sol, [], 0.0, self.precision, None, self.offload)
            self.built[key] = build_plan(self.og, result, self.cluster)
        return self.built[key]

    def made(self, graph: CostGraph, sol: Solution) -> Any:
        """The estimate of ``sol`` on ``graph``, where it was made (else None)."""
        built = self.built.get((id(graph), tuple(sol.choice)))
        return None if built is None else built.predicted


def _final(
    estimated: _Estimates,
    found: list[tuple[int, Solution, dict[str, Any]]],
    best: tuple[int, Solution],
    meshes: list[MeshInfo],
    graphs: list[CostGraph],
) -> tuple[int, Solution]:
    """The finalist the estimate predicts fastest (the search's best when it is alone)."""
    finalists = [f for f in found if f[1].seconds <= best[1].seconds * (1 + FINALIST_MARGIN)]
    if len(finalists) == 1:
        return best
    chosen, fastest, tie = best, math.inf, (math.inf, math.inf)
    for k, sol, row in finalists:
        predicted = estimated(meshes[k], graphs[k], sol).predicted
        row["predicted_s"], row["predicted_memory"] = predicted.step_time, predicted.peak_memory
        order = (meshes[k].sizes[-1], row["predicted_memory"])  # as fast: fewer tp, less memory
        if row["predicted_s"] < fastest * (1 - 1e-9) or (
            row["predicted_s"] <= fastest * (1 + 1e-9) and order < tie
        ):
            chosen, fastest, tie = (k, sol), min(fastest, row["predicted_s"]), order
    return chosen


def _solver(
    search: str,
    graph: CostGraph,
    fixed: Mapping[str, Any] | None,
    solved: list[tuple[CostGraph, Solution, float]],
) -> Any:
    """The search as a function of the memory limit; ``solved``: the optima found so far,
    which the optimal search reads its own off where it can (and adds to)."""
    chosen = _fixed_options(graph, fixed or {})
    if chosen and search != "propagate":  # the strategies given: each keeps its one option
        return _pinned(search, graph, chosen)
    if search == "optimal":

        def optimal(limit: float) -> Solution | None:
            sol = solved_alike(solved, graph, limit)
            if sol is None:
                sol = solve_optimal(graph, limit)
                if sol is not None:
                    solved.append((graph, sol, limit))
            return sol

        return optimal
    if search == "recursive":
        return lambda limit: solve_recursive(graph, limit)
    return lambda limit: solve_propagate(graph, chosen, limit)


def _pinned(search: str, graph: CostGraph, chosen: dict[int, int]) -> Any:
    """The optimal or recursive search over ``graph`` with node i held to option ``chosen[i]``."""
    kept = [
        np.array([chosen[i]] if i in chosen else range(len(o))) for i, o in enumerate(graph.options)
    ]
    inner = restricted(graph, kept)
    solver = solve_optimal if search == "optimal" else solve_recursive

    def solve(limit: float) -> Solution | None:
        sol = solver(inner, limit)
        if sol is not None:  # the options by their index in ``graph``
            sol.choice = [int(k[s]) for k, s in zip(kept, sol.choice, strict=True)]
        return sol

    return solve


def _fitting(
    estimated: _Estimates, solve: Any, graph: CostGraph, mesh: MeshInfo, limit: float
) -> Solution | None:
    """The search's solution under ``limit``, with room for what ZeRO's units hold beside the
    sum over ops (two units' gathered parameters and gradient buffers, which depend on the
    layouts chosen): solved again with that much less room while the plan's estimate is over
    the limit (the units hardly change between such plans)."""
    room = limit
    for _ in range(4):
        sol = solve(room)
        if sol is None or graph.zero < 2:
            return sol
        over = estimated(mesh, graph, sol).predicted.peak_memory - limit
        if over <= 0:
            return sol
        room -= over
    return None


def _nothing_fits(
    og: OpGraph,
    graphs: list[CostGraph | None],
    meshes: list[MeshInfo],
    cluster: ClusterSpec,
    limit: float,
    num_devices: int,
) -> str:
    """What a user reads when no plan fits: the plan of least memory found (of the graphs
    built: None where a mesh's was not), its breakdown, which part is over the limit, and what
    would make it fit."""
    least = {i: _least_memory(g) for i, g in enumerate(graphs) if g is not None}
    k = min(least, key=lambda i: least[i].memory)
    result = SearchResult(meshes[k], graphs[k], least[k], [], 0.0, state().precision)
    est = build_plan(og, result, cluster).predicted
    parts = ", ".join(f"{kind} {size_text(v)}" for kind, v in est.memory.items())
    states = est.peak_memory - est.memory["activations"]
    if states > limit:
        over = f"the model state alone ({size_text(states)}) is over the limit"
        remedy = "more devices (ZeRO 3 divides the model state by the data-parallel ranks)"
    else:
        over = f"the activations ({size_text(est.memory['activations'])}) take what is left"
        remedy = "a smaller batch or sequence per device, or more devices"
    return (
        f"no plan fits in {size_text(limit)} per device on {num_devices} devices: the smallest "
        f"peak found is {size_text(est.peak_memory)} (mesh {meshes[k].describe(' x ')}, ZeRO "
        f"{graphs[k].zero}: {parts}); {over}. Needs {remedy}"
    )


def size_text(nbytes: float) -> str:
    """Bytes in the largest unit they fill."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _least_memory(graph: CostGraph) -> Solution:
    """Each node's option of least memory (the memory is a sum over nodes)."""
    choice = [int(m.argmin()) for m in graph.memory]
    seconds, memory = graph.objective(choice)
    return Solution(choice, seconds, memory, "least memory")


def _better(sol: Solution, mesh: MeshInfo, best: Solution, best_mesh: MeshInfo) -> bool:
    """Faster; or as fast (all axes on the batch: the same plan on any shape) with fewer tp,
    then with less memory (ZeRO 2 over 1: the same bytes sent)."""
    if sol.seconds < best.seconds * (1 - 1e-9):
        return True
    if sol.seconds > best.seconds * (1 + 1e-9):
        return False
    return (mesh.sizes[-1], sol.memory) < (best_mesh.sizes[-1], best.memory)


def _fixed_options(graph: CostGraph, fixed: Mapping[str, Any]) -> dict[int, int]:
    out = {}
    for name, strategy in fixed.items():
        if name not in graph.names:
            continue
        i = graph.names.index(name)
        for s, opt in enumerate(graph.options[i]):
            if opt.strategy.ins == strategy.ins and opt.strategy.outs == strategy.outs:
                out[i] = s
                break
    return out


__all__ = ["SEARCHES", "mesh_shapes", "run_search", "size_text"]
