"""``parallelize`` with a ``pp`` mesh axis: the micro-batch captured, one plan for a stage's
sub-mesh, the stages cut, the schedule made and validated, this rank's stages lowered."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
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
from autoshard.runtime.planned import _compare_plans, _inputs_of, _plan_modes, _search
from autoshard.schedule import make_schedule, validate
from autoshard.search import Plan, load_plan
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
    pipeline: tuple,
    planning: tuple,
    sequence: tuple = (None, False),
) -> PipelineModule:
    """``parallelize`` of a mesh with a ``pp`` axis (its arguments, in its order; ``pipeline``:
    schedule, microbatches, stages, virtual_stages; ``planning``: search, cluster, plan and
    the capture of one micro-batch, if made already; ``sequence``: attention and
    sequence_parallel)."""
    # Whole: parallelize's steps in its order (plan, capture, check, cut, lower), for stages
    replicas, bucket_cap_mb, precision, zero, reshard_after_forward, init, recompute = options
    stages = pipeline[2]
    search, cluster, plan, captured = planning
    data, source = _plan_data(plan)
    if data is not None:
        mesh, strategies = {"pp": data["pipeline"]["pp"], **data["mesh"]}, data["strategies"]
        zero = data.get("zero", 0) if zero is None else zero
    schedule, m, virtual_stages, recompute = _configuration(pipeline, recompute, data, source)
    one_line_on_rank_zero()
    check_init(model, init)
    info = mesh_info(mesh)
    pp = info.size_of(["pp"]) if "pp" in info.names else 1
    m = pp if m is None else m  # default: one micro-batch a pipeline rank
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches={m!r}: expected a positive int")
    plan_schedule = make_schedule(schedule, pp, m, virtual_stages)
    validate(plan_schedule)
    policy = precision_policy(precision).resolve(model)
    example, kwargs = microbatch_example(tuple(example_inputs), example_kwargs, m)
    if captured is None:
        captured = capture_modes(model, example, kwargs, loss_fn=loss_fn, dtype=policy.compute)
    if any(og.mutations for og in captured.values()):
        raise ValueError(
            "pipeline stages: the model updates buffers in forward (batch norm's running "
            "statistics); that is not supported under a pp axis yet"
        )
    ready = None
    if data is not None:
        input_layouts = _inputs_of(captured[True], data, input_layouts, source)
    elif search is not None:  # the stage's strategies searched for its sub-mesh
        ready = _search(model, example, captured, stage_mesh(info).as_dict(), search, cluster,
                        float("inf"), strategies if search == "propagate" else None, 0,
                        policy)  # fmt: skip
        strategies = ready.strategies
    rank = check_world(info, source, timeout_s)
    plans = _plan_modes(
        captured, stage_mesh(info), ready, strategies, input_layouts, source, *sequence
    )
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


def _plan_data(plan: Any) -> tuple[dict | None, str]:
    """A ``plan=``'s JSON with its ``pipeline`` section, and how an error names it."""
    if plan is None:
        return None, ""
    data = plan.json if isinstance(plan, Plan) else load_plan(plan)
    source = f"plan {plan}" if isinstance(plan, str | Path) else "the plan given"
    if not data or "pipeline" not in data:
        raise ValueError(
            f"{source} has no pipeline stages (no 'pipeline' section); make one with "
            "`autoshard plan --pp N --json FILE` or autoshard.plan(..., pp=N), or leave out "
            "schedule=, microbatches= and stages="
        )
    return data, source


def _configuration(pipeline: tuple, recompute: Any, data: dict | None, source: str) -> tuple:
    """(schedule, micro-batches, virtual stages, recompute): the keywords', else the plan's,
    else the defaults (1F1B, one micro-batch a stage, no recompute); a keyword that differs
    from the plan's is an error naming both."""
    schedule, microbatches, _, virtual_stages = pipeline
    given = {"schedule": schedule, "microbatches": microbatches,
             "virtual_stages": virtual_stages if virtual_stages != 1 else None,
             "recompute": recompute}  # fmt: skip
    if data is not None:
        planned = data["pipeline"]
        for key, value in given.items():
            if value is not None and value != planned[key]:
                raise ValueError(
                    f"parallelize: {key}={value!r}, but {source} has {key} "
                    f"{planned[key]!r}; leave it out or plan again"
                )
            given[key] = planned[key]
    return (given["schedule"] or "1f1b", given["microbatches"], given["virtual_stages"] or 1,
            given["recompute"])  # fmt: skip


def _check_split(og: Any, cut: Any, zero: Any, schedule: str) -> None:
    """A backward split into I and W reaches each weight from its one reader in a stage."""
    if zero == 3:
        raise ValueError(
            f"schedule={schedule!r} with zero=3: a split backward runs each weight reader's "
            "backward twice (I, then W), and ZeRO 3 frees a gathered weight after its last "
            "use; use zero=1 or 2 with this schedule, or gpipe, 1f1b or interleaved-1f1b "
            "with zero=3"
        )
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
