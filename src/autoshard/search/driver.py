"""The search driver: every mesh shape's cost graph solved, the fastest plan that fits kept,
and ``autoshard.plan``, from a model to a searched :class:`Plan` (docs/search.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autoshard.cost import ClusterSpec, cluster_spec, estimate
from autoshard.graph import OpGraph, capture_modes
from autoshard.mesh import MeshInfo, mesh_info
from autoshard.ops import Strategy
from autoshard.search import options, pricing
from autoshard.search.costgraph import CostGraph, build_cost_graph
from autoshard.search.plans import FORMAT, Plan, PlanningError, input_layouts
from autoshard.search.semi import plan_graph
from autoshard.search.solvers import (
    Solution,
    lower_bound,
    solve_optimal,
    solve_propagate,
    solve_recursive,
)

SEARCHES = ("optimal", "recursive", "propagate")


def mesh_shapes(
    num_devices: int, cluster: ClusterSpec, tp_across_nodes: bool = False
) -> list[MeshInfo]:
    """Every ``dp x tp`` factorization of the devices, ``tp`` inside a node unless allowed."""
    out = []
    for tp in range(1, num_devices + 1):
        if num_devices % tp:
            continue
        if tp > cluster.devices_per_node and not tp_across_nodes:
            continue
        out.append(MeshInfo(("dp", "tp"), (num_devices // tp, tp), ("dp",)))
    return out


@dataclass
class SearchResult:
    """The chosen mesh and one option per decision node, with the cost graph it came from."""

    mesh: MeshInfo
    graph: CostGraph
    solution: Solution
    tried: list[dict[str, Any]]
    search_seconds: float

    def strategies(self) -> dict[str, Strategy]:
        """Every decision node's strategy (repeated layers share their representative's)."""
        rep_index = {name: i for i, name in enumerate(self.graph.names)}
        out = {}
        for name, rep in self.graph.instances.items():
            i = rep_index[rep]
            out[name] = self.graph.options[i][self.solution.choice[i]]
        return out


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
) -> SearchResult:
    """The fastest plan that fits, over every mesh shape (or the given ``mesh``)."""
    if search not in SEARCHES:
        raise ValueError(f"search={search!r}: expected one of {', '.join(SEARCHES)}")
    start = time.perf_counter()
    options.clear_caches()
    pricing.clear_caches()
    limit = cluster.memory_bytes if memory_limit is None else memory_limit
    meshes = [mesh] if mesh is not None else mesh_shapes(num_devices, cluster, tp_across_nodes)
    graphs = [build_cost_graph(og, m, cluster, depth=depth) for m in meshes]
    ranked = sorted(range(len(meshes)), key=lambda k: lower_bound(graphs[k]))
    best: tuple[int, Solution] | None = None
    tried: list[dict[str, Any]] = []
    smallest = math.inf
    for k in ranked:
        graph = graphs[k]
        row: dict[str, Any] = {"mesh": graph.mesh.as_dict(), "bound_s": lower_bound(graph)}
        smallest = min(smallest, graph.const_memory + sum(float(m.min()) for m in graph.memory))
        if best is not None and row["bound_s"] >= best[1].seconds:
            row["skipped"] = "bound"
            tried.append(row)
            continue
        if search == "optimal":
            sol = solve_optimal(graph, limit)
        elif search == "recursive":
            sol = solve_recursive(graph, limit)
        else:
            sol = solve_propagate(graph, _fixed_options(graph, fixed or {}), limit)
        if sol is None:
            row["fits"] = False
        else:
            row.update(step_s=sol.seconds, memory=sol.memory, solve_s=sol.solve_seconds)
            # equal times (all axes on the batch: the same plan on any shape): fewer tp
            if best is None or (sol.seconds, meshes[k].sizes[-1]) < (
                best[1].seconds * (1 - 1e-9),
                meshes[best[0]].sizes[-1],
            ):
                best = (k, sol)
        tried.append(row)
    if best is None:
        raise PlanningError(
            f"no plan fits in {limit / 2**30:.2f} GiB per device on {num_devices} devices: the "
            f"smallest peak found is {smallest / 2**30:.2f} GiB. Add devices, or shard the "
            f"optimizer state (ZeRO), split the layers into pipeline stages, or recompute "
            f"activations"
        )
    k, sol = best
    return SearchResult(meshes[k], graphs[k], sol, tried, time.perf_counter() - start)


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


# -- the plan --------------------------------------------------------------------------------------


def _jsonable(spec: Sequence[Any]) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def plan_json(og: OpGraph, result: SearchResult, cluster: ClusterSpec) -> dict[str, Any]:
    """The searched plan as JSON: mesh, one space strategy per decision op (repeated layers
    written once as ``<list>.*``), input layouts, and the cost model's prediction."""
    return build_plan(og, result, cluster).auto


