"""``autoshard.parallelize``: a single-device model in, this rank's part of the parallel model
out (a ``ParallelModule``, or a ``PipelineModule`` when the mesh has a ``pp`` axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.graph import OpGraph, call_inputs, capture_modes
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
from autoshard.runtime.program import ParallelModule
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
    pp: int | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    stages: Sequence[str] | None = None,
    virtual_stages: int | None = None,
    recompute: str | Mapping[str, str] | None = None,
    attention: str | None = None,
    sequence_parallel: bool = False,
) -> ParallelModule:
    """Capture ``model`` (with ``loss_fn``, the last input is the target), plan it on ``mesh`` with
    the given strategies, check every rank planned the same, and lower this rank's part. A
    dict ``example_inputs`` is the model's keywords (``pm(**batch)``); without ``loss_fn``, an
    output that carries a ``loss`` (a transformers ``ModelOutput``) is captured as that loss.
    ``search`` ("optimal", "recursive", "propagate") plans automatically for ``cluster``
    (default the ``cpu`` preset): an int ``mesh`` searches its shape too. ``plan`` is a Plan
    from ``autoshard.plan``, or its JSON (a dict or a file from ``autoshard plan --json``); it
    sets the mesh (and, with a ``pipeline`` section, the stages and their schedule). With a
    ``pp`` axis (or ``pp=``, with an int mesh), ``search`` plans the stages as
    ``autoshard.plan`` does, every option reaching it; ``tp``, ``cp`` and ``tp_across_nodes``
    bound the meshes it searches. ``options``: an ``autoshard.Options`` the keywords add to (one
    that disagrees with it is an error); every keyword is one of its fields (docs/options.md).
    ``memory_limit``: bytes a device may hold, for a searched plan and one made from strategies
    alike. ``captured`` (``capture_modes``) skips the capture when planning again (with pipeline
    stages: of one micro-batch; a search with stages captures its own). ``replicas``:
    "broadcast" the first rank's part of each parameter and buffer to the ranks that hold the
    same part, "check" that they are equal (naming the rank that differs), or "none".
    ``bucket_cap_mb``: the size of the buckets whose gradient sums overlap backward (DDP's
    default, 25). ``precision`` ("fp32", "bf16", "fp16" or a ``Precision``): the dtype the model
    computes in and gradients are summed in (docs/precision.md); a ``captured`` given with it
    must have been captured in its compute dtype. ``zero`` (0, 1, 2, 3, or ``{fqn pattern:
    stage}``; default the plan's, else 0): ZeRO over each parameter's data-parallel replicas
    (docs/zero.md); ``reshard_after_forward`` (stage 3): drop gathered parameters after forward
    and gather them again in backward. ``init`` (a model built on meta): a checkpoint,
    ``"reset"`` or a function of a module (docs/meta.md). ``timeout_s``: the longest wait in a
    collective; then every rank stops, naming the ranks that never arrived (docs/failures.md;
    default: the process group's own timeout, naming none). A mesh axis ``pp`` cuts the model
    into pipeline stages (docs/parallelism/pipeline.md): ``schedule`` (default ``"1f1b"``),
    ``microbatches`` (the batch is cut into that many, default the ``pp`` size), ``stages``
    (module paths where stages 2, 3, ... begin; default cut between repeated blocks by FLOPs),
    ``virtual_stages`` (stages per rank of ``interleaved-1f1b``, default 2, as the search
    picks). ``recompute`` (``"none"``, ``"full"``, ``"selective"`` or ``{module glob: mode}``):
    which repeated blocks backward runs again instead of keeping their activations
    (docs/parallelism/pipeline.md). A mesh axis ``cp`` splits the inputs' sequence dim (dim 1)
    and every activation after them (docs/parallelism/sequence.md); ``attention``
    (``"allgather"``, the default, ``"ulysses"`` or ``"ring"``) is how an attention computes its
    query rows split by sequence. ``sequence_parallel``: the values pending a sum over tensor-
    parallel axes (row-split linears' outputs) are reduce-scattered by sequence, so the norms,
    dropouts and residual adds between the tensor-parallel linears run on a block of the
    sequence (Megatron's sequence parallelism)."""
    # Whole: the public entry point; its keywords and their meaning are one list to read
    opts = Options.from_call(locals(), options)
    example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
    if _pipelined(opts):
        return parallelize_pipeline(model, example_inputs, opts, loss_fn, example_kwargs, captured)
    one_line_on_rank_zero()  # under a launcher: errors of the model or plan once, on rank 0
    check_init(model, opts.init)
    opts = opts.replace(precision=opts.policy.resolve(model))
    if captured is None:
        captured = capture_modes(model, tuple(example_inputs), example_kwargs, loss_fn=loss_fn,
                                 dtype=opts.policy.compute)  # fmt: skip
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
    return ParallelModule(model, captured, plans, rank, opts)


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
