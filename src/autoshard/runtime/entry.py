"""``autoshard.parallelize``: a single-device model in, this rank's part of the parallel model
out (a ``ParallelModule``, or a ``PipelineModule`` when the mesh has a ``pp`` axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.cost.collectives import BUCKET_CAP_MB
from autoshard.graph import OpGraph, capture_modes
from autoshard.graph.failure import one_line_on_rank_zero
from autoshard.layout import Layout
from autoshard.mesh import check_world, mesh_info
from autoshard.precision import Precision, precision_policy
from autoshard.runtime.materialize import check_init
from autoshard.runtime.parallel import ParallelModule
from autoshard.runtime.pipeline_entry import parallelize_pipeline
from autoshard.runtime.planned import (
    _compare_plans,
    _given_plan,
    _plan_modes,
    _search,
    _zero_of,
)
from autoshard.search import Plan, load_plan


def parallelize(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: Any,
    strategies: Mapping[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    input_layouts: Mapping[str, Layout] | None = None,
    seed: int = 0,
    captured: dict[bool, OpGraph] | None = None,
    search: str | None = None,
    cluster: Any = None,
    plan: Any = None,
    memory_limit: float | None = None,
    replicas: str = "broadcast",
    bucket_cap_mb: float = BUCKET_CAP_MB,
    precision: str | Precision | None = None,
    zero: int | Mapping[str, int] | None = None,
    reshard_after_forward: bool = True,
    init: Any = None,
    timeout_s: float | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    stages: Sequence[str] | None = None,
    virtual_stages: int = 1,
    recompute: str | Mapping[str, str] | None = None,
    attention: str | None = None,
    sequence_parallel: bool = False,
) -> ParallelModule:
    """Capture ``model`` (with ``loss_fn``, the last input is the target), plan it on ``mesh``
    with the given strategies, check every rank planned the same, and lower this rank's part.
    ``search`` ("optimal", "recursive", "propagate") plans automatically for ``cluster``
    (default the ``cpu`` preset): an int ``mesh`` searches its shape too. ``plan`` is a Plan
    from ``autoshard.plan``, or its JSON (a dict or a file from ``autoshard plan --json``); it
    sets the mesh (and, with a ``pipeline`` section, the stages and their schedule). With a
    ``pp`` axis, ``search`` plans one stage's sub-mesh. ``captured`` (``capture_modes``)
    skips the capture when planning again (with pipeline stages: of one micro-batch).
    ``replicas``: "broadcast" the first rank's part of each parameter and buffer to the ranks
    that hold the same part, "check" that they are equal (naming the rank that differs), or
    "none". ``bucket_cap_mb``: the size of the buckets whose gradient sums overlap backward
    (DDP's default, 25). ``precision`` ("fp32", "bf16", "fp16" or a ``Precision``): the dtype
    the model computes in and gradients are summed in (docs/precision.md); a ``captured``
    given with it must have been captured in its compute dtype. ``zero`` (0, 1, 2, 3, or
    ``{fqn pattern: stage}``; default the plan's, else 0): ZeRO over each parameter's
    data-parallel replicas (docs/zero.md); ``reshard_after_forward`` (stage 3): drop gathered
    parameters after forward and gather them again in backward. ``init`` (a model built on
    meta): a checkpoint, ``"reset"`` or a function of a module (docs/meta.md). ``timeout_s``:
    the longest wait in a collective; then every rank stops, naming the ranks that never
    arrived (docs/failures.md; default: the process group's own timeout, naming none).
    A mesh axis ``pp`` cuts the model into pipeline stages (docs/parallelism/pipeline.md):
    ``schedule`` (default ``"1f1b"``), ``microbatches`` (the batch is cut into that many,
    default the ``pp`` size), ``stages`` (module paths where stages 2, 3, ... begin; default
    cut between repeated blocks by FLOPs), ``virtual_stages`` (stages per rank of
    ``interleaved-1f1b``). ``recompute`` (``"none"``, ``"full"``, ``"selective"`` or
    ``{module glob: mode}``): which repeated blocks backward runs again instead of keeping
    their activations (docs/parallelism/pipeline.md). A mesh axis ``cp`` splits the inputs'
    sequence dim (dim 1) and every activation after them (docs/parallelism/sequence.md);
    ``attention`` (``"allgather"``, the default, ``"ulysses"`` or ``"ring"``) is how an
    attention computes its query rows split by sequence. ``sequence_parallel``: the values
    pending a sum over tensor-parallel axes (row-split linears' outputs) are reduce-scattered
    by sequence, so the norms, dropouts and residual adds between the tensor-parallel linears
    run on a block of the sequence (Megatron's sequence parallelism)."""
    # Whole: the public entry point; its keywords and their meaning are one list to read
    if search is not None and plan is not None:
        raise ValueError("parallelize: give search= or plan=, not both")
    if _pipelined(mesh, schedule, microbatches, stages, plan):
        return parallelize_pipeline(
            model, example_inputs, mesh, strategies, loss_fn, example_kwargs, input_layouts,
            seed,
            (replicas, bucket_cap_mb, precision, zero, reshard_after_forward, init, recompute),
            timeout_s, (schedule, microbatches, stages, virtual_stages),
            (search, cluster, plan, captured), (attention, sequence_parallel),
        )  # fmt: skip
    one_line_on_rank_zero()  # under a launcher: errors of the model or plan once, on rank 0
    check_init(model, init)
    policy = precision_policy(precision).resolve(model)
    if captured is None:
        captured = capture_modes(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn,
                                 dtype=policy.compute)  # fmt: skip
    if search is not None:
        given = strategies if search == "propagate" else None
        plan = _search(model, example_inputs, captured, mesh, search, cluster, memory_limit,
                       given, zero if isinstance(zero, int) else None, policy)  # fmt: skip
    ready, mesh, strategies, input_layouts, source = _given_plan(
        plan, captured[True], mesh, strategies, input_layouts
    )
    info = mesh_info(mesh)
    rank = check_world(info, source, timeout_s)
    plans = _plan_modes(
        captured, info, ready, strategies, input_layouts, source, attention, sequence_parallel
    )
    plans[True] = dataclasses.replace(plans[True], zero=_zero_of(zero, plan, plans[True]))
    _compare_plans(plans[True], rank)
    options = (replicas, bucket_cap_mb, policy, reshard_after_forward, init, recompute)
    return ParallelModule(model, captured, plans, rank, seed, *options)


def _pipelined(mesh: Any, schedule: Any, microbatches: Any, stages: Any, plan: Any) -> bool:
    """Whether ``parallelize`` makes pipeline stages: a ``pp`` axis, a pipeline keyword, or
    a plan with a ``pipeline`` section (a ``plan=`` sets the mesh, which is None then)."""
    if schedule is not None or microbatches is not None or stages is not None:
        return True
    if plan is not None:
        data = plan.json if isinstance(plan, Plan) else load_plan(plan)
        return bool(data) and "pipeline" in data
    return mesh is not None and "pp" in mesh_info(mesh).names


__all__ = ["parallelize"]
