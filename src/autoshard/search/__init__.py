"""Planning: the plan format (``plans``), semi-automatic planning (``semi``), strategy options
(``options``), the cost graph and its pricing (``costgraph``, ``pricing``), the solvers
(``solvers``), the driver from a graph to a search result (``driver``) and from that to a plan
(``result_plan``), pipeline stages (``pipelined``) and ``plan`` from a model (``planning``)."""

from autoshard.search.driver import SEARCHES, mesh_shapes, run_search
from autoshard.search.planning import plan
from autoshard.search.plans import (
    FORMAT,
    ZERO_LEVELS,
    Plan,
    PlanningError,
    ZeroError,
    check_zero,
    input_layouts,
    load_plan,
)
from autoshard.search.result_plan import SearchResult, build_plan
from autoshard.search.semi import match_strategies, plan_graph

__all__ = [
    "FORMAT",
    "SEARCHES",
    "Plan",
    "PlanningError",
    "SearchResult",
    "ZERO_LEVELS",
    "ZeroError",
    "build_plan",
    "check_zero",
    "input_layouts",
    "load_plan",
    "match_strategies",
    "mesh_shapes",
    "plan",
    "plan_graph",
    "run_search",
]
