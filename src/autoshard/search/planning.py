"""``autoshard.plan``: the searched plan of a model, with pipeline stages when asked."""

from __future__ import annotations

import dataclasses
import math
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
    precision: str | Precision | None = None,
    tp: int | None = None,
    cp: int | None = None,
    options: Options | None = None,
) -> Plan:
    """Search the fastest plan of ``model`` that fits on ``cluster`` (a preset name, a JSON
    file or a ClusterSpec; ``num_devices`` of its devices, default all). Returns the
    :class:`Plan` with ``plan.json`` (the JSON ``parallelize(plan=...)`` accepts, its
    ``options`` section the options it was made under) and ``plan.predicted`` (the cost
    model's :class:`~autoshard.cost.Estimate` of it). The ZeRO
    stage is searched with the strategies unless ``zero`` fixes it (docs/zero.md). Any of
    ``pp``, ``microbatches``, ``schedule``, ``virtual_stages``, ``recompute`` (or a ``pp``
    axis of ``mesh``, whose other axes then fix a stage's sub-mesh) plans pipeline
    stages: the plan is one stage's, its JSON's ``pipeline`` section the configuration (those
    not given searched; docs/parallelism/pipeline.md). ``attention`` fixes how attention
    computes over a split sequence (``"allgather"``, ``"ulysses"``, ``"ring"``; None: searched);
    ``sequence_parallel`` splits every op over the tensor-parallel axes where it can be
    (docs/parallelism/sequence.md); with stages, these and a ``cp`` axis of ``mesh`` (its
    size, the context-parallel degree) hold for every stage. ``precision`` (``"bf16"``, a
    ``Precision``; default ``"fp32"``): the policy ``parallelize(precision=...)`` will run,
    priced as it runs (the graph in its compute dtype, float32 master weights, gradients and
    Adam moments, gradient sums in its reduce dtype; docs/precision.md); a ``captured`` given
    with it must have been captured in its compute dtype. ``tp`` (``cp``) fixes the tensor-
    (context-) parallel degree of the meshes searched (of each stage's with stages).
    ``options``: an :class:`~autoshard.options.Options` the keywords add to."""
    # Whole: the public entry point; its keywords and their meaning are one list to read
    opts = Options.from_call(locals(), options)
    example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
    if opts.zero is not None and not isinstance(opts.zero, int):
        raise ValueError(
            "plan: zero= is one stage for the search (0-3); give per-parameter "
            "stages to parallelize"
        )
    opts = opts.with_mesh_pp()  # the mesh fixes the pipeline's degree
    info = mesh_info(opts.mesh) if opts.mesh is not None else None
    if info is not None and info.cp and opts.cp is None:  # the context-parallel degree kept
        opts = opts.replace(cp=math.prod(info.sizes[info.names.index(a)] for a in info.cp))
    spec = cluster_spec(opts.cluster)
    if num_devices is None:
        num_devices = info.num_devices if info is not None else spec.num_devices
    spec = cluster_spec(spec, num_devices)
    opts = opts.replace(precision=opts.policy.resolve(model))
    if opts.staged:
        return plan_with_stages(model, tuple(example_inputs), spec, num_devices, opts,
                                loss_fn, example_kwargs)  # fmt: skip
    if captured is None:
        captured = capture_modes(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn,
                                 dtype=opts.policy.compute)  # fmt: skip
    if info is not None:
        check_inputs(captured[True], info)
    fixed = None
    if opts.strategies:
        if info is None:
            raise ValueError("search='propagate' with strategies needs the mesh they name")
        base = plan_graph(captured[True], info, opts.strategies)
        fixed = {n.node: n.strategy for n in base.nodes.values() if n.configured}
    result = run_search(captured[True], num_devices, spec, mesh=info, fixed=fixed,
                        **opts.search_keywords())  # fmt: skip
    built = build_plan(captured[True], result, spec)
    return dataclasses.replace(built, json={**built.json, "options": opts.as_json()})


__all__ = ["plan"]
