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

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoshard.cost import ClusterSpec, cluster_spec, estimate
from autoshard.cost import pipeline as piped
from autoshard.cost.offload import Offload
from autoshard.graph import OpGraph
from autoshard.mesh import MeshInfo
from autoshard.options import Options
from autoshard.schedule import Schedule, ScheduleError, looped, make_schedule, v_shape
from autoshard.search.copies import priced
from autoshard.search.driver import paused_gc, run_search, size_text
from autoshard.search.offloading import offloaded
from autoshard.search.plans import Plan, PlanningError, staged_json
from autoshard.search.pruning import search_session
from autoshard.search.result_plan import SearchResult, build_plan
from autoshard.search.semi import plan_graph
from autoshard.search.state import cache


@dataclass(frozen=True)
class PipelinePlan:
    """The stage plan (one micro-batch on one stage's sub-mesh), its search, the schedule and
    the pipeline's prediction."""

    stage: Plan
    result: SearchResult
    schedule: Schedule
    recompute: str
    predicted: piped.PipelineEstimate
    boundary_bytes: float


#: the schedules and recompute modes tried where none is given (GPipe is 1F1B's bubble with
#: more memory; interleaved-1f1b with 2 stages a rank)
SEARCHED_SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 1))
SEARCHED_RECOMPUTE = ("full", "none", "selective")

#: the times a stage plan is searched again under a smaller memory limit where none of its
#: pipeline configurations fits (``search_pipeline``)
TIGHTENINGS = 3


@dataclass(frozen=True)
class Tried:
    """One configuration the pipeline search priced: its step and its peak memory per
    device (``fits``: within the device's memory)."""

    pp: int
    microbatches: int
    schedule: str
    virtual_stages: int
    recompute: str
    step_s: float
    peak_bytes: float
    fits: bool
    zero: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@paused_gc()
@search_session()
def search_pipeline(
    capture: Callable[[int], OpGraph],
    batch: int,
    num_devices: int,
    cluster: ClusterSpec,
    opts: Options,
    depth: Any = None,
) -> tuple[PipelinePlan, list[Tried], float]:
    """The fastest pipeline configuration that fits ``opts.memory_limit`` (default the
    cluster's memory): ``opts`` fixes any of ``pp``, ``microbatches``, ``schedule``,
    ``virtual_stages``, ``recompute`` (and a stage's sub-mesh: its ``mesh`` less ``pp``) and
    ``offload`` (None: searched, ``search.offloading``); the others are searched, each stage
    plan by ``opts.search``. ``capture(m)``: the graph of one of ``m`` micro-batches of the
    ``batch``. Returns the plan, every configuration priced and the seconds spent.

    The stage plan is searched once per stage sub-mesh and micro-batch size; schedules and
    recompute are priced on it. Every pipeline degree is tried at its first micro-batch count
    (about 4 a rank), then the other counts for the best degree (coarse to fine)."""
    start = time.perf_counter()
    if opts.memory_limit is not None:
        cluster = dataclasses.replace(cluster, memory_bytes=opts.memory_limit)
    k = opts.copies  # copies inside a micro-batch: the stage plan is one copy's
    if batch % k or (opts.microbatches and batch % (k * opts.microbatches)):
        raise PlanningError(
            f"copies={k} x microbatches={opts.microbatches or 1} does not divide the batch {batch}"
        )
    if k > 1:  # the graph of one of k copies of one of m micro-batches
        capture, batch = (lambda m, c=capture: c(m * k)), batch // k
    searches: list[_Search] = []

    def searched(choice: Offload, zero: int | None) -> PipelinePlan:  # one offload's search
        how = opts.replace(offload=choice.as_json(), zero=zero)
        searches.append(_Search(capture, batch, num_devices, cluster, how, depth, opts.stage_mesh))
        return searches[-1].run()

    given = opts.offload if opts.offload is not None or k > 1 else "auto"  # as without stages
    best = offloaded(searched, given, opts.zero, lambda plan: plan, cluster, staged=True)
    return best, [t for s in searches for t in s.tried], time.perf_counter() - start


