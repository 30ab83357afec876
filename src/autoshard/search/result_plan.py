"""A search's result and the Plan it gives: its JSON (``plan.json``) and its prediction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.cost import ClusterSpec, estimate
from autoshard.cost.breakdown import breakdown_rows
from autoshard.cost.offload import with_offload
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy
from autoshard.precision import Precision
from autoshard.search.costgraph import CostGraph
from autoshard.search.notes import with_notes
from autoshard.search.plans import FORMAT, Plan, input_layouts
from autoshard.search.semi import plan_graph
from autoshard.search.solvers import Solution


@dataclass
class SearchResult:
    """The chosen mesh and one option per decision node, with the cost graph it came from."""

    mesh: MeshInfo
    graph: CostGraph
    solution: Solution
    tried: list[dict[str, Any]]
    search_seconds: float
    #: the precision policy the parameters were priced under (None: the graph's dtypes)
    precision: Precision | None = None
    #: the plan's estimate, where the search made it already (``build_plan`` reads it)
    estimated: Any = dataclasses.field(default=None, compare=False, repr=False)
    #: what the plan keeps off the device (``cost.offload.Offload``; None: nothing)
    offload: Any = None

    def strategies(self) -> dict[str, Strategy]:
        """Every decision node's strategy (repeated layers share their representative's)."""
        rep_index = {name: i for i, name in enumerate(self.graph.names)}
        out = {}
        for name, rep in self.graph.instances.items():
            i = rep_index[rep]
            out[name] = self.graph.options[i][self.solution.choice[i]]
        return out


def _jsonable(spec: Sequence[Any]) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def build_plan(og: OpGraph, result: SearchResult, cluster: ClusterSpec) -> Plan:
    """The Plan of ``og`` a search result gives, with its JSON (``plan.json``) and prediction.
    The search's objective is a sum over ops: it prices the bucketed gradient sums in line
    and without their buckets' latencies (docs/search.md); the prediction adds what the
    buckets' overlap and latencies change, at the real depth."""
    data = _json(og, result, cluster)
    built = plan_graph(og, result.mesh, data["strategies"], input_layouts=input_layouts(og, data))
    data["zero"] = result.graph.zero
    if result.precision is not None and result.precision.compute is not None:
        data["precision"] = result.precision.as_dict()
    built = dataclasses.replace(
        built, zero=result.graph.zero, json=data, searched=True, precision=result.precision
    )
    predicted = result.estimated
    if predicted is None:
        predicted = estimate(built, og, cluster, depth=result.graph.depth)
        predicted = with_offload(predicted, built, og, cluster, result.offload, result.graph.depth)
    if result.offload:
        data["offload"] = result.offload.as_json()
    pred = data["predicted"]
    pred["search_objective_s"] = pred["step_time_s"]
    pred["step_time_s"] = predicted.step_time
    pred["mfu"] *= pred["search_objective_s"] / pred["step_time_s"]
    pred["search_memory_bytes"] = pred["peak_memory_bytes"]
    pred["peak_memory_bytes"] = predicted.peak_memory
    tiers = ("memory_bytes", "host_memory_bytes", "nvme_memory_bytes", "offload_s")
    pred |= {k: v for k, v in predicted.as_dict().items() if k in tiers}
    pred["layers"] = breakdown_rows(predicted, og)
    return with_notes(dataclasses.replace(built, predicted=predicted), og)


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


__all__ = ["SearchResult", "build_plan"]
