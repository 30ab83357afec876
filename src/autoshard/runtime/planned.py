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
from autoshard.graph import OpGraph
from autoshard.layout import Layout, LayoutError
from autoshard.mesh import MeshInfo, mesh_info
from autoshard.ops import StrategyError
from autoshard.search import Plan, check_zero, load_plan, plan_graph
from autoshard.search import input_layouts as plan_input_layouts
from autoshard.search import plan as search_plan


class PlanMismatchError(ValueError):
    """Ranks planned differently (different strategies, model or inputs on some rank)."""


def _search(
    model: nn.Module,
    example_inputs: Sequence[Any],
    captured: dict[bool, OpGraph],
    mesh: Any,
    search: str,
    cluster: Any,
    memory_limit: float | None,
    strategies: Any,
    zero: int | None,
    precision: Any = None,
) -> Plan:
    """The searched plan: an int ``mesh`` is a device count whose mesh shape is searched too;
    the ZeRO stage is searched too unless ``zero`` is given."""
    fixed = None if isinstance(mesh, int) else mesh
    num = mesh if isinstance(mesh, int) else mesh_info(mesh).num_devices
    return search_plan(
        model, example_inputs, cluster, search=search, num_devices=num, mesh=fixed,
        memory_limit=memory_limit, strategies=strategies, captured=captured, zero=zero,
        precision=precision,
    )  # fmt: skip


def _zero_of(zero: Any, given: Any, planned: Plan) -> int | dict[str, int]:
    """The ZeRO stages to run: ``zero`` when given, else the given plan's, else the plan's."""
    if zero is not None:
        return check_zero(zero)
    if isinstance(given, Plan):
        return given.zero
    if given is not None:
        return check_zero(load_plan(given).get("zero", 0))
    return planned.zero


def _plan_modes(
    captured: dict[bool, OpGraph],
    info: MeshInfo,
    ready: Plan | None,
    strategies: Any,
    input_layouts: Any,
    source: str = "",
    attention: str | None = None,
    sequence_parallel: bool = False,
) -> dict[bool, Plan]:
    """The train graph's plan (``ready`` when given) and the eval graph's, which keeps the
    train graph's parameter layouts. ``source``: the plan the strategies came from, named in
    an error when they do not fit the model."""
    try:
        train = ready or plan_graph(
            captured[True], info, strategies, input_layouts=input_layouts, attention=attention,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
    except StrategyError as err:
        if not source:
            raise
        raise StrategyError(f"{source} does not fit this model (made for another?): {err}") from err
    param_layouts = {fqn: p.layout for fqn, p in train.params.items()}
    evaluate = plan_graph(
        captured[False],
        info,
        strategies,
        input_layouts=input_layouts,
        param_layouts=param_layouts,
        strict=False,  # dropout nodes exist in the train graph only
        attention=attention,
        sequence_parallel=sequence_parallel,
    )
    return {True: train, False: evaluate}


def _given_plan(
    plan: Any,
    og: OpGraph,
    mesh: Any,
    strategies: Mapping[str, Any] | None,
    input_layouts: Mapping[str, Layout] | None,
) -> tuple[Plan | None, Any, Any, Any, str]:
    """What a ``plan=`` argument sets: the train graph's Plan when it was made for ``og``
    itself (no need to plan it again), the mesh, the strategies and input layouts that plan
    the eval graph (and the train graph of another capture), and where the mesh came from."""
    if plan is None:
        return None, mesh, strategies, input_layouts, ""
    if isinstance(plan, Plan):
        ready = plan if plan.graph is og and not input_layouts else None
        if plan.json is not None:
            input_layouts = _inputs_of(og, plan.json, input_layouts, "the plan given")
        return ready, plan.mesh, plan.strategies, input_layouts, "the plan given"
    source = f"plan {plan}" if isinstance(plan, str | Path) else "the plan given"
    data = load_plan(plan)
    input_layouts = _inputs_of(og, data, input_layouts, source)
    return None, data["mesh"], data["strategies"], input_layouts, source


def _inputs_of(og: OpGraph, data: Any, given: Any, source: str) -> dict[str, Layout]:
    """The plan's input layouts for ``og``'s inputs, ``given`` ones first."""
    try:
        return {**plan_input_layouts(og, data), **(given or {})}
    except LayoutError as err:
        raise LayoutError(f"{source} does not fit this model (made for another?): {err}") from err


def _compare_plans(plan: Plan, rank: int) -> None:
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


__all__ = ["PlanMismatchError"]
