"""autoshard's ZeRO against FSDP2 and DDP, in the same run.

Each rank trains the GPT and Llama reference models (hidden 256, 2, 4 and 8 layers, 8 heads, seq 64,
global batch 8, AdamW, float32) five ways, alternating one step of each: ``parallelize(model,
batch, {"dp": N}, zero=k)`` for k = 1, 2, 3; FSDP2 as its docs set it up (``fully_shard`` on
every block, then on the model, over the same ranks, ``reshard_after_forward`` left at its
default); ``DistributedDataParallel(model)`` with torch's defaults. Each rank gets its slice of
the batch. A step is forward, backward and the optimizer step; its time is the slowest rank's
after a barrier. The ways take turns, one step each a round, in an order that turns around
every round; a ratio is the median over rounds of that round's ratio, with its 95% interval
(``bench/timing.py``). Peak memory per rank: the most tensor storage alive during a step after two
warm-up steps (the most of three; :class:`bench.memory.LiveBytes`, the same count for every
library), the state held between steps included. Bytes sent per rank: autoshard's counting layer.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bench.memory import step_peak
from bench.timing import adamw, in_turns, paired_ratio, timed, train_step

NAME = "zero"

STEPS, WARMUP = 20, 3
BATCH = 8
WAYS = ("zero1", "zero2", "zero3", "fsdp2", "ddp")


def _model(name: str, layers: int):
    from autoshard.models import build, reference_config

    sizes = {"vocab": 512, "seq": 64, "layers": layers, "heads": 8, "hidden": 256}
    if name == "llama":
        sizes |= {"kv_heads": 4, "ffn": 512}
    torch.manual_seed(0)
    config = reference_config(name, **sizes)
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


def _builders(model: torch.nn.Module, batch: tuple) -> dict[str, Callable[[], tuple]]:
    """Each way's (module, optimizer, this rank's inputs), built from a copy of ``model``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoshard import parallelize, shard_inputs

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = tuple(t.chunk(world)[rank] for t in batch)

    def ours(stage: int) -> Callable[[], tuple]:
        def build() -> tuple:
            pm = parallelize(model, batch, {"dp": world}, zero=stage)
            return pm, adamw(pm), shard_inputs(batch, pm)

        return build

    def fsdp2() -> tuple:
        m = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (world,))
        for block in m.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, adamw(m), mine

    def ddp() -> tuple:
        m = DDP(copy.deepcopy(model))
        return m, adamw(m), mine

    return {"zero1": ours(1), "zero2": ours(2), "zero3": ours(3), "fsdp2": fsdp2, "ddp": ddp}


