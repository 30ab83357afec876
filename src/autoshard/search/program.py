"""The integer program of a cost graph and HiGHS on it (docs/search.md): a binary per
(node, option), a continuous variable per (edge, option pair) tied to both ends, one memory
row, and the exposed gradient sums; ``solvers.solve_optimal`` and ``relaxed_bound`` solve it
whole and relaxed."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoshard.search.costgraph import CostGraph

#: the objective's unit, microseconds: its coefficients stay near 1, and HiGHS's tolerances
#: (1e-6 absolute gap, 1e-7 feasibility) stay below the nanoseconds plans can differ by
SCALE = 1e6


class Program:
    """The integer program of a cost graph: binaries per (node, option), then continuous edge
    variables tied to both ends (their rows and columns sum to the end's binaries), and the
    constraint rows in coordinate form."""

    def __init__(self, graph: CostGraph) -> None:
        self.offsets, n = [], 0
        for opts in graph.options:
            self.offsets.append(n)
            n += len(opts)
        self.num_x = n
        self.edge_offsets = {}
        for key, m in graph.edges.items():
            self.edge_offsets[key] = n
            n += m.size
        self.exposed = n  # the bucketed gradient sums that outlast backward
        self.num_vars = n + 1
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def objective(self, graph: CostGraph) -> np.ndarray:
        scale = SCALE
        c = np.zeros(self.num_vars)
        for i, u in enumerate(graph.unary):
            hidden = graph.overlap[i] if graph.overlap else 0.0
            c[self.offsets[i] : self.offsets[i] + len(u)] = (u - hidden) * scale
        for key, m in graph.edges.items():
            c[self.edge_offsets[key] : self.edge_offsets[key] + m.size] = m.ravel() * scale
        c[self.exposed] = 1.0  # already in the scaled unit (``exposure``)
        return c

    def row(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        r = len(self.lo)
        self.rows.extend([r] * len(cols))
        self.cols.extend(cols)
        self.vals.extend(vals)
        self.lo.append(lo)
        self.hi.append(hi)

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
        for i, opts in enumerate(graph.options):  # one option per node
            self.row([self.offsets[i] + s for s in range(len(opts))], [1.0] * len(opts), 1, 1)
        for (i, j), m in graph.edges.items():  # edge marginals: each row (column) sums to x
            si, sj = m.shape
            cells = np.arange(si * sj).reshape(si, sj) + self.edge_offsets[(i, j)]
            for node, groups in ((i, cells), (j, cells.T)):
                for s, group in enumerate(groups):
                    cols = [*group.tolist(), self.offsets[node] + s]
                    self.row(cols, [1.0] * len(group) + [-1.0], 0.0, 0.0)
        if graph.overlap:
            self.exposure(graph)
        if math.isfinite(memory_limit):
            mem_scale = max(1.0, max((float(m.max()) for m in graph.memory), default=1.0))
            cols = [self.offsets[i] + s for i, m in enumerate(graph.memory) for s in range(len(m))]
            vals = [v / mem_scale for m in graph.memory for v in m]
            self.row(cols, vals, -np.inf, (memory_limit - graph.const_memory) / mem_scale)


def build_program(graph: CostGraph, memory_limit: float) -> tuple[Program, np.ndarray, Any]:
    """The program, its objective and its constraint matrix by rows (start, index, value),
    entries of one cell summed."""
    program = Program(graph)
    c = program.objective(graph)
    program.constraints(graph, memory_limit)
    cells, where = np.unique(
        np.asarray(program.rows, np.int64) * program.num_vars + program.cols, return_inverse=True
    )
    value = np.bincount(where, weights=program.vals, minlength=len(cells))
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
    x = np.asarray(highs.getSolution().col_value)
    return Solved(x, highs.getInfo().objective_function_value)


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
