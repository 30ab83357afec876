"""``parallelize`` with a ``pp`` mesh axis: the micro-batch captured, one plan for a stage's
sub-mesh, the stages cut, the schedule made and validated, this rank's stages lowered."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.graph import capture_modes
from autoshard.graph.failure import one_line_on_rank_zero
from autoshard.layout import Layout
from autoshard.lower import weight_readers
from autoshard.mesh import check_world, mesh_info
from autoshard.precision import precision_policy
from autoshard.runtime.materialize import check_init
from autoshard.runtime.pipeline import (
    Pipe,
    PipelineModule,
    cut_modes,
    microbatch_example,
    pipeline_groups,
    pipeline_plans,
    stage_mesh,
)
from autoshard.runtime.planned import _compare_plans, _plan_modes
from autoshard.schedule import make_schedule, validate
from autoshard.search.plans import check_zero


def parallelize_pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: Any,
    strategies: Mapping[str, Any] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    example_kwargs: dict[str, Any] | None,
    input_layouts: Mapping[str, Layout] | None,
    seed: int,
    options: tuple,
    timeout_s: float | None,
    schedule: str,
    microbatches: int | None,
    stages: Sequence[str] | None,
    virtual_stages: int,
    planned: bool,
) -> PipelineModule:
    """``parallelize`` of a mesh with a ``pp`` axis (its arguments, in its order)."""
    replicas, bucket_cap_mb, precision, zero, reshard_after_forward, init, recompute = options
    if planned:
        raise ValueError(
            "parallelize: search= and plan= do not take pipeline stages yet; give the stage's "
            "strategies (or none: data parallel inside each stage)"
        )
    one_line_on_rank_zero()
    check_init(model, init)
    info = mesh_info(mesh)
    pp = info.size_of(["pp"]) if "pp" in info.names else 1
    m = pp if microbatches is None else microbatches
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches={microbatches!r}: expected a positive int")
    plan_schedule = make_schedule(schedule, pp, m, virtual_stages)
    validate(plan_schedule)
    policy = precision_policy(precision)
    example, kwargs = microbatch_example(tuple(example_inputs), example_kwargs, m)
    captured = capture_modes(model, example, kwargs, loss_fn=loss_fn, dtype=policy.compute)
    if any(og.mutations for og in captured.values()):
        raise ValueError(
            "pipeline stages: the model updates buffers in forward (batch norm's running "
            "statistics); that is not supported under a pp axis yet"
        )
    rank = check_world(info, "", timeout_s)
    plans = _plan_modes(captured, stage_mesh(info), None, strategies, input_layouts, "")
    plans[True] = dataclasses.replace(plans[True], zero=check_zero(zero or 0))
    _compare_plans(plans[True], rank)
    cuts = cut_modes(captured, plan_schedule.num_stages, list(stages) if stages else None)
    if plan_schedule.split_backward:
        _check_split(captured[True], cuts[True], zero, schedule)
    groups = pipeline_groups(info)
    coordinate = next(c for c, g in enumerate(groups) if rank in g)
    pipe = Pipe(cuts, plan_schedule, groups, coordinate, groups[coordinate].index(rank))
    plans = pipeline_plans(plans, cuts, pipe.stages, groups[coordinate])
    return PipelineModule(
        model, captured, plans, rank, seed, replicas, bucket_cap_mb, policy,
        reshard_after_forward, init, recompute, pipe=pipe, microbatches=m,
    )  # fmt: skip


def _check_split(og: Any, cut: Any, zero: Any, schedule: str) -> None:
    """A backward split into I and W reaches each weight from its one reader in a stage."""
    if zero:
        raise ValueError(f"schedule={schedule!r} with zero={zero} is not supported yet")
    for s in range(cut.num_stages):
        seen: dict[str, str] = {}
        for n in weight_readers(og, cut, s):
            for fqn in og[n].params:
                if fqn in seen and og[n].requires_grad:
                    raise ValueError(
                        f"schedule={schedule!r}: {fqn} is read twice in stage {s} ({seen[fqn]} "
                        f"and {n.name}); split backwards need one reader a stage (use 1f1b)"
                    )
                seen[fqn] = n.name


__all__ = ["parallelize_pipeline"]
