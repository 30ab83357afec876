"""autoshard's expert parallelism against the same model with replicated experts, same run.

autoshard's MoE reference model (2 layers, hidden 256, 8 heads, 4 kv heads, 8 experts of ffn 512,
top 2, seq 64, vocab 512, global batch 16, float32, AdamW) on 2 CPU ranks of 1 thread (gloo),
three ways taking turns, one step each a round, the order turning around every round:
``parallelize(model, batch, {"ep": 2})`` (4 experts a rank, tokens exchanged by all-to-all),
``parallelize(model, batch, {"dp": 2})`` (every expert on every rank) and
``DistributedDataParallel(model)`` (the eager model, replicated, each rank its half of the
batch). A step is forward, backward and the optimizer step, the slowest rank's time after a
barrier; a ratio is the median over rounds of that round's ratio, with its 95% interval.
Peak memory per rank: the most tensor storage alive during a step (``LiveBytes``), the state
held between steps included. Then the all-to-all: the seconds a rank spends in the experts'
exchanges in a step (every ``comm.all_to_all_v`` call timed), beside the cost model's
``exchange_times`` of the same plan for this machine as ``autoshard calibrate`` measures it.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from bench.memory import step_peak
from bench.timing import adamw, in_turns, paired_ratio, train_step

NAME = "expert"

ROUNDS, WARMUP = 20, 3
BATCH = 16
WAYS = ("ep", "dp", "ddp")
SIZES = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 512, "experts": 8,
         "top_k": 2, "vocab": 512, "seq": 64}  # fmt: skip


def _model():
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("moe", **SIZES)
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


def _builders(model: torch.nn.Module, batch: tuple) -> dict[str, Callable[[], tuple]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoshard import parallelize, shard_inputs

    world, rank = dist.get_world_size(), dist.get_rank()

    def ours(axis: str) -> Callable[[], tuple]:
        def build() -> tuple:
            pm = parallelize(copy.deepcopy(model), batch, {axis: world})
            return pm, adamw(pm), shard_inputs(batch, pm)

        return build

    def ddp() -> tuple:
        m = DDP(copy.deepcopy(model))
        return m, adamw(m), tuple(t.chunk(world)[rank] for t in batch)

    return {"ep": ours("ep"), "dp": ours("dp"), "ddp": ddp}


def _exchange_seconds(state: tuple, steps: int) -> float:
    """The median over ``steps`` of a step's seconds inside the experts' all-to-alls."""
    from autoshard import comm

    spent: list[float] = []
    original = comm.all_to_all_v

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        out = original(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return out

    per_step = []
    comm.all_to_all_v = timed
    try:
        for _ in range(steps):
            spent.clear()
            train_step(*state)
            per_step.append(sum(spent))
    finally:
        comm.all_to_all_v = original
    return statistics.median(per_step)


def _rank(rounds: int) -> dict:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, batch = _model()
    builders = _builders(model, batch)
    outside = [*model.parameters(), *model.buffers(), *batch]
    peaks = {}
    for way in WAYS:
        t = torch.tensor([step_peak(builders[way], outside)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peaks[way] = int(t)
    states = {way: builders[way]() for way in WAYS}
    losses: dict[str, list[float]] = {way: [] for way in WAYS}
    times = in_turns(
        {way: lambda way=way: losses[way].append(train_step(*states[way])) for way in WAYS},
        rounds,
        WARMUP,
    )
    if max(abs(a - b) for a, b in zip(losses["ep"], losses["dp"], strict=True)) > 1e-4:
        raise AssertionError(f"ep and dp trained apart: {losses['ep'][-1]} {losses['dp'][-1]}")
    exchange = _exchange_seconds(states["ep"], 8)
    t = torch.tensor([exchange], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    held = states["ep"][0].local_tensors()["layers.0.feed_forward.experts.gate_up_proj"]
    return {
        "ms": {way: statistics.median(times[way]) * 1e3 for way in WAYS},
        "paired": {
            "ep/dp": paired_ratio(times["ep"], times["dp"]),
            "ep/ddp": paired_ratio(times["ep"], times["ddp"]),
        },
        "peak": peaks,
        "exchange_ms": float(t) * 1e3,
        "experts_per_rank": int(held.shape[0]),
    }


def _predicted_exchange_ms() -> float:
    """The cost model's seconds of the experts' exchanges in a step of the ep plan (forward and
    backward), for this machine as ``autoshard calibrate`` measures it."""
    from autoshard.cost.calibrate import calibrate
    from autoshard.cost.collectives import exchange_times
    from autoshard.graph import capture
    from autoshard.mesh import mesh_info
    from autoshard.search.semi import plan_graph

    spec = calibrate(ranks=2, threads=1)
    model, batch = _model()
    og = capture(model, batch)
    plan = plan_graph(og, mesh_info({"ep": 2}))
    total = 0.0
    for node in og.graph.nodes:
        if node.target is torch.ops.autoshard.experts.default:
            fwd, bwd = exchange_times(node, plan.nodes[node.name].strategy, spec)
            total += fwd + bwd
    return total * 1e3


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    rounds = 3 if quick else ROUNDS
    result = run_ranks(_rank, 2, rounds, timeout=1800)[0]
    result["predicted_exchange_ms"] = _predicted_exchange_ms()
    return {"rounds": rounds, **result}


def summary(result: dict) -> str:
    ms, peak, paired = result["ms"], result["peak"], result["paired"]
    lines = [
        "autoshard's MoE reference model (2 layers, hidden 256, 8 experts of ffn 512, top 2, seq "
        f"64, vocab 512, global batch {BATCH}, float32, AdamW) on 2 CPU ranks of 1 thread "
        "(gloo), three ways taking turns, one step each a round, the order turning around "
        f"every round, {result['rounds']} rounds, the slowest rank's time: expert parallel "
        "(`parallelize(model, batch, {'ep': 2})`, "
        f"{result['experts_per_rank']} experts a rank), autoshard's data parallel (`{{'dp': "
        "2}`, every expert on every rank) and `DistributedDataParallel(model)` (the eager "
        "model replicated). Ratio: the median over rounds of the two ways' ratio, with its "
        "95% interval; peak: the most tensor storage alive on a rank during a step "
        "(`LiveBytes`), the state held between steps included.",
        "",
        "| way | ms (median) | peak MiB per rank |",
        "|---|---:|---:|",
    ]
    for way in WAYS:
        lines.append(f"| {way} | {ms[way]:.1f} | {peak[way] / 2**20:.2f} |")
    lines += [
        "",
        "| ratio | median | 95% interval | peak ratio |",
        "|---|---:|---:|---:|",
    ]
    for key, other in (("ep/dp", "dp"), ("ep/ddp", "ddp")):
        p = paired[key]
        lines.append(
            f"| {key} | {p['median']:.3f} | {p['low']:.3f}-{p['high']:.3f} | "
            f"{peak['ep'] / peak[other]:.2f} |"
        )
    lines += [
        "",
        f"The experts' all-to-alls (counts, rows out and back, forward and backward): "
        f"{result['exchange_ms']:.2f} ms a step measured (the slowest rank's median), "
        f"{result['predicted_exchange_ms']:.2f} ms predicted by the cost model "
        "(`cost.exchange_times` of the ep plan for this machine as `autoshard calibrate` "
        f"measures it), {result['exchange_ms'] / ms['ep']:.1%} of the ep step.",
    ]
    return "\n".join(lines)