def _max_over_ranks(n: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _rank(steps: int, depths: tuple[int, ...]) -> list[dict]:
    import torch.distributed as dist

    from autoshard import comm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for name, layers in ((name, n) for n in depths for name in ("gpt", "llama")):
        model, batch = _model(name, layers)
        builders = _builders(model, batch)
        outside = [*model.parameters(), *model.buffers(), *batch]
        peaks = {way: _max_over_ranks(step_peak(builders[way], outside)) for way in WAYS}
        states = {way: builders[way]() for way in WAYS}
        losses: dict[str, list[float]] = {way: [] for way in WAYS}

        def one(way: str, states: dict = states, losses: dict = losses) -> None:
            losses[way].append(train_step(*states[way]))

        times = in_turns({way: lambda way=way: one(way) for way in WAYS}, steps, WARMUP)
        sent: dict[str, int] = {}
        for way in ("zero1", "zero2", "zero3"):
            if way not in states:
                continue
            with comm.counting() as counted:
                train_step(*states[way])
            sent[way] = sum(c["bytes"] for c in counted.values())
        _check_losses(name, losses)
        collectives = _collectives(sum(p.numel() for p in model.parameters()))
        rows.append(
            {
                "model": name,
                "layers": layers,
                "ranks": dist.get_world_size(),
                "params": sum(p.numel() for p in model.parameters()),
                "ms": {way: statistics.median(times[way]) * 1e3 for way in WAYS},
                "rounds_ms": {way: [t * 1e3 for t in times[way]] for way in WAYS},
                "peak": peaks,
                "sent": sent,
                "collectives_ms": collectives,
            }
        )
    return rows


def _collectives(numel: int) -> dict[str, float]:
    """Milliseconds of one all-reduce, reduce-scatter and all-gather of ``numel`` float32 over
    every rank (the gradient sum of DDP, and the two halves ZeRO splits it into)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    numel -= numel % world
    full, part = torch.ones(numel), torch.empty(numel // world)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(12):
        for k, call in calls.items():
            timed(call, times[k], rep >= 2)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _check_losses(name: str, losses: dict[str, list[float]]) -> None:
    """Every way trains the same model on the same data: the same losses, step by step (FSDP2's
    and DDP's are of this rank's slice: their mean over ranks is the batch's)."""
    import torch.distributed as dist

    for way in ("fsdp2", "ddp"):
        if way not in losses:
            continue
        t = torch.tensor(losses[way], dtype=torch.float64)
        dist.all_reduce(t)
        losses[way] = (t / dist.get_world_size()).tolist()
    first = losses["ddp" if "ddp" in losses else next(iter(losses))]
    for way, mine in losses.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(mine, first, strict=True))
        if worst > 1e-4:
            raise AssertionError(f"{name}: {way}'s losses differ from DDP's by {worst:.1e}")


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    steps, depths = (3, (2,)) if quick else (STEPS, (2, 4, 8))
    rows = run_ranks(_rank, 4, steps, depths, timeout=3000)[0]
    for r in rows:
        rounds = r["rounds_ms"]
        r["time_ratio"] = {
            f"{a}/{b}": paired_ratio(rounds[a], rounds[b])
            for a, b in (("zero3", "fsdp2"), ("zero1", "ddp"), ("zero2", "ddp"))
        }
        r["peak_ratio"] = r["peak"]["zero3"] / r["peak"]["fsdp2"]
    return {"steps": steps, "rows": rows}


def _ratio(r: dict[str, float]) -> str:
    return f"{r['median']:.2f} [{r['low']:.2f}-{r['high']:.2f}]"


def summary(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        "GPT and Llama reference models (hidden 256, 8 heads, seq 64, "
        "global batch 8, float32, AdamW) on 4 CPU ranks of 1 thread (gloo), one data-parallel "
        "mesh dim: autoshard `parallelize(model, batch, {'dp': 4}, zero=k)` against FSDP2 "
        "(`fully_shard` per block, then the model) and `DistributedDataParallel(model)`, "
        "taking turns one step each, the order turned around every round; median of "
        f"{result['steps']} rounds of the slowest rank's step, and each ratio the median of "
        "the rounds' ratios with its 95% bootstrap interval. Peak: the most tensor storage "
        "alive on a rank during a step, the most of three (the state held between steps "
        "included; the largest over ranks), "
        "counted the same way for every library (`bench/memory.py`). Losses of all five ways "
        "agree step by step.",
        "",
        "| model | layers | ZeRO 1 ms | ZeRO 2 ms | ZeRO 3 ms | FSDP2 ms | DDP ms | "
        "ZeRO 3 / FSDP2 | ZeRO 1 / DDP | ZeRO 2 / DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ms, q = r["ms"], r["time_ratio"]
        lines.append(
            f"| {r['model']} | {r['layers']} | {ms['zero1']:.1f} | {ms['zero2']:.1f} | "
            f"{ms['zero3']:.1f} | {ms['fsdp2']:.1f} | {ms['ddp']:.1f} | "
            + " | ".join(_ratio(q[k]) for k in ("zero3/fsdp2", "zero1/ddp", "zero2/ddp"))
            + " |"
        )
    lines += [
        "",
        "| model | layers | parameters | ZeRO 1 peak | ZeRO 2 peak | ZeRO 3 peak | FSDP2 peak | "
        "DDP peak | ZeRO 3 / FSDP2 | ZeRO 1/2/3 MiB sent |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        p, s = r["peak"], r["sent"]
        sent = " / ".join(f"{s[w] / mib:.2f}" for w in ("zero1", "zero2", "zero3"))
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['params'] / 1e6:.2f} M | "
            + " | ".join(f"{p[w] / mib:.1f} MiB" for w in WAYS)
            + f" | {r['peak_ratio']:.2f} | {sent} |"
        )
    lines += [
        "",
        "Why ZeRO 1 and 2 trail DDP here: they replace DDP's all-reduce by a reduce-scatter and "
        "an all-gather, which move the same bytes as the all-reduce together (the MiB sent "
        "above), but gloo's reduce-scatter takes as long as a whole all-reduce, so on CPU the "
        "pair costs nearly twice DDP's one call. One call over all 4 ranks, of the model's "
        "parameters in float32, slowest rank's median:",
        "",
        "| model | layers | all-reduce ms | reduce-scatter ms | all-gather ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        c = r.get("collectives_ms")
        if c:
            lines.append(
                f"| {r['model']} | {r['layers']} | {c['all_reduce']:.1f} | "
                f"{c['reduce_scatter']:.1f} | {c['all_gather']:.1f} |"
            )
    return "\n".join(lines)
