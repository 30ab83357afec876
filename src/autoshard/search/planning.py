"""``autoshard.plan``: the searched plan of a model, with pipeline stages when asked."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.cost import ClusterSpec, cluster_spec
from autoshard.graph import OpGraph, call_inputs, capture_modes
from autoshard.mesh import mesh_info
from autoshard.options import Options
from autoshard.precision import Precision
from autoshard.search.driver import build_plan, run_search
from autoshard.search.pipelined import plan_with_stages
from autoshard.search.plans import Plan
from autoshard.search.semi import check_inputs, plan_graph


def plan(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
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
    zero: int | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    recompute: str | None = None,
    attention: str | None = None,
    sequence_parallel: bool = False,
    copies: int = 1,
    precision: str | Precision | None = None,
    tp: int | None = None,
    cp: int | None = None,
    options: Options | None = None,
) -> Plan:
    """Search the fastest plan of ``model`` that fits on ``cluster`` (a preset name, a JSON
    file or a ClusterSpec; ``num_devices`` of its devices, default all). Returns the
    :class:`Plan` with ``plan.json`` (the JSON ``parallelize(plan=...)`` accepts, its
    ``options`` section the options it was made under) and ``plan.predicted`` (the cost
    model's :class:`~autoshard.cost.Estimate` of it). Any of ``pp``, ``microbatches``,
    ``schedule``, ``virtual_stages``, ``recompute`` (or a ``pp`` axis of ``mesh``, whose other
    axes then fix a stage's sub-mesh) plans pipeline stages: the plan is one stage's, its
    JSON's ``pipeline`` section the configuration (those not given searched;
    docs/parallelism/pipeline.md); ``attention``, ``sequence_parallel`` and a ``cp`` axis of
    ``mesh`` hold for every stage. ``precision`` is priced as ``parallelize`` will run it; a
    ``captured`` given with it, in its compute dtype. Every other keyword is the field of
    :class:`~autoshard.options.Options` of its name (docs/options.md); ``zero`` (one stage,
    searched where None), ``tp`` and ``cp`` fix what the search would pick; ``options``: an
    ``Options`` the keywords add to."""
    opts = Options.from_call(locals(), options).for_search()
    example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
    info = mesh_info(opts.mesh) if opts.mesh is not None else None
    spec = cluster_spec(opts.cluster)
    if num_devices is None:
        num_devices = info.num_devices if info is not None else spec.num_devices
    spec = cluster_spec(spec, num_devices)
    opts = opts.replace(precision=opts.policy.resolve(model))
    inputs = tuple(example_inputs)
    if opts.staged:
        return plan_with_stages(model, inputs, spec, num_devices, opts, loss_fn, example_kwargs)
    if captured is None:
        compute = opts.policy.compute
        captured = capture_modes(model, inputs, example_kwargs, loss_fn=loss_fn, dtype=compute)
    if info is not None:
        check_inputs(captured[True], info)
    return _searched(captured[True], info, spec, num_devices, opts)


def _searched(og: OpGraph, info: Any, spec: ClusterSpec, num_devices: int, opts: Options) -> Plan:
    """The one-program plan of ``og``: the strategies given fixed, the rest searched."""
    fixed = None
    if opts.strategies:
        if info is None:
            raise ValueError("search='propagate' with strategies needs the mesh they name")
        base = plan_graph(og, info, opts.strategies)
        fixed = {n.node: n.strategy for n in base.nodes.values() if n.configured}
    result = run_search(og, num_devices, spec, mesh=info, fixed=fixed, **opts.search_keywords())
    built = build_plan(og, result, spec)
    return dataclasses.replace(built, json={**built.json, "options": opts.as_json()})


__all__ = ["plan"]