def build_plan(og: OpGraph, result: SearchResult, cluster: ClusterSpec) -> Plan:
    """The Plan of ``og`` a search result gives, with its JSON (``plan.auto``) and prediction.
    The search's objective is a sum over ops: it prices the bucketed gradient sums in line
    and without their buckets' latencies (docs/search.md); the prediction adds what the
    buckets' overlap and latencies change, at the real depth."""
    data = _json(og, result, cluster)
    built = plan_graph(og, result.mesh, data["strategies"], input_layouts=input_layouts(og, data))
    built.auto = data
    built.predicted = estimate(built, og, cluster, depth=result.graph.depth)
    pred = data["predicted"]
    pred["search_objective_s"] = pred["step_time_s"]
    pred["step_time_s"] += built.predicted.step_time - built.predicted.search_step_time
    pred["mfu"] *= pred["search_objective_s"] / pred["step_time_s"]
    return built


def _json(og: OpGraph, result: SearchResult, cluster: ClusterSpec) -> dict[str, Any]:
    reps = set(result.graph.instances.values())
    strategies: dict[str, Any] = {}
    inputs: dict[str, Any] = {}
    chosen = result.strategies()
    for name in result.graph.instances:
        option = chosen[name]
        info = og[og.by_name[name]]
        if info.kind == "input":
            inputs[name] = _jsonable(option.spec)
        elif name in reps:
            strategies[og.key_pattern(info)] = {"space": _jsonable(option.spec)}
    graph = result.graph
    seconds, memory = result.solution.seconds, result.solution.memory
    flops = graph.model_flops
    return {
        "format": FORMAT,
        "mesh": result.mesh.as_dict(),
        "strategies": dict(sorted(strategies.items(), key=lambda kv: _order(kv[0], og))),
        "inputs": inputs,
        "predicted": {
            "step_time_s": seconds,
            "peak_memory_bytes": memory,
            "mfu": flops / (seconds * result.mesh.num_devices * _peak(cluster, og)),
            "dtype": _compute_dtype(og),
            "search": result.solution.search,
            "search_s": result.search_seconds,
            "meshes": result.tried,
        },
        "cluster": cluster.to_json(),
    }


def _order(key: str, og: OpGraph) -> int:
    """Where a strategy key's first op stands in the graph."""
    ops = og.ops()
    return next((i for i, info in enumerate(ops) if og.key_pattern(info) == key), len(ops))


def _compute_dtype(og: OpGraph) -> str:
    """The dtype most parameters have: the precision the plan computes in."""
    dtypes = [info.dtype for info in og.state() if info.kind == "param"]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    return str(dtype).removeprefix("torch.")


def _peak(cluster: ClusterSpec, og: OpGraph) -> float:
    return cluster.peak_flops(getattr(torch, _compute_dtype(og)))


def plan(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: str | ClusterSpec | dict | None = None,
    *,
    search: str = "optimal",
    num_devices: int | None = None,
    mesh: Any = None,
    memory_limit: float | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    strategies: Mapping[str, Any] | None = None,
    tp_across_nodes: bool = False,
    captured: dict[bool, OpGraph] | None = None,
) -> Plan:
    """Search the fastest plan of ``model`` that fits on ``cluster`` (a preset name, a JSON
    file or a ClusterSpec; ``num_devices`` of its devices, default all). Returns the
    :class:`Plan` with ``plan.auto`` (the JSON ``parallelize(plan=...)`` accepts) and
    ``plan.predicted`` (the cost model's :class:`~autoshard.cost.Estimate` of it)."""
    spec = cluster_spec(cluster)
    if num_devices is None:
        num_devices = mesh_info(mesh).num_devices if mesh is not None else spec.num_devices
    spec = cluster_spec(spec, num_devices)
    if captured is None:
        captured = capture_modes(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn)
    fixed_mesh = mesh_info(mesh) if mesh is not None else None
    fixed = None
    if strategies:
        if fixed_mesh is None:
            raise ValueError("search='propagate' with strategies needs the mesh they name")
        base = plan_graph(captured[True], fixed_mesh, strategies)
        fixed = {n.node: n.strategy for n in base.nodes.values() if n.configured}
    result = run_search(
        captured[True],
        num_devices,
        spec,
        search=search,
        mesh=fixed_mesh,
        memory_limit=memory_limit,
        tp_across_nodes=tp_across_nodes,
        fixed=fixed,
    )
    return build_plan(captured[True], result, spec)


__all__ = [
    "SEARCHES",
    "SearchResult",
    "build_plan",
    "mesh_shapes",
    "plan",
    "plan_json",
    "run_search",
]
