"""``autoshard.parallelize``: a single-device model in, this rank's part of the parallel model
out (a ``ParallelModule``, or a ``PipelineModule`` when the mesh has a ``pp`` axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.graph import OpGraph, call_inputs, capture, capture_modes
from autoshard.graph.failure import one_line_on_rank_zero
from autoshard.layout import Layout
from autoshard.mesh import check_world, mesh_info
from autoshard.options import BUCKET_CAP_MB, Options
from autoshard.precision import Precision
from autoshard.runtime.entry.planned import (
    check_fits,
    compare_plans,
    given_plan,
    plan_modes,
    search_plan,
    zero_of,
)
from autoshard.runtime.entry.staged import parallelize_pipeline
from autoshard.runtime.program import ParallelModule, batch_means, copy_example
from autoshard.runtime.state import check_init
from autoshard.search import Plan, load_plan


def parallelize(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    mesh: Any,
    strategies: Mapping[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    captured: dict[bool, OpGraph] | None = None,
    options: Options | None = None,
    input_layouts: Mapping[str, Layout] | None = None,
    seed: int = 0,
    search: str | None = None,
    cluster: Any = None,
    plan: Any = None,
    memory_limit: float | None = None,
    tp: int | None = None,
    cp: int | None = None,
    tp_across_nodes: bool = False,
    replicas: str = "broadcast",
    bucket_cap_mb: float = BUCKET_CAP_MB,
    precision: str | Precision | None = None,
    zero: int | Mapping[str, int] | None = None,
    reshard_after_forward: bool = True,
    init: Any = None,
    timeout_s: float | None = None,
    device: Any = None,
    pp: int | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    stages: Sequence[str] | None = None,
    virtual_stages: int | None = None,
    recompute: str | Mapping[str, str] | None = None,
    attention: str | None = None,
    sequence_parallel: bool = False,
    copies: int = 1,
    offload: Mapping[str, Any] | None = None,
) -> ParallelModule:
    """Capture ``model`` (with ``loss_fn``, the last input is the target), plan it on ``mesh``
    with the given strategies or a ``search``, check every rank planned the same, and lower this
    rank's part: a ``ParallelModule``, or with a ``pp`` axis, a pipeline keyword or a plan with
    a ``pipeline`` section, a ``PipelineModule`` whose stages a ``search`` plans as
    ``autoshard.plan`` does (docs/parallelism/pipeline.md). ``captured`` (``capture_modes``)
    skips the capture when planning again (with pipeline stages: of one micro-batch; with
    ``copies``, of one copy; a search
    with stages captures its own); given with a ``precision``, in its compute dtype. A dict
    ``example_inputs`` is the model's keywords (``pm(**batch)``); without ``loss_fn``, an
    output that carries a ``loss`` (a transformers ``ModelOutput``) is captured as that loss.

    Every other keyword is the field of ``autoshard.Options`` of its name, whose comment says
    what it means (docs/options.md); ``options`` is an ``Options`` the keywords add to (one
    that disagrees with it is an error)."""
    opts = Options.from_call(locals(), options)
    opts = opts.replace(copies=_copies(opts))
    example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
    pipelined = _pipelined(opts)
    if pipelined:
        return parallelize_pipeline(model, example_inputs, opts, loss_fn, example_kwargs, captured)
    return _one_program(model, example_inputs, opts, loss_fn, example_kwargs, captured)


def _one_program(
    model: nn.Module,
    example_inputs: Sequence[Any],
    opts: Options,
    loss_fn: Callable[..., torch.Tensor] | None,
    example_kwargs: dict[str, Any] | None,
    captured: dict[bool, OpGraph] | None,
) -> ParallelModule:
    """``parallelize`` without pipeline stages: one program a rank."""
    one_line_on_rank_zero()  # under a launcher: errors of the model or plan once, on rank 0
    check_init(model, opts.init)
    opts = opts.replace(precision=opts.policy.resolve(model))
    if captured is None:  # under copies, of one copy's rows: the program each copy runs
        example, kwargs = copy_example(tuple(example_inputs), example_kwargs, opts.copies)
        captured = capture_modes(model, example, kwargs, loss_fn=loss_fn, dtype=opts.policy.compute)
    if opts.search is not None:
        made = search_plan(model, example_inputs, captured, opts)
        opts = opts.replace(search=None, plan=made)
    ready, opts, source = given_plan(opts, captured[True])
    info = mesh_info(opts.mesh)
    rank = check_world(info, source, opts.timeout_s)
    plans = plan_modes(captured, info, ready, opts, source)
    plans[True] = dataclasses.replace(plans[True], zero=zero_of(opts, plans[True]))
    compare_plans(plans[True], rank)
    if opts.memory_limit is not None and ready is None:
        check_fits(plans[True], captured[True], opts)
    pm = ParallelModule(model, captured, plans, rank, opts)
    if opts.copies > 1:  # the whole batch's graph: which ops reduce over its rows
        whole = capture(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn,
                        dtype=opts.policy.compute)  # fmt: skip
        pm.copy_means = batch_means(captured[True], whole)
    return pm


def _copies(opts: Options) -> int:
    """The copies to run: those a given plan was made with (its strategies and input layouts
    are one copy's), else the options'; copies given that differ from the plan's are an
    error naming both."""
    if opts.plan is None:
        return opts.copies
    data = opts.plan.json if isinstance(opts.plan, Plan) else load_plan(opts.plan)
    planned = int((data or {}).get("options", {}).get("copies", 1))
    if opts.copies not in (1, planned):
        source = "the plan given" if isinstance(opts.plan, Plan) else f"plan {opts.plan}"
        raise ValueError(
            f"copies={opts.copies}, but {source} was made with copies {planned}; leave it "
            "out or plan again"
        )
    return planned


def _pipelined(opts: Options) -> bool:
    """Whether ``parallelize`` makes pipeline stages: a ``pp`` axis, a pipeline keyword, or
    a plan with a ``pipeline`` section (a ``plan=`` sets the mesh, which is None then)."""
    if opts.staged:
        return True
    if opts.plan is not None:
        data = opts.plan.json if isinstance(opts.plan, Plan) else load_plan(opts.plan)
        return bool(data) and "pipeline" in data
    mesh = opts.mesh
    return mesh is not None and not isinstance(mesh, int) and "pp" in mesh_info(mesh).names


__all__ = ["parallelize"]
