"""The solvers: one option per decision node of a cost graph (docs/search.md).

``solve_optimal`` is an integer program (HiGHS, ``program.py``) and exact; ``solve_recursive``
chooses axis by axis and sweeps, linear in the graph; ``solve_propagate`` spreads fixed choices
breadth first; ``exhaustive.brute_force`` enumerates small graphs and is the tests' reference.
``lower_bound`` says no plan on a mesh is faster, so the driver can skip mesh shapes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.search.costgraph import CostGraph
from autoshard.search.options import Option
from autoshard.search.program import SCALE, Program, build_program, solve_program


@dataclass
class Solution:
    choice: list[int]
    seconds: float
    memory: float
    search: str
    solve_seconds: float = 0.0


@dataclass
class _Relaxed:
    """What ``relaxed_bound`` learnt of a graph under one memory limit, for ``solve_optimal``."""

    bound: float  # the relaxation's optimum, in the program's unit, less ``const_time``
    x: np.ndarray  # the binaries' values
    reduced: np.ndarray  # the binaries' reduced costs
    optimum: Solution | None  # the integer optimum, where the relaxation proved it


def solve_optimal(graph: CostGraph, memory_limit: float = math.inf) -> Solution | None:
    """The exact optimum of the cost graph under the memory limit (None when nothing fits):
    the one ``relaxed_bound`` proved on its way where it did, else the integer program's, on
    the options its relaxation leaves in the running where it was solved (``_in_the_running``)."""
    start = time.perf_counter()
    learnt = graph.relaxed
    proved = learnt.get(memory_limit)
    if proved is not None and proved.optimum is not None:
        sol = proved.optimum
        return Solution(list(sol.choice), sol.seconds, sol.memory, sol.search, sol.solve_seconds)
    # a relaxation under a larger limit bounds every plan under this one as well
    looser = [limit for limit in learnt if limit >= memory_limit]
    kept = _in_the_running(graph, memory_limit, learnt[min(looser)]) if looser else None
    solved = graph if kept is None else restricted(graph, kept)
    program, c, a = build_program(solved, memory_limit)
    result = solve_program(program, c, a, integral=True)
    if result.x is None and kept is not None:
        # the narrowed program holds a plan that fits (the incumbent); were it found
        # infeasible all the same (HiGHS's tolerances), the whole program answers
        solved, kept = graph, None
        program, c, a = build_program(solved, memory_limit)
        result = solve_program(program, c, a, integral=True)
    if result.x is None:
        return None
    offsets = program.offsets
    choice = [
        int(np.argmax(result.x[offsets[i] : offsets[i] + len(o)]))
        for i, o in enumerate(solved.options)
    ]
    if kept is not None:
        choice = [int(k[s]) for k, s in zip(kept, choice, strict=True)]
    seconds, memory = graph.objective(choice)
    return Solution(choice, seconds, memory, "optimal", time.perf_counter() - start)


def relaxed_bound(graph: CostGraph, memory_limit: float = math.inf) -> float:
    """No plan on this mesh under the memory limit is faster (seconds; infinity when none
    fits): the integer program's linear relaxation, a tenth of the integer solve or less and
    far tighter than ``lower_bound``, since it keeps the moves' marginals and the limit.
    Solved once a graph and limit."""
    known = graph.relaxed.get(memory_limit)
    if known is not None:
        return graph.const_time + known.bound / SCALE
    start = time.perf_counter()
    program, c, a = build_program(graph, memory_limit)
    result = solve_program(program, c, a, integral=False)
    if result.x is None or result.reduced is None:
        return math.inf
    bound = graph.const_time + float(result.fun) / SCALE
    optimum = _if_optimal(graph, memory_limit, program, result.x, bound, start)
    n = program.num_x
    graph.relaxed[memory_limit] = _Relaxed(
        float(result.fun), result.x[:n], result.reduced[:n], optimum
    )
    return bound


def relaxed_known(graph: CostGraph, memory_limit: float) -> float | None:
    """The bound a relaxation of ``graph`` already solved under ``memory_limit`` or more room
    gives under ``memory_limit`` (None: none was solved)."""
    bounds = [r.bound for limit, r in graph.relaxed.items() if limit >= memory_limit]
    return graph.const_time + max(bounds) / SCALE if bounds else None


def _if_optimal(
    graph: CostGraph, limit: float, program: Program, x: np.ndarray, bound: float, start: float
) -> Solution | None:
    """The relaxation's solution, read as one option per node, is the integer optimum when it
    fits ``limit`` and takes no longer than the relaxation's bound (no plan does less). In
    the search about half of the relaxations are integral so."""
    choice = _rounded(graph, x)
    seconds, memory = graph.objective(choice)
    if memory > limit or seconds > bound + abs(bound) * 1e-9:
        return None
    return Solution(choice, seconds, memory, "optimal", time.perf_counter() - start)


def _rounded(graph: CostGraph, x: np.ndarray) -> list[int]:
    """Each node's option of most weight in a relaxation's binaries ``x``."""
    choice, at = [], 0
    for opts in graph.options:
        choice.append(int(np.argmax(x[at : at + len(opts)])))
        at += len(opts)
    return choice


def _in_the_running(graph: CostGraph, limit: float, relaxed: _Relaxed) -> list[np.ndarray] | None:
    """Each node's options that the optimum under ``limit`` may take (None: all of them):
    reduced-cost fixing. Every plan that fits costs at least the relaxation's optimum plus
    the reduced cost of each binary it sets (LP duality: the other terms are not negative),
    so an option whose reduced cost is more than a plan that fits (``_incumbent``) costs over
    that optimum is in no optimum."""
    seconds = _incumbent(graph, limit, relaxed.x)
    if seconds is None:
        return None
    incumbent = (seconds - graph.const_time) * SCALE
    slack = incumbent - relaxed.bound + 1e-6 * abs(incumbent) + 1e-2  # (the duals' rounding)
    kept, at = [], 0
    for opts in graph.options:
        kept.append(np.flatnonzero(relaxed.reduced[at : at + len(opts)] <= slack))
        at += len(opts)
    if sum(len(k) for k in kept) == at or any(len(k) == 0 for k in kept):
        return None
    return kept


def restricted(graph: CostGraph, kept: Sequence[np.ndarray]) -> CostGraph:
    """``graph`` with node i's options ``kept[i]`` only (option s of the result is option
    ``kept[i][s]`` of ``graph``), priced as in ``graph``."""

    def each(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a[k] for a, k in zip(arrays, kept, strict=True)]

    return dataclasses.replace(
        graph,
        options=[[opts[s] for s in k] for opts, k in zip(graph.options, kept, strict=True)],
        unary=each(graph.unary),
        memory=each(graph.memory),
        overlap=each(graph.overlap) if graph.overlap else [],
        window=each(graph.window) if graph.window else [],
        edges={(i, j): m[np.ix_(kept[i], kept[j])] for (i, j), m in graph.edges.items()},
    )


def _incumbent(graph: CostGraph, limit: float, x: np.ndarray) -> float | None:
    """The seconds of a plan that fits ``limit``, near the relaxation ``x``: ``x`` rounded,
    swept op by op, and brought under the limit where it is over (None: none found)."""
    nbrs, order = graph.neighbours(), range(len(graph.names))
    rounded = _rounded(graph, x)
    swept = list(rounded)
    _sweep(graph, nbrs, order, swept, 0.0, 4)
    best = None
    for choice in (rounded, swept):
        seconds, memory = graph.objective(choice)
        if memory > limit:
            fitted = _repair(graph, nbrs, order, choice, limit)
            if fitted is None:
                continue
            seconds = fitted.seconds
        best = seconds if best is None else min(best, seconds)
    return best


def _local_cost(graph, nbrs, i, s, choice, lam):
    cost = graph.unary[i][s] + lam * graph.memory[i][s]
    for j, m in nbrs[i]:
        if choice[j] is not None:
            cost += m[s, choice[j]]
    return cost


def solve_recursive(graph: CostGraph, memory_limit: float = math.inf, sweeps: int = 20):
    """``search="recursive"``: a Lagrangian local search (docs/search.md; not MindSpore's
    recursive programming). Several starts, each swept (single and edge-pair re-choice on the
    objective) until nothing moves; memory priced per byte, the price bisected down to the
    cheapest that fits, then op by op within the limit. Linear passes."""
    start = time.perf_counter()
    nbrs = graph.neighbours()
    order = sorted(range(len(graph.names)), key=lambda i: -graph.weight[i])
    num_axes = len(graph.options[0][0].assign) if graph.options and graph.options[0] else 0

    near: list[tuple[float, list[int]]] = []  # plans a little over the limit, to repair
    propagated = solve_propagate(graph).choice

    def attempt(lam: float) -> tuple[Solution | None, list[int]]:
        starts = [
            _by_axes(graph, nbrs, order, num_axes, reversed(range(num_axes)), lam),
            _by_axes(graph, nbrs, order, num_axes, range(num_axes), lam),
            [_data_parallel_option(opts) for opts in graph.options],
            [int(np.argmin(u + lam * m)) for u, m in zip(graph.unary, graph.memory, strict=True)],
            list(propagated),
        ]
        fits = []
        for choice in starts:
            for _ in range(sweeps):
                _sweep(graph, nbrs, order, choice, lam, sweeps)
                if not _pair_sweep(graph, nbrs, choice, lam):
                    break
            seconds, memory = graph.objective(choice)
            if memory <= memory_limit:
                fits.append(Solution(list(choice), seconds, memory, "recursive"))
            elif memory <= memory_limit * 1.25:
                near.append((seconds, list(choice)))
        return (min(fits, key=lambda s: s.seconds) if fits else None), starts[0]

    best, first = attempt(0.0)
    lam_lo, lam_hi = 0.0, 0.0
    for _ in range(40):
        if best is not None:
            break
        seconds, memory = graph.objective(first)
        lam_lo, lam_hi = lam_hi, max(lam_hi * 4, seconds / max(memory, 1.0))
        best, first = attempt(lam_hi)
    if best is not None and lam_hi > 0:
        for _ in range(8):  # the cheapest price of memory that still fits
            lam = (lam_lo + lam_hi) / 2
            found, _ = attempt(lam)
            if found is None:
                lam_lo = lam
                continue
            lam_hi = lam
            if found.seconds < best.seconds:
                best = found
        _fit_sweep(graph, nbrs, order, best, memory_limit)
        # the fastest plans that missed the limit by a little, brought under it op by op
        repaired = [_repair(graph, nbrs, order, c, memory_limit) for _, c in sorted(near)[:3]]
        best = min([best, *(r for r in repaired if r is not None)], key=lambda r: r.seconds)
    if best is not None:
        best.solve_seconds = time.perf_counter() - start
    return best


def _fit_sweep(graph, nbrs, order, sol: Solution, memory_limit: float) -> None:
    """Re-choose op by op for time alone, among the options that keep the plan in the limit."""
    choice = sol.choice
    memory = sol.memory
    for _ in range(20):
        changed = False
        for i in order:
            c = choice[i]
            room = memory_limit - (memory - graph.memory[i][c])
            costs = [
                _local_cost(graph, nbrs, i, s, choice, 0.0)
                if graph.memory[i][s] <= room
                else math.inf
                for s in range(len(graph.options[i]))
            ]
            s = int(np.argmin(costs))
            if costs[s] < costs[c] - 1e-15:
                memory += graph.memory[i][s] - graph.memory[i][c]
                choice[i], changed = s, True
        if not changed:
            break
    sol.seconds, sol.memory = graph.objective(choice)


def _repair(graph, nbrs, order, choice: list[int], memory_limit: float) -> Solution | None:
    """``choice`` brought under the memory limit by changing one op at a time, each time the
    change that costs the least time per byte it saves, then swept for time within the limit;
    None if it cannot get there."""
    choice = list(choice)
    memory = graph.objective(choice)[1]
    for _ in range(len(choice)):
        if memory <= memory_limit:
            fitted = Solution(choice, *graph.objective(choice), "recursive")
            _fit_sweep(graph, nbrs, order, fitted, memory_limit)
            return fitted
        best: tuple[float, int, int] | None = None
        for i, c in enumerate(choice):
            here = _local_cost(graph, nbrs, i, c, choice, 0.0)
            for s in range(len(graph.options[i])):
                saved = graph.memory[i][c] - graph.memory[i][s]
                if saved > 0:
                    rate = (_local_cost(graph, nbrs, i, s, choice, 0.0) - here) / saved
                    if best is None or rate < best[0]:
                        best = (rate, i, s)
        if best is None:
            return None
        _, i, s = best
        memory += graph.memory[i][s] - graph.memory[i][choice[i]]
        choice[i] = s
    return None


def _by_axes(graph, nbrs, order, num_axes, axes, lam) -> list[int]:
    """Each axis in turn: every op (heaviest first) picks the dim it splits, the other axes as
    already chosen (later ones unsplit)."""
    assign: list[list[int | None]] = [[None] * num_axes for _ in graph.names]
    by_assign = [{o.assign: s for s, o in enumerate(opts)} for opts in graph.options]
    choice: list[int | None] = [by_assign[i].get(tuple(a)) for i, a in enumerate(assign)]
    for axis in axes:
        for i in order:
            best_s, best_c = choice[i], math.inf
            for s, opt in enumerate(graph.options[i]):
                if any(opt.assign[a] != assign[i][a] for a in range(num_axes) if a != axis):
                    continue
                c = _local_cost(graph, nbrs, i, s, choice, lam)
                if c < best_c:
                    best_s, best_c = s, c
            choice[i] = best_s
            if best_s is not None:
                assign[i] = list(graph.options[i][best_s].assign)
    return [0 if c is None else c for c in choice]


def _data_parallel_option(opts: list[Option]) -> int:
    """The option that puts every axis on the first dim (else the one splitting the most)."""
    for s, opt in enumerate(opts):
        if opt.assign and all(d == 0 for d in opt.assign):
            return s
    return max(range(len(opts)), key=lambda s: sum(d is not None for d in opts[s].assign))


def _totals(graph, choice) -> tuple[float, float]:
    """(bucketed gradient sums, backward window) of ``choice``: what the objective's hidden
    overlap is the least of."""
    if not graph.overlap:
        return 0.0, 0.0
    bucketed = sum(o[c] for o, c in zip(graph.overlap, choice, strict=True))
    window = graph.const_window + sum(w[c] for w, c in zip(graph.window, choice, strict=True))
    return float(bucketed), float(window)


def _pair_sweep(graph, nbrs, choice, lam) -> bool:
    """Every edge re-chooses both its ends together, the rest fixed, by the objective itself
    (the overlap the backward hides included); True if anything moved."""
    changed = False
    for (i, j), m in graph.edges.items():
        ui = graph.unary[i] + lam * graph.memory[i]
        uj = graph.unary[j] + lam * graph.memory[j]
        for k, mk in nbrs[i]:
            if k != j:
                ui = ui + mk[:, choice[k]]
        for k, mk in nbrs[j]:
            if k != i:
                uj = uj + mk[:, choice[k]]
        total = ui[:, None] + uj[None, :] + m
        if graph.overlap:
            bucketed, window = _totals(graph, choice)
            ci, cj = choice[i], choice[j]
            b = bucketed - graph.overlap[i][ci] - graph.overlap[j][cj]
            w = window - graph.window[i][ci] - graph.window[j][cj]
            total = total - np.minimum(
                b + graph.overlap[i][:, None] + graph.overlap[j][None, :],
                w + graph.window[i][:, None] + graph.window[j][None, :],
            )
        s, t = np.unravel_index(int(np.argmin(total)), total.shape)
        if total[s, t] < total[choice[i], choice[j]] - 1e-15:
            choice[i], choice[j] = int(s), int(t)
            changed = True
    return changed


def _sweep(graph, nbrs, order, choice, lam, sweeps) -> None:
    """Op by op (heaviest first), the option of least objective, the others fixed."""
    bucketed, window = _totals(graph, choice)
    for _ in range(sweeps):
        changed = False
        for i in order:
            c = choice[i]
            costs = np.array(
                [_local_cost(graph, nbrs, i, s, choice, lam) for s in range(len(graph.options[i]))]
            )
            if graph.overlap:
                costs = costs - np.minimum(
                    bucketed - graph.overlap[i][c] + graph.overlap[i],
                    window - graph.window[i][c] + graph.window[i],
                )
            s = int(np.argmin(costs))
            if costs[s] < costs[c] - 1e-15:
                choice[i], changed = s, True
                if graph.overlap:
                    bucketed += graph.overlap[i][s] - graph.overlap[i][c]
                    window += graph.window[i][s] - graph.window[i][c]
        if not changed:
            return


def solve_propagate(
    graph: CostGraph, fixed: Mapping[int, int] | None = None, memory_limit: float = math.inf
):
    """Sharding propagation: fixed nodes keep their option; the others, breadth-first, take the
    option with the least edge cost to the nodes already decided (compute breaks ties)."""
    start = time.perf_counter()
    nbrs = graph.neighbours()
    choice: list[int | None] = [None] * len(graph.names)
    queue: deque[int] = deque()
    for i, s in (fixed or {}).items():
        choice[i] = s
        queue.append(i)
    while None in choice:
        if not queue:
            seed = max(
                (i for i, c in enumerate(choice) if c is None), key=lambda i: graph.weight[i]
            )
            choice[seed] = int(np.argmin(graph.unary[seed]))
            queue.append(seed)
        while queue:
            i = queue.popleft()
            for j, _ in nbrs[i]:
                if choice[j] is not None:
                    continue
                costs = []
                for t in range(len(graph.options[j])):
                    edge = sum(m[t, choice[k]] for k, m in nbrs[j] if choice[k] is not None)
                    costs.append((edge, graph.unary[j][t]))
                choice[j] = min(range(len(costs)), key=costs.__getitem__)
                queue.append(j)
    seconds, memory = graph.objective(choice)
    if memory > memory_limit:
        return None
    return Solution(list(choice), seconds, memory, "propagate", time.perf_counter() - start)


def lower_bound(graph: CostGraph) -> float:
    """No plan on this mesh is faster: each edge is charged to one of its ends at the cheapest
    cost that end's option allows, and each node takes its cheapest option with the edges it
    was charged (the larger of charging every edge to its first or to its second end)."""
    best = -math.inf
    # the objective is the larger of two sums: with every bucketed sum hidden, and with all
    # the backward compute hiding them (docs/search.md); each bounds it from below
    overlap = graph.overlap or [np.zeros_like(u) for u in graph.unary]
    window = graph.window or [np.zeros_like(u) for u in graph.unary]
    for hide, offset in ((overlap, 0.0), (window, graph.const_window)):
        for end in (0, 1):
            totals = [u - h for u, h in zip(graph.unary, hide, strict=True)]
            for key, m in graph.edges.items():
                totals[key[end]] += m.min(axis=1 - end)
            best = max(best, sum(float(t.min()) for t in totals) - offset)
    return graph.const_time + best


__all__ = [
    "Solution",
    "lower_bound",
    "relaxed_bound",
    "solve_optimal",
    "solve_propagate",
    "solve_recursive",
]
