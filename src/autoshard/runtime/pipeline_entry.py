"""``parallelize`` with a ``pp`` mesh axis: the micro-batch captured, one plan for a stage's
sub-mesh, the stages cut, the schedule made and validated, this rank's stages lowered."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.graph import capture_modes
from autoshard.graph.failure import one_line_on_rank_zero
from autoshard.layout import Layout
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
    replicas, bucket_cap_mb, precision, zero, reshard_after_forward, init = options
    if planned:
        raise ValueError(
            "parallelize: search= and plan= do not take pipeline stages yet; give the stage's "
            "strategies (or none: data parallel inside each stage)"
        )
    if zero:
        raise ValueError(f"parallelize: zero={zero} with pipeline stages is not supported yet")
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
    _compare_plans(plans[True], rank)
    cuts = cut_modes(captured, plan_schedule.num_stages, list(stages) if stages else None)
    groups = pipeline_groups(info)
    coordinate = next(c for c, g in enumerate(groups) if rank in g)
    pipe = Pipe(cuts, plan_schedule, groups, coordinate, groups[coordinate].index(rank))
    plans = pipeline_plans(plans, cuts, pipe.stages, groups[coordinate])
    return PipelineModule(
        model, captured, plans, rank, seed, replicas, bucket_cap_mb, policy,
        reshard_after_forward, init, pipe=pipe, microbatches=m,
    )  # fmt: skip


__all__ = ["parallelize_pipeline"]
