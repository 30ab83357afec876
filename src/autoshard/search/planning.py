"""``autoshard.plan``: the searched plan of a model, with pipeline stages when asked."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard import memo
from autoshard.cost import ClusterSpec, cluster_spec
from autoshard.graph import OpGraph, call_inputs, capture_modes
from autoshard.graph.batches import micro_batch_graphs
from autoshard.mesh import mesh_info
from autoshard.options import Options
from autoshard.precision import Precision
from autoshard.search.copies import batch_of, search_copies
from autoshard.search.driver import run_search
from autoshard.search.pipelined import plan_with_stages
from autoshard.search.plans import Plan
from autoshard.search.result_plan import SearchResult, build_plan
from autoshard.search.semi import check_inputs, plan_graph


@memo.scope()  # what the capture, the searches and the plan's JSON make goes with the plan
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
    offload: Mapping[str, Any] | None = None,
    attention: str | None = None,
    sequence_parallel: bool = False,
    copies: int | str = 1,
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
    searched where None), ``tp`` and ``cp`` fix what the search would pick; ``copies``
    ``"auto"`` searches 1, 2 and 4 copies (docs/parallelism/copies.md); ``offload`` (None:
    searched, docs/parallelism/offload.md); ``options``: an ``Options`` the keywords add to."""
    wanted, copies = copies, 1 if copies == "auto" else copies
    opts = Options.from_call(locals(), options).for_search()
    wanted = opts.copies if wanted == 1 else wanted
    example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
    info = mesh_info(opts.mesh) if opts.mesh is not None else None
    spec = cluster_spec(opts.cluster)
    num_devices = num_devices or (info.num_devices if info is not None else spec.num_devices)
    spec = cluster_spec(spec, num_devices)
    opts = opts.replace(precision=opts.policy.resolve(model))
    inputs = tuple(example_inputs)
    if opts.staged:
        if wanted == "auto":
            raise ValueError("copies='auto' is searched without stages; give stages a count")
        return plan_with_stages(model, inputs, spec, num_devices, opts, loss_fn, example_kwargs)
    where = (info, spec, num_devices, opts)
    return _one_program(model, inputs, example_kwargs, loss_fn, captured, where, wanted)


def _one_program(
    model: nn.Module,
    inputs: tuple,
    example_kwargs: dict[str, Any] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    captured: dict[bool, OpGraph] | None,
    where: tuple,
    copies: int | str,
) -> Plan:
    """The plan without stages, of ``copies`` copies; ``where``: the mesh, cluster, device
    count and options searched under."""
    info, _, _, opts = where
    if captured is None:
        compute = opts.policy.compute
        captured = capture_modes(model, inputs, example_kwargs, loss_fn=loss_fn, dtype=compute)
    if info is not None:
        check_inputs(captured[True], info)
    og = captured[True]
    if copies == 1:
        built = build_plan(og, _search(og, *where), where[1])
        opts = opts.replace(offload=built.json.get("offload", opts.offload))  # as searched
        return dataclasses.replace(built, json={**built.json, "options": opts.as_json()})
    graphs = micro_batch_graphs(
        model, inputs, example_kwargs, loss_fn=loss_fn, dtype=opts.policy.compute
    )
    return _with_copies(og, graphs, copies, *where)


def _with_copies(
    og: OpGraph, graphs: Callable[[int], OpGraph], copies: int | str, *args: Any
) -> Plan:
    """The plan of ``copies`` copies (``"auto"``: the fastest of 1, 2 and 4), searched on
    one copy's graph (``graphs(k)``; ``og`` the whole batch's); ``args``: the mesh, cluster,
    device count and options of ``_search``."""
    info, spec, num_devices, opts = args
    _, built = search_copies(
        lambda k: og if k == 1 else graphs(k),
        batch_of(og),
        copies,
        lambda graph, k: _search(graph, info, spec, num_devices, opts, 1 / k),
        spec,
        opts.memory_limit,
    )
    opts = opts.replace(copies=built.json["predicted"]["copies"])
    return dataclasses.replace(built, json={**built.json, "options": opts.as_json()})


def _search(
    og: OpGraph,
    info: Any,
    spec: ClusterSpec,
    num_devices: int,
    opts: Options,
    step_share: float = 1.0,
) -> SearchResult:
    """The one-program search of ``og``: the strategies given fixed, the rest searched;
    ``step_share``: the weight of what runs once a step (``run_search``)."""
    fixed = None
    if opts.strategies:
        if info is None:
            raise ValueError("search='propagate' with strategies needs the mesh they name")
        base = plan_graph(og, info, opts.strategies)
        fixed = {n.node: n.strategy for n in base.nodes.values() if n.configured}
    keywords = opts.search_keywords()
    keywords["offload"] = "auto" if opts.offload is None and step_share == 1 else opts.offload
    return run_search(
        og, num_devices, spec, mesh=info, fixed=fixed, step_share=step_share, **keywords
    )


__all__ = ["plan"]
