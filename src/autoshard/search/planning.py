"""``autoshard.plan``: the searched plan of a model, with pipeline stages when asked."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.cost import ClusterSpec, cluster_spec
from autoshard.graph import OpGraph, capture_modes
from autoshard.mesh import mesh_info
from autoshard.precision import Precision, precision_policy
from autoshard.search.driver import build_plan, run_search
from autoshard.search.pipelined import plan_with_stages
from autoshard.search.plans import Plan, check_zero
from autoshard.search.semi import plan_graph


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
) -> Plan:
    """Search the fastest plan of ``model`` that fits on ``cluster`` (a preset name, a JSON
    file or a ClusterSpec; ``num_devices`` of its devices, default all). Returns the
    :class:`Plan` with ``plan.json`` (the JSON ``parallelize(plan=...)`` accepts) and
    ``plan.predicted`` (the cost model's :class:`~autoshard.cost.Estimate` of it). The ZeRO
    stage is searched with the strategies unless ``zero`` fixes it (docs/zero.md). Any of
    ``pp``, ``microbatches``, ``schedule``, ``virtual_stages``, ``recompute`` plans pipeline
    stages: the plan is one stage's, its JSON's ``pipeline`` section the configuration (those
    not given searched; docs/parallelism/pipeline.md). ``attention`` fixes how attention
    computes over a split sequence (``"allgather"``, ``"ulysses"``, ``"ring"``; None: searched);
    ``sequence_parallel`` splits every op over the tensor-parallel axes where it can be
    (docs/parallelism/sequence.md); with stages, these and a ``cp`` axis of ``mesh`` (its
    size, the context-parallel degree) hold for every stage. ``precision`` (``"bf16"``, a
    ``Precision``; default ``"fp32"``): the policy ``parallelize(precision=...)`` will run,
    priced as it runs (the graph in its compute dtype, float32 master weights, gradients and
    Adam moments, gradient sums in its reduce dtype; docs/precision.md); a ``captured`` given
    with it must have been captured in its compute dtype. ``tp`` fixes the tensor-parallel
    degree of the meshes searched (of each stage's with stages)."""
    # Whole: the public entry point; its keywords and their meaning are one list to read
    if zero is not None and not isinstance(check_zero(zero), int):
        raise ValueError(
            "plan: zero= is one stage for the search (0-3); give per-parameter "
            "stages to parallelize"
        )
    spec = cluster_spec(cluster)
    if num_devices is None:
        num_devices = mesh_info(mesh).num_devices if mesh is not None else spec.num_devices
    spec = cluster_spec(spec, num_devices)
    policy = precision_policy(precision).resolve(model)
    staged = {"pp": pp, "microbatches": microbatches, "schedule": schedule,
              "virtual_stages": virtual_stages, "recompute": recompute}  # fmt: skip
    if any(v is not None for v in staged.values()):
        given = {k: v for k, v in staged.items() if v is not None}
        given |= {"attention": attention, "sequence_parallel": sequence_parallel,
                  "precision": policy, "zero": zero, "tp": tp}  # fmt: skip
        if mesh is not None and mesh_info(mesh).cp:  # the context-parallel degree a stage keeps
            info = mesh_info(mesh)
            given["cp"] = math.prod(info.sizes[info.names.index(a)] for a in info.cp)
        return plan_with_stages(model, tuple(example_inputs), spec, num_devices, given, search,
                                loss_fn, example_kwargs, tp_across_nodes)  # fmt: skip
    if captured is None:
        captured = capture_modes(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn,
                                 dtype=policy.compute)  # fmt: skip
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
        zero=zero,
        attention=attention,
        sequence_parallel=sequence_parallel,
        precision=policy,
        tp=tp,
    )
    return build_plan(captured[True], result, spec)


__all__ = ["plan"]
