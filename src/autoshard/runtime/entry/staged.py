"""``parallelize`` with a ``pp`` mesh axis: the micro-batch captured, one plan for a stage's
sub-mesh, the stages cut, the schedule made and validated, this rank's stages lowered."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard import comm
from autoshard.graph import OpGraph, capture, capture_modes
from autoshard.graph.failure import one_line_on_rank_zero
from autoshard.lower import weight_readers
from autoshard.mesh import check_world, mesh_info
from autoshard.options import Options
from autoshard.runtime.entry.planned import (
    check_fits,
    compare_plans,
    inputs_of,
    plan_modes,
    search_plan,
)
from autoshard.runtime.pipeline import (
    Pipe,
    PipelineModule,
    cut_modes,
    microbatch_example,
    pipeline_groups,
    pipeline_plans,
    stage_mesh,
)
from autoshard.runtime.program import batch_means, copy_example
from autoshard.runtime.state import check_init
from autoshard.schedule import make_schedule, validate
from autoshard.search import Plan, load_plan
from autoshard.search.plans import check_zero


def parallelize_pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    opts: Options,
    loss_fn: Callable[..., torch.Tensor] | None,
    example_kwargs: dict[str, Any] | None,
    captured: dict[bool, OpGraph] | None,
) -> PipelineModule:
    """``parallelize`` with pipeline stages, under the same ``opts``; ``captured``: of one
    micro-batch, if made already. A search plans the stages as ``autoshard.plan`` does (the
    mesh's ``pp`` and sub-mesh fixed, the rest of the pipeline searched unless given)."""
    if opts.search is not None:
        made = search_plan(
            model, example_inputs, None, opts, loss_fn=loss_fn, example_kwargs=example_kwargs
        )
        opts = opts.replace(search=None, plan=made)
    data, source = _plan_data(opts.plan)
    if data is not None:
        opts = opts.planned_under(data.get("options", {}), source)
        zero = data.get("zero", 0) if opts.zero is None else opts.zero
        mesh = {"pp": data["pipeline"]["pp"], **data["mesh"]}
        opts = opts.replace(mesh=mesh, strategies=data["strategies"], zero=zero)
    opts = _configuration(opts, data, source)
    one_line_on_rank_zero()
    check_init(model, opts.init)
    info = mesh_info(opts.mesh)
    if "pp" not in info.names:  # one stage: micro-batches, recompute, no pipeline ranks
        info = mesh_info({"pp": 1, **info.as_dict()})
    pp = info.size_of(["pp"])
    m = pp if opts.microbatches is None else opts.microbatches  # one micro-batch a rank
    plan_schedule = make_schedule(opts.schedule, pp, m, opts.stages_a_rank)
    validate(plan_schedule)
    opts = opts.replace(precision=opts.policy.resolve(model), microbatches=m)
    example, kwargs = _example(example_inputs, example_kwargs, opts, plan_schedule)
    if captured is None:
        captured = capture_modes(model, example, kwargs, loss_fn=loss_fn, dtype=opts.policy.compute)
    if any(og.mutations for og in captured.values()):
        raise ValueError(
            "pipeline stages: the model updates buffers in forward (batch norm's running "
            "statistics); that is not supported under a pp axis yet"
        )
    if data is not None:
        layouts = inputs_of(captured[True], data, opts.input_layouts, source)
        opts = opts.replace(input_layouts=layouts)
    rank = check_world(info, source, opts.timeout_s)
    plans = plan_modes(captured, stage_mesh(info), None, opts, source)
    zero = opts.zero if opts.zero is not None else 0
    plans[True] = dataclasses.replace(plans[True], zero=check_zero(zero))
    compare_plans(plans[True], rank)
    if opts.memory_limit is not None and data is None:
        check_fits(plans[True], captured[True], opts, plan_schedule)
    cuts = cut_modes(captured, plan_schedule.num_stages, list(opts.stages or []) or None)
    if plan_schedule.split_backward:
        _check_split(captured[True], cuts[True], opts.zero, opts.schedule)
    groups = pipeline_groups(info)
    coordinate = next(c for c, g in enumerate(groups) if rank in g)
    pipe = Pipe(cuts, plan_schedule, groups, coordinate, groups[coordinate].index(rank))
    plans = pipeline_plans(plans, cuts, pipe.stages, groups[coordinate])
    pm = _made_together(model, captured, plans, rank, opts, pipe=pipe, microbatches=m)
    return _with_copy_means(pm, model, example_inputs, example_kwargs, loss_fn)


def _made_together(*args: Any, **kwargs: Any) -> PipelineModule:
    """This rank's stages made (``PipelineModule(*args, **kwargs)``), or the failure of the
    first rank whose stages failed raised on every rank. A stage's checks (a host table read
    besides its lookups) run only on the ranks holding that stage: without this the other
    stages' ranks would go on and wait in their first step for ranks that are gone."""
    try:
        pm, failed = PipelineModule(*args, **kwargs), None
    except Exception as error:  # any: the other ranks must hear of it, then it is raised
        pm, failed = None, error
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        told = None if failed is None else (isinstance(failed, ValueError), str(failed))
        said = comm.all_gather_object(told)
        first = next(((r, t) for r, t in enumerate(said) if t is not None), None)
        if first is not None and failed is None:
            rank, (refused, text) = first
            kind = ValueError if refused else RuntimeError
            raise kind(f"rank {rank} could not make its pipeline stages: {text}")
    if failed is not None:
        raise failed
    return pm


def _with_copy_means(
    pm: PipelineModule,
    model: nn.Module,
    example_inputs: Sequence[Any],
    kwargs: dict | None,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> PipelineModule:
    """Under copies, which ops of a stage reduce over the rows of its micro-batch (a router's
    per-expert loads): found as the one program finds them over its batch, from the graph of
    one micro-batch's whole rows beside the one copy's that the stages run."""
    opts = pm.options
    if opts.copies > 1:
        example, kwargs = microbatch_example(tuple(example_inputs), kwargs, opts.microbatches)
        whole = capture(model, example, kwargs, loss_fn=loss_fn, dtype=opts.policy.compute)
        pm.copy_means = batch_means(pm.captured[True], whole)
    return pm


def _example(
    example_inputs: Sequence[Any], kwargs: dict | None, opts: Options, schedule: Any
) -> tuple[tuple, dict | None]:
    """What is captured: one micro-batch of the example, under copies one copy's rows of it
    (the program each copy runs)."""
    if opts.copies > 1 and schedule.split_backward:
        raise ValueError(
            f"copies={opts.copies} with schedule={opts.schedule!r}: a split backward's weight "
            "halves are not run as copies yet; use gpipe, 1f1b or interleaved-1f1b"
        )
    example, kwargs = microbatch_example(tuple(example_inputs), kwargs, opts.microbatches)
    return copy_example(example, kwargs, opts.copies)


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


def _configuration(opts: Options, data: dict | None, source: str) -> Options:
    """The options with the schedule, micro-batches, virtual stages and recompute: the
    keywords', else the plan's, else the defaults (1F1B, one micro-batch a stage, the stages
    a rank the search would pick, no recompute); a keyword that differs from the plan's is
    an error naming both."""
    names = ("schedule", "microbatches", "virtual_stages", "recompute")
    given = {n: getattr(opts, n) for n in names}
    if data is not None:
        planned = data["pipeline"]
        for key, value in given.items():
            if value is not None and value != planned[key]:
                raise ValueError(
                    f"parallelize: {key}={value!r}, but {source} has {key} "
                    f"{planned[key]!r}; leave it out or plan again"
                )
            given[key] = planned[key]
    opts = opts.with_mesh_pp()
    return opts.replace(schedule=given["schedule"] or "1f1b", **{n: given[n] for n in names[1:]})


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
