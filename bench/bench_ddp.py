"""autoshard data parallel against torch's DistributedDataParallel, in the same run.

Each rank trains the GPT and Llama reference models (hidden 256, 2 layers, 8 heads, seq 64,
global batch 8, AdamW, float32) both ways, one step of each a round, the order turning around
every round (``bench.timing.in_turns``): ``parallelize(model, batch, {"dp": N})`` and
``DDP(model)`` as torch's docs set it up (default 25 MiB buckets, one process per rank, each
rank its slice of the batch, the loss averaged over it). A step is forward, backward and the
optimizer step; its time is the slowest rank's after a barrier. The ratio is the median over
rounds of the two steps' ratio in each round, with a bootstrap interval.
Bytes are sent per rank by the ring formulas (``comm.collective_bytes``): counted by
autoshard's counting layer, computed for DDP from its gradient bytes (one all-reduce of all).
"""

from __future__ import annotations

import statistics
import warnings

import torch

from bench.timing import in_turns, paired_ratio

NAME = "ddp"

STEPS, WARMUP = 60, 3
BATCH = 8


def _model(name: str):
    from autoshard.models import build, reference_config

    sizes = {"vocab": 512, "seq": 64, "layers": 2, "heads": 8, "hidden": 256}
    if name == "llama":
        sizes |= {"kv_heads": 4, "ffn": 512}
    torch.manual_seed(0)
    config = reference_config(name, **sizes)
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


def _spread(times: list[float]) -> list[float]:
    """The 10th and 90th percentiles of ``times``, in ms."""
    deciles = statistics.quantiles(times, n=10)
    return [deciles[0] * 1e3, deciles[-1] * 1e3]


def _rank(steps: int) -> list[dict]:
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoshard import comm, parallelize, shard_inputs

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for name in ("gpt", "llama"):
        model, batch = _model(name)
        ddp = DDP(copy.deepcopy(model))
        pm = parallelize(model, batch, {"dp": world})
        local = shard_inputs(batch, pm)
        mine = tuple(t.chunk(world)[rank] for t in batch)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def ours(pm=pm, local=local, opt=opt) -> None:
            pm(*local).backward()
            opt.step()
            opt.zero_grad()

        def theirs(ddp=ddp, mine=mine, opt_ddp=opt_ddp) -> None:
            ddp(*mine).backward()
            opt_ddp.step()
            opt_ddp.zero_grad()

        times = in_turns({"autoshard": ours, "ddp": theirs}, steps, WARMUP)
        with comm.counting() as counted:
            ours()
        grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
        rows.append(
            {
                "model": name,
                "ranks": world,
                "autoshard_ms": statistics.median(times["autoshard"]) * 1e3,
                "ddp_ms": statistics.median(times["ddp"]) * 1e3,
                "autoshard_spread_ms": _spread(times["autoshard"]),
                "ddp_spread_ms": _spread(times["ddp"]),
                "paired": paired_ratio(times["autoshard"], times["ddp"]),
                "autoshard_bytes": sum(c["bytes"] for c in counted.values()),
                "autoshard_calls": sum(c["calls"] for c in counted.values()),
                "ddp_bytes": comm.collective_bytes("all_reduce", world, grad_bytes),
            }
        )
    return rows


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    steps = 5 if quick else STEPS
    rows = []
    for world in (2, 4):
        rows += run_ranks(_rank, world, steps, timeout=900)[0]
    for r in rows:
        r["ratio"] = r["paired"]["median"]
    return {"steps": steps, "rows": rows}


def summary(result: dict) -> str:
    lines = [
        "GPT and Llama reference models (hidden 256, 2 layers, 8 heads, seq 64, global batch 8, "
        "float32, AdamW) on CPU ranks of 1 thread (gloo): autoshard's data parallel "
        "(`parallelize(model, batch, {'dp': N})`, 25 MiB buckets overlapping backward) against "
        "`DistributedDataParallel(model)` with torch's defaults, one step of each a round, the "
        f"order turning around every round; {result['steps']} rounds, times of the slowest "
        "rank. Ratio: the median over rounds of autoshard's step / DDP's step of the same round, "
        "with its 95% interval (bootstrap over rounds); below 1 autoshard is faster. "
        "p10-p90: the spread of each way's steps.",
        "",
        "| model | ranks | autoshard ms (p10-p90) | DDP ms (p10-p90) | ratio | 95% interval | "
        "autoshard B/rank | DDP B/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        a, d, p = r["autoshard_spread_ms"], r["ddp_spread_ms"], r["paired"]
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['autoshard_ms']:.1f} ({a[0]:.0f}-{a[1]:.0f}) | "
            f"{r['ddp_ms']:.1f} ({d[0]:.0f}-{d[1]:.0f}) | {p['median']:.3f} | "
            f"{p['low']:.3f}-{p['high']:.3f} | {r['autoshard_bytes'] / 2**20:.2f} MiB | "
            f"{r['ddp_bytes'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines)
