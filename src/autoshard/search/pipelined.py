"""Planning with pipeline stages (docs/parallelism/pipeline.md): a stage's sub-mesh planned
for one micro-batch, then the stages, the schedule and recompute priced together
(``cost.price_pipeline``), as ``parallelize`` would run them.

Given ``pp``, ``microbatches``, the schedule and recompute (a Megatron-style configuration),
the stage plan is searched on ``num_devices / pp`` devices for the micro-batch's graph (every
stage runs it on its own sub-mesh); its memory is judged per stage by the pipeline's pricing,
which holds a stage's share of the state and the micro-batches in flight, not the whole
model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoshard.cost import ClusterSpec, cluster_spec
from autoshard.cost.pipeline import PipelineEstimate, price_pipeline
from autoshard.graph import OpGraph, cut_at_modules
from autoshard.layout import Layout
from autoshard.schedule import Schedule, make_schedule, validate
from autoshard.search.driver import SearchResult, build_plan, run_search
from autoshard.search.plans import Plan, PlanningError


@dataclass(frozen=True)
class PipelinePlan:
    """The stage plan (one micro-batch on one stage's sub-mesh), its search, the schedule and
    the pipeline's prediction."""

    stage: Plan
    result: SearchResult
    schedule: Schedule
    recompute: str
    predicted: PipelineEstimate
    boundary_bytes: float


def boundary_bytes(og: OpGraph, plan: Plan) -> float:
    """Bytes per rank of what one block hands the next (what crosses a stage boundary)."""
    prefix = next(iter(og.repeated), None)
    if prefix is None or len(og.repeated[prefix]) < 2:
        return 0.0
    second = f"{prefix}.{og.repeated[prefix][1]}"
    total = 0.0
    for name in cut_at_modules(og, [second]).receives[1]:
        node = og.by_name[name]
        if og[node].kind == "getitem":
            layout = plan.nodes[node.args[0].name].strategy.outs[node.args[1]]
        else:
            layout = plan.nodes[name].strategy.outs[0]
        if isinstance(layout, Layout):
            total += layout.local_numel * layout.dtype.itemsize
    return total


def plan_stages(
    og: OpGraph,
    num_devices: int,
    cluster: ClusterSpec,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    recompute: str = "none",
    search: str = "optimal",
    depth: Any = None,
    tp_across_nodes: bool = False,
) -> PipelinePlan:
    """The plan of ``og`` (captured with one micro-batch) on ``num_devices`` in ``pp``
    pipeline stages; a PlanningError when a stage does not fit the device."""
    if num_devices % pp:
        raise PlanningError(f"--pp {pp} does not divide the {num_devices} devices")
    sched = make_schedule(schedule, pp, microbatches, virtual_stages)
    validate(sched)
    devices = num_devices // pp
    sub = cluster_spec(cluster, devices)
    # the stage's memory is the pipeline's to judge (its share of the model, not all of it)
    # gradient sums and the optimizer step run once for all the micro-batches
    result = run_search(og, devices, sub, search=search, depth=depth, memory_limit=float("inf"),
                        tp_across_nodes=tp_across_nodes, zero=0,
                        step_share=1 / microbatches)  # fmt: skip
    stage = build_plan(og, result, sub)
    crossing = boundary_bytes(og, stage)
    mesh = stage.mesh
    stride = mesh.num_devices // mesh.size_of([n for n in mesh.names if n.startswith("dp")])
    predicted = price_pipeline(
        stage.predicted, og, sched, cluster, recompute, crossing, stride=max(stride, 1)
    )
    if predicted.peak_memory > cluster.memory_bytes:
        worst = max(range(len(predicted.memory)), key=lambda r: sum(predicted.memory[r].values()))
        parts = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in predicted.memory[worst].items())
        raise PlanningError(
            f"pp {pp}, {microbatches} micro-batches, {schedule}, recompute {recompute}: pipeline "
            f"rank {worst} needs {predicted.peak_memory / 2**30:.1f} GiB of the device's "
            f"{cluster.memory_bytes / 2**30:.1f} GiB ({parts}); try more stages, more "
            "micro-batches, recompute or ZeRO"
        )
    return PipelinePlan(stage, result, sched, recompute, predicted, crossing)


def pipeline_json(pp_plan: PipelinePlan, num_devices: int) -> dict:
    """The plan JSON's ``pipeline`` section: the configuration, its predicted step, bubble
    and MFU over ``num_devices``, each pipeline rank's memory by kind and each stage's
    forward and backward seconds per micro-batch."""
    p, s, est = pp_plan.predicted, pp_plan.schedule, pp_plan.stage.predicted
    flops = est.model_flops * s.microbatches
    return {
        "pp": s.num_ranks,
        "microbatches": s.microbatches,
        "schedule": s.name,
        "virtual_stages": s.num_stages // s.num_ranks,
        "recompute": pp_plan.recompute,
        "bubble": p.bubble,
        "step_time_s": p.step_time,
        "mfu": flops / (p.step_time * num_devices * est.peak_flops),
        "peak_memory_bytes": p.peak_memory,
        "boundary_bytes": pp_plan.boundary_bytes,
        "memory_bytes": [dict(m) for m in p.memory],
        "stage_seconds": [list(x) for x in p.stage_seconds],
        "stage_weight_seconds": list(p.weight_seconds),
        "hop_s": p.hop,
    }


__all__ = ["PipelinePlan", "boundary_bytes", "pipeline_json", "plan_stages"]
