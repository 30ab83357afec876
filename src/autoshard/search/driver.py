"""``autoshard.plan``: the automatic search from a model to a plan, and the plan's JSON form
(docs/search.md)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoshard.cost.cluster import ClusterSpec, cluster_spec
from autoshard.cost.model import estimate
from autoshard.graph.capture import Captured, capture_modes
from autoshard.layout import Layout
from autoshard.mesh import mesh_info
from autoshard.search.costgraph import SearchResult
from autoshard.search.costgraph import search as run_search
from autoshard.search.semi import Plan, op_key_parts, plan_graph

FORMAT = "autoshard-plan/1"


def _jsonable(spec: Sequence[Any]) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def plan_json(captured: Captured, result: SearchResult, cluster: ClusterSpec) -> dict[str, Any]:
    """The searched plan as JSON: mesh, one space strategy per decision op (repeated layers
    written once as ``<list>.*``), input layouts, and the cost model's prediction."""
    return _build(captured, result, cluster)[0]


def _build(
    captured: Captured, result: SearchResult, cluster: ClusterSpec
) -> tuple[dict[str, Any], Plan]:
    """The JSON and the Plan of ``captured`` it gives. The search's objective leaves out the one
    latency each coalesced gradient all-reduce pays (docs/search.md); the prediction adds it,
    which does not depend on depth."""
    data = _json(captured, result, cluster)
    built = plan_graph(
        captured, result.mesh, data["strategies"], input_layouts=input_layouts(captured, data)
    )
    built.auto = data
    built.predicted = estimate(built, captured, cluster)
    pred = data["predicted"]
    pred["search_objective_s"] = pred["step_time_s"]
    pred["step_time_s"] += built.predicted.bucket_latency
    pred["mfu"] *= pred["search_objective_s"] / pred["step_time_s"]
    return data, built


def _json(captured: Captured, result: SearchResult, cluster: ClusterSpec) -> dict[str, Any]:
    parts = op_key_parts(captured)
    reps = set(result.graph.instances.values())
    multi = {name for name, rep in result.graph.instances.items() if name != rep}
    multi |= {result.graph.instances[n] for n in multi}
    strategies: dict[str, Any] = {}
    inputs: dict[str, Any] = {}
    chosen = result.strategies()
    for name in result.graph.instances:
        option = chosen[name]
        if name not in parts:  # a model input
            inputs[name] = _jsonable(option.spec)
            continue
        if name not in reps:
            continue
        path, op = parts[name]
        if name in multi:
            path = re.sub(r"^(.*?)\.(\d+)(?=\.|$)", r"\1.*", path, count=1)
        strategies[f"{path}/{op}"] = {"space": _jsonable(option.spec)}
    graph = result.graph
    seconds, memory = result.solution.seconds, result.solution.memory
    flops = graph.model_flops
    return {
        "format": FORMAT,
        "mesh": result.mesh.as_dict(),
        "strategies": dict(sorted(strategies.items(), key=lambda kv: _order(kv[0], parts))),
        "inputs": inputs,
        "predicted": {
            "step_time_s": seconds,
            "peak_memory_bytes": memory,
            "mfu": flops / (seconds * result.mesh.num_devices * _peak(cluster, captured)),
            "search": result.solution.search,
            "search_s": result.search_seconds,
            "meshes": result.tried,
        },
        "cluster": cluster.to_json(),
    }


def _order(key: str, parts: dict[str, tuple[str, str]]) -> int:
    for i, (path, op) in enumerate(parts.values()):
        if key.endswith("/" + op) and re.fullmatch(
            re.escape(key.rpartition("/")[0]).replace(r"\*", r"\d+"), path
        ):
            return i
    return len(parts)


def _peak(cluster: ClusterSpec, captured: Captured) -> float:
    dtypes = [
        n.meta["val"].dtype for n in captured.graph.nodes if n.meta.get("autoshard_kind") == "param"
    ]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    return cluster.peak_flops(dtype)


def load_plan(plan: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A plan dict from a dict or a JSON file, checked for its format."""
    if not isinstance(plan, Mapping):
        plan = json.loads(Path(plan).read_text())
    if plan.get("format") != FORMAT:
        raise ValueError(f"plan format {plan.get('format')!r}: expected {FORMAT!r}")
    return dict(plan)


def input_layouts(captured: Captured, plan: Mapping[str, Any]) -> dict[str, Layout]:
    """The plan's input specs as layouts of ``captured``'s inputs."""
    out = {}
    nodes = {n.name: n for n in captured.graph.nodes if n.op == "placeholder"}
    for name, spec in plan.get("inputs", {}).items():
        node = nodes.get(name)
        if node is None:
            continue
        val = node.meta["val"]
        entries = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
        out[name] = Layout.from_named(tuple(val.shape), entries, plan["mesh"], dtype=val.dtype)
    return out


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
    captured: dict[bool, Captured] | None = None,
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
    return _build(captured[True], result, spec)[1]


__all__ = ["FORMAT", "input_layouts", "load_plan", "plan", "plan_json"]
