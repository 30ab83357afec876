"""How ``parallelize`` gets its plans: searched, given (a Plan or its JSON) or planned from
strategies, for the train and eval graphs, the ZeRO stage to run, and the check that every rank
planned the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from autoshard import comm
from autoshard.cost import cluster_spec, estimate
from autoshard.cost.pipeline import price_pipeline
from autoshard.graph import OpGraph
from autoshard.layout import Layout, LayoutError
from autoshard.mesh import MeshInfo, mesh_info
from autoshard.ops import StrategyError
from autoshard.options import Options
from autoshard.schedule import Schedule
from autoshard.search import Plan, PlanningError, check_zero, load_plan, plan_graph
from autoshard.search import input_layouts as plan_input_layouts
from autoshard.search import plan as search_plan_of
from autoshard.search.driver import size_text


class PlanMismatchError(ValueError):
    """Ranks planned differently (different strategies, model or inputs on some rank)."""


def search_plan(
    model: nn.Module,
    example_inputs: Sequence[Any],
    captured: dict[bool, OpGraph],
    opts: Options,
    **keywords: Any,
) -> Plan:
    """The searched plan of ``opts``: an int mesh is a device count whose mesh shape is
    searched too; the ZeRO stage is searched too unless one stage is given. ``keywords``
    (the pipeline path's example and kwargs of the whole batch) go to ``autoshard.plan``."""
    mesh = opts.mesh
    num = mesh if isinstance(mesh, int) else mesh_info(mesh).num_devices
    given = opts.strategies if opts.search == "propagate" else None
    zero = opts.zero if isinstance(opts.zero, int) else None
    return search_plan_of(
        model,
        example_inputs,
        search=opts.search,
        num_devices=num,
        captured=captured,
        options=opts.replace(
            mesh=None if isinstance(mesh, int) else mesh, strategies=given, zero=zero, search=None
        ),
        **keywords,
    )


def zero_of(opts: Options, planned: Plan) -> int | dict[str, int]:
    """The ZeRO stages to run: the options', else the given plan's, else the plan's."""
    if opts.zero is not None:
        return check_zero(dict(opts.zero) if isinstance(opts.zero, Mapping) else opts.zero)
    if isinstance(opts.plan, Plan):
        return opts.plan.zero
    if opts.plan is not None:
        return check_zero(load_plan(opts.plan).get("zero", 0))
    return planned.zero


def plan_modes(
    captured: dict[bool, OpGraph],
    info: MeshInfo,
    ready: Plan | None,
    opts: Options,
    source: str = "",
) -> dict[bool, Plan]:
    """The train graph's plan (``ready`` when given) and the eval graph's, which keeps the
    train graph's parameter layouts, both under ``opts``' strategies, input layouts,
    attention and sequence parallelism. ``source``: the plan the strategies came from, named
    in an error when they do not fit the model."""
    how = {
        "input_layouts": opts.input_layouts,
        "attention": opts.attention,
        "sequence_parallel": opts.sequence_parallel,
    }
    train = ready or _planned_for(captured[True], info, opts.strategies, source, **how)
    param_layouts = {fqn: p.layout for fqn, p in train.params.items()}
    # strict=False: dropout nodes exist in the train graph only
    evaluate = plan_graph(
        captured[False], info, opts.strategies, param_layouts=param_layouts, strict=False, **how
    )
    return {True: train, False: evaluate}


def _planned_for(og: OpGraph, info: MeshInfo, strategies: Any, source: str, **how) -> Plan:
    """``og`` planned under ``strategies``; where they do not fit it, an error naming
    ``source`` (the plan they came from) as made for another model."""
    try:
        return plan_graph(og, info, strategies, **how)
    except StrategyError as err:
        if not source:
            raise
        raise StrategyError(f"{source} does not fit this model (made for another?): {err}") from err


def check_plan_fits(og: OpGraph, plan: str | Path) -> None:
    """The plan file ``plan`` fits ``og``, a capture of the model it is to run: its input
    layouts and strategies plan the graph (else an error naming the file)."""
    source, data = f"plan {plan}", load_plan(plan)
    layouts = inputs_of(og, data, None, source)
    _planned_for(og, mesh_info(data["mesh"]), data["strategies"], source, input_layouts=layouts)


def given_plan(opts: Options, og: OpGraph) -> tuple[Plan | None, Options, str]:
    """What ``opts.plan`` sets: the train graph's Plan when it was made for ``og`` itself (no
    need to plan it again), the options with its mesh, strategies and input layouts (that plan
    the eval graph, and the train graph of another capture) and the options it was made under
    (those the keywords left out), and where the mesh came from."""
    plan = opts.plan
    if plan is None:
        return None, opts, ""
    ready = None
    if isinstance(plan, Plan):
        source, data = "the plan given", plan.json
        ready = plan if plan.graph is og and not opts.input_layouts else None
    else:
        source = f"plan {plan}" if isinstance(plan, str | Path) else "the plan given"
        data = load_plan(plan)
    mesh = plan.mesh if isinstance(plan, Plan) else data["mesh"]
    strategies = plan.strategies if isinstance(plan, Plan) else data["strategies"]
    layouts = opts.input_layouts
    if data is not None:
        layouts = inputs_of(og, data, opts.input_layouts, source)
        opts = opts.planned_under(data.get("options", {}), source)
    return ready, opts.replace(mesh=mesh, strategies=strategies, input_layouts=layouts), source


def inputs_of(og: OpGraph, data: Any, given: Any, source: str) -> dict[str, Layout]:
    """The plan's input layouts for ``og``'s inputs, ``given`` ones first."""
    try:
        return {**plan_input_layouts(og, data), **(given or {})}
    except LayoutError as err:
        raise LayoutError(f"{source} does not fit this model (made for another?): {err}") from err


def check_fits(plan: Plan, og: OpGraph, opts: Options, schedule: Schedule | None = None) -> None:
    """A plan made from strategies keeps ``opts.memory_limit`` as a searched one does: its
    peak per device, priced on ``opts.cluster`` (with ``schedule``: a stage's under it, the
    micro-batches in flight), over the limit is a PlanningError naming its parts."""
    spec = cluster_spec(opts.cluster, plan.mesh.num_devices)
    est = estimate(plan, og, spec, bucket_cap_mb=opts.bucket_cap_mb)
    peak, parts = est.peak_memory, dict(est.memory)
    if schedule is not None:
        mode = opts.recompute if isinstance(opts.recompute, str) else "none"
        priced = price_pipeline(est, og, schedule, spec, mode)
        peak = priced.peak_memory
        parts = max(priced.memory, key=lambda m: sum(m.values()))
    if peak > opts.memory_limit:
        shown = ", ".join(f"{k} {size_text(v)}" for k, v in parts.items())
        raise PlanningError(
            f"the plan needs {size_text(peak)} per device ({shown}), over memory_limit="
            f"{opts.memory_limit:g} ({size_text(opts.memory_limit)}); search='optimal' finds "
            "a plan that fits if one does (ZeRO, recompute, more devices)"
        )


def compare_plans(plan: Plan, rank: int) -> None:
    """Every rank must hold the same plan before the first collective of training."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = plan.digests()
    everyone = comm.all_gather_object(mine)
    for other_rank, other in enumerate(everyone):
        if other == mine:
            continue
        for i in range(max(len(mine), len(other))):
            a = mine[i] if i < len(mine) else "(nothing)"
            b = other[i] if i < len(other) else "(nothing)"
            if a != b:
                raise PlanMismatchError(
                    f"rank {rank} and rank {other_rank} planned differently: rank {rank} has "
                    f"'{a[:300]}' where rank {other_rank} has '{b[:300]}'"
                )


__all__ = [
    "PlanMismatchError",
    "check_fits",
    "check_plan_fits",
    "compare_plans",
    "given_plan",
    "inputs_of",
    "plan_modes",
    "search_plan",
    "zero_of",
]
