"""The integer program of a cost graph and HiGHS on it (docs/search.md): a binary per
(node, option), a continuous variable per (edge, pair of option classes) tied to both ends,
one memory row, and the exposed gradient sums; ``solvers.solve_optimal`` and
``relaxed_bound`` solve it whole and relaxed."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoshard.search.costgraph import CostGraph
from autoshard.search.state import cache

#: the objective's unit, microseconds: its coefficients stay near 1, and HiGHS's tolerances
#: (1e-6 absolute gap, 1e-7 feasibility) stay below the nanoseconds plans can differ by
SCALE = 1e6


class Program:
    """The integer program of a cost graph: binaries per (node, option), then continuous edge
    variables tied to both ends (their rows and columns sum to the end's binaries), and the
    constraint rows in coordinate form.

    An edge's options are taken in classes: options of one end whose rows (columns) of the
    move matrix are equal cost the same against every option of the other end, so a variable
    per pair of classes, tied to the sums of its classes' binaries, prices the moves as one
    per pair of options does, relaxed as well (``_classes``; docs/search.md). An edge one of
    whose ends has one class is linear in the other's binaries: it is priced on them."""

    def __init__(self, graph: CostGraph) -> None:
        self.offsets, n = [], 0
        for opts in graph.options:
            self.offsets.append(n)
            n += len(opts)
        self.num_x = n
        self.linear = np.zeros(n)  # the moves of one-class edges, on the binaries
        self.edge_offsets: dict[tuple[int, int], int] = {}
        self.classes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for (i, j), m in graph.edges.items():
            rows, cols, cost = _classes(m)
            if cost.shape[0] == 1:
                self.linear[self.offsets[j] : self.offsets[j] + m.shape[1]] += cost[0, cols]
            elif cost.shape[1] == 1:
                self.linear[self.offsets[i] : self.offsets[i] + m.shape[0]] += cost[rows, 0]
            else:
                self.classes[(i, j)] = (rows, cols, cost)
                self.edge_offsets[(i, j)] = n
                n += cost.size
        self.exposed = n  # the bucketed gradient sums that outlast backward
        self.num_vars = n + 1
        # the constraint rows in coordinate form, in chunks (``coordinates``)
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def objective(self, graph: CostGraph) -> np.ndarray:
        scale = SCALE
        c = np.zeros(self.num_vars)
        for i, u in enumerate(graph.unary):
            hidden = graph.overlap[i] if graph.overlap else 0.0
            c[self.offsets[i] : self.offsets[i] + len(u)] = (u - hidden) * scale
        c[: self.num_x] += self.linear * scale
        for key, (_, _, cost) in self.classes.items():
            c[self.edge_offsets[key] : self.edge_offsets[key] + cost.size] = cost.ravel() * scale
        c[self.exposed] = 1.0  # already in the scaled unit (``exposure``)
        return c

    def row(self, cols: Any, vals: Any, lo: float, hi: float) -> None:
        self.block(np.zeros(len(cols), np.int64), cols, vals, [lo], [hi])

    def block(
        self,
        rows: Any,
        cols: Any,
        vals: Any,
        lo: Sequence[float],
        hi: Sequence[float] | None = None,
    ) -> None:
        """``len(lo)`` rows at once (``rows`` numbers them from 0), between ``lo`` and ``hi``
        (None: equal to ``lo``)."""
        self.rows.append(np.asarray(rows, np.int64) + len(self.lo))
        self.cols.append(np.asarray(cols, np.int64))
        self.vals.append(np.asarray(vals, float))
        self.lo.extend(lo)
        self.hi.extend(lo if hi is None else hi)

    def coordinates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, column, value) of every entry added."""
        return tuple(np.concatenate(x) for x in (self.rows, self.cols, self.vals))  # type: ignore[return-value]

    def exposure(self, graph: CostGraph) -> None:
        """The exposed sums (in the objective's unit: rows in seconds would sit below the
        solver's feasibility tolerance) are at least the bucketed sums less the backward, and
        at least 0 (their bound)."""
        nodes = range(len(graph.overlap))
        cols = [self.exposed] + [
            self.offsets[i] + s for i in nodes for s in range(len(graph.overlap[i]))
        ]
        vals = [1.0]
        for o, w in zip(graph.overlap, graph.window, strict=True):
            vals.extend(((w - o) * SCALE).tolist())
        self.row(cols, vals, -graph.const_window * SCALE, np.inf)

    def constraints(self, graph: CostGraph, memory_limit: float) -> None:
        num_nodes = len(graph.options)
        nodes = np.repeat(np.arange(num_nodes), [len(o) for o in graph.options])
        self.block(nodes, np.arange(self.num_x), np.ones(self.num_x), [1.0] * num_nodes)
        for (i, j), (rows, cols, cost) in self.classes.items():
            # edge marginals: each class's row (column) of the edge's variables sums to the
            # binaries of its options
            ci, cj = cost.shape
            cells = np.arange(ci * cj)
            edge = self.edge_offsets[(i, j)] + cells
            ends = [self.offsets[i] + np.arange(len(rows)), self.offsets[j] + np.arange(len(cols))]
            self.block(
                np.concatenate([cells // cj, ci + cells % cj, rows, ci + cols]),
                np.concatenate([edge, edge, *ends]),
                np.concatenate([np.ones(2 * cells.size), -np.ones(len(rows) + len(cols))]),
                [0.0] * (ci + cj),
            )
        if graph.overlap:
            self.exposure(graph)
        if math.isfinite(memory_limit):
            mem_scale = max(1.0, max((float(m.max()) for m in graph.memory), default=1.0))
            vals = np.concatenate(graph.memory) / mem_scale
            self.row(
                np.arange(self.num_x),
                vals,
                -np.inf,
                (memory_limit - graph.const_memory) / mem_scale,
            )


def _classes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A move matrix by classes: each row's class, each column's, and the matrix of the
    classes (rows equal in every entry are one class; columns so too). Found once a search
    for each matrix (a mesh's moves are shared by the programs of its ZeRO stages and memory
    limits), which the search's cache keeps alive with them."""
    kept = cache("classes").get(id(m))
    if kept is not None and kept[0] is m:
        return kept[1]
    row_of, firsts = _first_of_equal(m)
    col_of, col_firsts = _first_of_equal(np.ascontiguousarray(m[firsts].T))
    out = (row_of, col_of, m[np.ix_(firsts, col_firsts)])
    cache("classes")[id(m)] = (m, out)
    return out


def _first_of_equal(m: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Each row's class (classes numbered in order of first appearance) and the first row of
    each class."""
    seen: dict[bytes, int] = {}
    firsts: list[int] = []
    of = np.empty(len(m), np.int64)
    for r, row in enumerate(m):
        of[r] = seen.setdefault(row.tobytes(), len(seen))
        if of[r] == len(firsts):
            firsts.append(r)
    return of, firsts


def build_program(graph: CostGraph, memory_limit: float) -> tuple[Program, np.ndarray, Any]:
    """The program, its objective and its constraint matrix by rows (start, index, value),
    entries of one cell summed."""
    program = Program(graph)
    c = program.objective(graph)
    program.constraints(graph, memory_limit)
    rows, cols, vals = program.coordinates()
    cells, where = np.unique(rows * program.num_vars + cols, return_inverse=True)
    value = np.bincount(where, weights=vals, minlength=len(cells))
    start = np.searchsorted(cells // program.num_vars, np.arange(len(program.lo) + 1))
    return program, c, (start, cells % program.num_vars, value)


#: HiGHS options turned off in integer solves: the restart after the root's presolve, and
#: the primal heuristics
_OFF_IN_INTEGER_SOLVES = (
    "mip_allow_restart",
    "mip_heuristic_run_feasibility_jump",
    "mip_heuristic_run_rins",
    "mip_heuristic_run_rens",
    "mip_heuristic_run_root_reduced_cost",
    "mip_heuristic_run_zi_round",
    "mip_heuristic_run_shifting",
)
#: and turned on: presolve at the root node only (not again in the tree's nodes)
_ON_IN_INTEGER_SOLVES = ("mip_root_presolve_only",)


@dataclass
class Solved:
    x: np.ndarray | None  # None: no optimum (infeasible)
    fun: float
    #: the columns' reduced costs (a relaxation's; None for an integer solve)
    reduced: np.ndarray | None = None


def solve_program(program: Program, c: np.ndarray, a: Any, integral: bool) -> Solved:
    """HiGHS (its own Python binding) on the program, to optimality (a relative gap of
    1e-9); what HiGHS prints past its log options (lines on the process's standard output,
    which would spoil ``--json -``) goes nowhere."""
    import highspy

    inf, n = highspy.kHighsInf, program.num_vars
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_, lp.col_cost_ = n, len(program.lo), c
    upper = np.ones(n)
    upper[program.exposed] = inf  # (the binding's arrays are copies: set whole)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), upper
    lp.row_lower_ = np.maximum(program.lo, -inf)
    lp.row_upper_ = np.minimum(program.hi, inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a
    if integral:
        kinds = highspy.HighsVarType
        lp.integrality_ = [kinds.kInteger] * program.num_x + [kinds.kContinuous] * (
            n - program.num_x
        )
    with quiet_stdout():  # HiGHS prints its banner when made, before any option is set
        highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
        highs.setOptionValue("mip_rel_gap", 1e-9)
        # one thread: these programs gained nothing from more
        highs.setOptionValue("threads", 1)
        # Presolve shrinks these programs little and took most of a relaxation's time (a
        # fifth without it); a restart after the root's presolve rounds, a third of a hard
        # integer solve's; the primal heuristics, two fifths of what was left: the root's
        # relaxation and cuts solve these programs in a few nodes; presolving each node again
        # cost more than it saved (Mixtral's hardest program: 2.8 s, 0.6 s at the root only).
        # Same optima, measured on the bench's programs (docs/search.md). (An option a HiGHS
        # lacks is refused, quietly.)
        if integral:
            for option in _OFF_IN_INTEGER_SOLVES:
                highs.setOptionValue(option, False)
            for option in _ON_IN_INTEGER_SOLVES:
                highs.setOptionValue(option, True)
        else:
            highs.setOptionValue("presolve", "off")
        highs.passModel(lp)
        highs.run()
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return Solved(None, math.inf)
    solution = highs.getSolution()
    x = np.asarray(solution.col_value)
    reduced = None if integral else np.asarray(solution.col_dual)
    return Solved(x, highs.getInfo().objective_function_value, reduced)


@contextmanager
def quiet_stdout() -> Iterator[None]:
    """File descriptor 1 pointed at the null device for the block (native code's prints)."""
    sys.stdout.flush()
    kept = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()  # what Python code printed in the block goes nowhere too
        os.dup2(kept, 1)
        os.close(kept)


__all__ = ["SCALE", "Program", "Solved", "build_program", "quiet_stdout", "solve_program"]