@dataclass
class _Search:
    """A pipeline search's state: graphs, stage plans, what it priced."""

    capture: Callable[[int], OpGraph]
    batch: int
    num_devices: int
    cluster: ClusterSpec
    opts: Options
    depth: Any
    fixed: Any  # a stage's sub-mesh where the options fix one
    graphs: dict[int, OpGraph] = dataclasses.field(default_factory=dict)
    #: one spec a sub-mesh size: the session's pricing is kept by the spec's id
    subs: dict[int, ClusterSpec] = dataclasses.field(default_factory=dict)
    #: (sub-mesh devices, micro-batch size, ZeRO, limit): the stage plan and its search
    stage_plans: dict[tuple, tuple[Plan, SearchResult]] = dataclasses.field(default_factory=dict)
    tried: list[Tried] = dataclasses.field(default_factory=list)
    best: PipelinePlan | None = None
    least: PipelinePlan | None = None  # the least memory priced (what an error shows)
    unfit: float = math.inf  # the fastest priced at this ZeRO stage that does not fit
    alone: dict[int, Any] = dataclasses.field(default_factory=dict)  # ``floor``'s, a graph

    def run(self) -> PipelinePlan:
        """Coarse, then fine; the best."""
        opts, fixed = self.opts, self.fixed
        pps = [opts.pp] if opts.pp else _degrees(self)
        within = fixed.num_devices if fixed else (opts.cp or 1) * (opts.tp or 1)  # a stage's
        pps = [pp for pp in pps if (self.num_devices // pp) % within == 0] or [1]  # holds it
        for pp, m in [(pp, self.counts(pp)[0]) for pp in pps if self.counts(pp)]:
            self.price(pp, m)
        for pp, m in self.fine():
            self.price(pp, m)
        if self.best is None:
            raise PlanningError(_nothing_fits(self))
        return self.best  # (its schedule replayed in pricing; validated where it runs)

    def counts(self, pp: int) -> list[int]:
        return [self.opts.microbatches] if self.opts.microbatches else _counts(self.batch, pp)

    def fine(self) -> list[tuple[int, int]]:
        if self.opts.microbatches or self.best is None:
            return []
        pp = self.best.schedule.num_ranks
        return [(pp, m) for m in _counts(self.batch, pp)[1:]]

    def graph(self, m: int) -> OpGraph:
        if self.batch // m not in self.graphs:
            self.graphs[self.batch // m] = self.capture(m)
        return self.graphs[self.batch // m]

    def sub(self, pp: int) -> ClusterSpec:
        return self.subs.setdefault(pp, cluster_spec(self.cluster, self.num_devices // pp))

    def price(self, pp: int, m: int) -> None:
        # ZeRO raised a stage at a time while nothing fits, or while a configuration that does
        # not fit would be faster than the best: each stage shards more of the state over the
        # stage's data-parallel ranks (room for less recompute, a longer schedule) for more
        # communication (ZeRO 3 regathers every micro-batch, which the pipeline's pricing
        # does not hold: with one only); none where even its compute alone is slower
        if self.best is not None and self.floor(pp, m) >= self.best.predicted.step_time:
            return
        for z in [self.opts.zero] if self.opts.zero is not None else [0, 1, 2, 3]:
            if z == 3 and m > 1 and self.opts.zero is None:
                break
            self.unfit = math.inf
            fitted = self.price_at(pp, m, z)
            best = math.inf if self.best is None else self.best.predicted.step_time
            if fitted and not self.unfit < best:
                break

    def floor(self, pp: int, m: int) -> float:
        """No configuration of ``pp`` ranks and ``m`` micro-batches steps faster: its compute
        alone at the least it can take (``cost.pipeline.least_busiest``)."""
        og = self.graph(m)
        if id(og) not in self.alone:  # its every op on one device (the graphs outlive it)
            one = plan_graph(og, MeshInfo(("dp",), (1,), ("dp",)))
            self.alone[id(og)] = estimate(one, og, piped.steady(self.cluster), depth=self.depth)
        variants = _variants(self.opts, pp, m, _blocks(og, self.depth))
        places = {_placed(n, pp, v) for n, v, _ in variants}
        return piped.least_busiest(self.alone[id(og)], og, self.num_devices // pp, places, m)

    def price_at(self, pp: int, m: int, zero: int) -> bool:
        # The stage plan is searched for speed alone first (the pipeline's pricing judges its
        # memory); where nothing fits (nor full recompute, where a lighter one is given: it
        # leaves the stage plan as it is), again under a limit as much below its own memory as
        # the least pipeline was over the device's, to shard what speed alone replicates (a
        # fixed tp's weights) (up to TIGHTENINGS times, while the least memory comes down)
        limit, before = math.inf, math.inf
        for _ in range(TIGHTENINGS + 1):
            try:
                fitted, lowest, stage = self.price_with(pp, m, zero, limit)
            except PlanningError:  # nothing fits the stage search's limit
                return False
            if fitted or lowest is None or lowest >= before:
                return fitted
            tighter = stage.predicted.peak_memory * self.cluster.memory_bytes / lowest
            if tighter >= limit:
                return False
            limit, before = tighter, lowest
        return False

    def stage_plan(self, pp: int, m: int, zero: int, limit: float) -> tuple[Plan, SearchResult]:
        """The stage plan for ``pp`` ranks, ``m`` micro-batches, ``zero``, ``limit``, once."""
        key = (self.num_devices // pp, self.batch // m, zero, limit)
        if key not in self.stage_plans:
            og, sub = self.graph(m), self.sub(pp)
            how = self.opts.search_keywords() | {"zero": zero, "memory_limit": limit}
            k = self.opts.copies
            how |= {"depth": self.depth, "mesh": self.fixed, "step_share": 1 / (m * k)}
            result = run_search(og, self.num_devices // pp, sub, **how)
            built = priced(build_plan(og, result, sub), og, k, self.depth) if k > 1 else None
            self.stage_plans[key] = (built or build_plan(og, result, sub), result)
        return self.stage_plans[key]

    def price_with(self, pp: int, m: int, zero: int, limit: float) -> tuple:
        """Every variant of the stage plan searched at ``zero`` under ``limit``: whether one
        fits, the least peak memory priced (None: search no tighter plan), the stage plan."""
        og, cluster = self.graph(m), self.cluster
        stage, result = self.stage_plan(pp, m, zero, limit)
        fitted, lowest, fuller, closed = False, None, False, set()
        parts = piped.model_pieces(stage.predicted, og)  # the same for every schedule priced
        for name, v, rc in _variants(self.opts, pp, m, _blocks(og, self.depth)):
            # full recompute first: where it does not fit, less recompute keeps more; then
            # none, selective: once one fits, more recompute only adds time. Nor can a
            # configuration be faster whose busiest rank computes longer than the best step.
            placement = _placed(name, pp, v)
            if (name, v) in closed or (zero == 3 and name in ("zb-h1", "zbv")):
                continue  # a split backward reads a weight twice: not under ZeRO 3
            bound = piped.busiest_rank_seconds(stage.predicted, og, placement, m, rc, parts)
            if self.best is not None and bound >= self.best.predicted.step_time:
                continue
            try:
                plan = _priced(og, stage, result, cluster, pp, m, name, v, rc, parts)
            except ScheduleError:  # e.g. interleaved with micro-batches not a multiple of pp
                if self.opts.schedule:
                    raise
                closed.add((name, v))
                continue
            p = plan.predicted
            fits = p.peak_memory <= cluster.memory_bytes
            if not fits and limit == math.inf and rc != "full" and self.opts.recompute:
                full = _priced(og, stage, result, cluster, pp, m, name, v, "full", parts)
                fuller |= full.predicted.peak_memory <= cluster.memory_bytes
            lowest = min(lowest or math.inf, p.peak_memory)
            self.tried.append(Tried(pp, m, name, v, rc, p.step_time, p.peak_memory, fits, zero))
            self.keep(plan, fits)
            fitted |= fits
            if fits != (rc == "full"):
                closed.add((name, v))
        return fitted, None if fuller else lowest, stage

    def keep(self, plan: PipelinePlan, fits: bool) -> None:
        """``plan`` as the least memory priced, the fastest unfit, or the best."""
        p = plan.predicted
        if self.least is None or p.peak_memory < self.least.predicted.peak_memory:
            self.least = plan
        if not fits:
            self.unfit = min(self.unfit, p.step_time)
        elif self.best is None or p.step_time < self.best.predicted.step_time:
            self.best = plan


def _placed(name: str, pp: int, v: int) -> tuple[int, ...]:
    return v_shape(pp) if name == "zbv" else looped(pp, v)


def _schedule(name: str, pp: int, m: int, v: int) -> Schedule:
    """The named schedule, made once a search for every recompute mode priced on it (pricing
    plays it, which finds a deadlock or a dependency out of order; the chosen one is
    validated); the order its ranks run in is kept with it, so it lives as long as the search."""
    made = cache("schedules")
    key = (name, pp, m, v)
    if key not in made:
        made[key] = make_schedule(name, pp, m, v)
    return made[key]


def _priced(og, stage, result, cluster, pp, m, name, v, recompute, parts) -> PipelinePlan:
    """``stage``'s plan in ``pp`` stages under the schedule ``name`` and ``recompute``."""
    sched = _schedule(name, pp, m, v)
    copies = stage.json["predicted"].get("copies", 1)  # each sends its rows
    crossing = copies * piped.boundary_bytes(og, stage) if pp * v > 1 else 0.0  # one stage: none
    mesh = stage.mesh
    stride = mesh.num_devices // mesh.size_of([n for n in mesh.names if n.startswith("dp")])
    predicted = piped.price_pipeline(
        stage.predicted, og, sched, cluster, recompute, crossing, max(stride, 1), parts
    )
    return PipelinePlan(stage, result, sched, recompute, predicted, crossing)


def _blocks(og: OpGraph, depth: Any) -> int:
    """The model's repeated blocks at full depth (``depth`` maps a block list to its real
    count, as the search prices it)."""
    prefix = next(iter(og.repeated), None)
    return 1 if prefix is None else int((depth or {}).get(prefix, len(og.repeated[prefix])))


def _degrees(search: _Search) -> list:
    """Pipeline degrees to try: the device count's divisors from 2 up to the block count (a
    stage holds a block at least) that leave a micro-batch count dividing the batch; where
    none does (a batch of one), 1: one stage, recompute without a pipeline."""
    devices, batch, first = search.num_devices, search.batch, _counts(search.batch, 2)
    top = min(devices, _blocks(search.graph(first[0] if first else 1), search.depth))
    return [d for d in range(2, top + 1) if devices % d == 0 and _counts(batch, d)] or [1]


def _counts(batch: int, pp: int) -> list[int]:
    """Micro-batch counts for ``pp`` ranks: the smallest divisor of the batch from 4, 2 and
    8 micro-batches a rank up (a bubble near 1/5, 1/3, 1/9 of 1F1B's step), the first
    first."""
    out = []
    for k in (4, 2, 8):
        m = next((d for d in range(k * pp, batch + 1) if batch % d == 0), None)
        if m is not None and m not in out:
            out.append(m)
    return out or ([batch] if batch >= pp or pp == 1 else [])


def _variants(opts: Options, pp: int, m: int, blocks: int) -> list[tuple]:
    """(schedule, virtual stages, recompute) to price for ``pp`` ranks and ``m`` micro-
    batches: the given ones, else those the schedule can make with the model's blocks."""
    v = opts.virtual_stages
    if pp == 1:  # one stage: gradient accumulation, one micro-batch's activations at a time
        schedules = [("1f1b", 1)]
    elif opts.schedule:
        schedules = [(opts.schedule, opts.stages_a_rank)]
    elif v and v > 1:
        schedules = [("interleaved-1f1b", v)]
    else:
        schedules = list(SEARCHED_SCHEDULES)
    modes = [opts.recompute] if opts.recompute else list(SEARCHED_RECOMPUTE)
    out = []
    for name, v in schedules:
        stages = 2 * pp if name == "zbv" else v * pp
        if stages > blocks and not opts.schedule:  # a stage holds a block at least
            continue
        out += [(name, v, rc) for rc in modes]
    return out


def _nothing_fits(search: _Search) -> str:
    tried, least, cluster = search.tried, search.least, search.cluster
    if not tried or least is None:
        return (
            f"no pipeline configuration to try on {search.num_devices} devices (the pipeline "
            "degree must divide the devices and the micro-batch count the batch)"
        )
    p = least.predicted
    worst = max(range(len(p.memory)), key=lambda r: sum(p.memory[r].values()))
    parts = ", ".join(f"{k} {size_text(v)}" for k, v in p.memory[worst].items())
    return (
        f"no pipeline configuration fits {size_text(cluster.memory_bytes)} per device "
        f"({len(tried)} tried); the least memory: pp {least.schedule.num_ranks}, "
        f"{least.schedule.microbatches} micro-batches, {least.schedule.name}, recompute "
        f"{least.recompute}, ZeRO {least.stage.zero}: pipeline rank {worst} needs "
        f"{size_text(p.peak_memory)} "
        f"({parts}); try more stages, more micro-batches, recompute, ZeRO or more devices"
    )


def plan_with_stages(
    model: Any,
    example_inputs: tuple,
    cluster: ClusterSpec,
    num_devices: int,
    opts: Options,
    loss_fn: Any = None,
    example_kwargs: dict | None = None,
) -> Plan:
    """``autoshard.plan`` with pipeline stages: the stage plan whose JSON has the
    ``pipeline`` section ``parallelize(plan=...)`` runs (``opts`` fixes any of ``pp``,
    ``microbatches``, ``schedule``, ``virtual_stages``, ``recompute``; the rest searched)."""
    import torch
    import torch.utils._pytree as pytree

    from autoshard.graph.batches import micro_batch_graphs

    inputs = (example_inputs, example_kwargs)
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    batch = tensors[0].shape[0]
    how = {"loss_fn": loss_fn, "dtype": opts.policy.compute, "searched": not opts.microbatches}
    micro = micro_batch_graphs(model, example_inputs, example_kwargs, **how)
    if opts.microbatches and batch % opts.microbatches:
        raise ValueError(f"microbatches={opts.microbatches} does not divide the batch {batch}")
    best, tried, seconds = search_pipeline(micro, batch, num_devices, cluster, opts)
    return dataclasses.replace(best.stage, json=staged_json(best, tried, seconds, opts))


__all__ = [
    "SEARCHED_RECOMPUTE",
    "SEARCHED_SCHEDULES",
    "PipelinePlan",
    "Tried",
    "plan_with_stages",
    "search_pipeline",
]
