"""Multi-copy parallelism: the same plan with and without copies, in the same run.

Two plans whose steps communicate much, each run two ways taking turns, one step each a
round, the order turning around every round: ``parallelize(..., copies=1)`` and
``parallelize(..., copies=2)`` of the same model, batch and plan. Megatron tensor parallelism
on the Llama reference model (hidden 256, 2 layers, 8 heads, 4 kv heads, ffn 512, seq 64,
vocab 512, batch 8, float32, AdamW) on 2 and 4 CPU ranks of 1 thread (gloo), and expert
parallelism on the MoE reference model (2 layers, hidden 256, 8 experts of ffn 512, top 2,
seq 64, batch 16) on 2 ranks. A step is forward, backward and the optimizer step, the
slowest rank's time after a barrier; the ratio is the median over rounds of the copies
step over the plain one of the same round, with its 95% interval (bootstrap over rounds).
The communication share: the seconds a rank's step spends waiting in collectives without
copies (every wait of the counting layer timed) over the step.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Any

import torch

from bench.timing import adamw, in_turns, paired_ratio, train_step

NAME = "copies"

ROUNDS, WARMUP = 20, 3
_COL = ((None, None, None), ("tp", None))
_ROW = ((None, None, "tp"), (None, "tp"))
MEGATRON = {
    "layers.*.attention.w[qkv]": _COL,
    "layers.*.attention.wo": _ROW,
    "layers.*.feed_forward.w[13]": _COL,
    "layers.*.feed_forward.w2": _ROW,
}
CASES = {
    "tp": ("llama", 8, {"vocab": 512, "seq": 64, "layers": 2, "heads": 8, "kv_heads": 4,
                        "hidden": 256, "ffn": 512}),
    "ep": ("moe", 16, {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 512,
                       "experts": 8, "top_k": 2, "vocab": 512, "seq": 64}),
}  # fmt: skip


def _model(case: str) -> tuple[torch.nn.Module, tuple]:
    from autoshard.models import build, reference_config

    name, batch, sizes = CASES[case]
    torch.manual_seed(0)
    config = reference_config(name, **sizes)
    return build(config), config.example_batch(batch, torch.Generator().manual_seed(1))


def _waiting_share(state: tuple, steps: int) -> float:
    """The share of a plain step this rank spends inside the collectives' waits."""
    from autoshard import watch

    spent = [0.0]
    waiting = watch.waiting

    class _Timed:
        def __init__(self, what: Any) -> None:
            self.inner = waiting(what)

        def __enter__(self) -> None:
            self.start = time.perf_counter()
            self.inner.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)
            spent[0] += time.perf_counter() - self.start

    watch.waiting = _Timed
    try:
        began = time.perf_counter()
        for _ in range(steps):
            train_step(*state)
        total = time.perf_counter() - began
    finally:
        watch.waiting = waiting
    return spent[0] / total


def _rank(case: str, rounds: int) -> dict:
    import torch.distributed as dist

    from autoshard import parallelize, shard_inputs

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    model, batch = _model(case)
    mesh, strategies = ({"tp": world}, MEGATRON) if case == "tp" else ({"ep": world}, None)
    states = {}
    for k in (1, 2):
        pm = parallelize(copy.deepcopy(model), batch, mesh, strategies, copies=k)
        states[k] = (pm, adamw(pm), shard_inputs(batch, pm))
    losses: dict[int, list[float]] = {1: [], 2: []}
    times = in_turns(
        {str(k): lambda k=k: losses[k].append(train_step(*states[k])) for k in states},
        rounds,
        WARMUP,
    )
    gap = max(abs(a - b) for a, b in zip(losses[1], losses[2], strict=True))
    # a MoE's balance loss is each copy's own (docs/parallelism/copies.md): close, not equal
    if gap > (1e-4 if case == "tp" else 1e-2):
        raise AssertionError(f"{case}: copies trained apart from the plain plan by {gap}")
    share = torch.tensor([_waiting_share(states[1], 4)], dtype=torch.float64)
    dist.all_reduce(share, op=dist.ReduceOp.MAX)
    return {
        "case": case,
        "ranks": world,
        "ms": {k: statistics.median(times[k]) * 1e3 for k in times},
        "paired": paired_ratio(times["2"], times["1"]),
        "communication_share": float(share),
        "loss_gap": gap,
    }


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    rounds = 5 if quick else ROUNDS
    plans = [("tp", 2), ("ep", 2)] if quick else [("tp", 2), ("tp", 4), ("ep", 2)]
    rows = [run_ranks(_rank, n, case, rounds, timeout=1200)[0] for case, n in plans]
    return {"rounds": rounds, "rows": rows}


def summary(result: dict) -> str:
    lines = [
        "The same plan with and without copies (`parallelize(..., copies=2)` against "
        "`copies=1`), taking turns one step each a round, the order turning around every "
        f"round, {result['rounds']} rounds, CPU ranks of 1 thread (gloo), times of the slowest "
        "rank. tp: Megatron's split of the Llama reference model (hidden 256, 2 layers, seq 64, "
        "batch 8); ep: the MoE reference model's experts over ep (8 experts of ffn 512, top 2, "
        "batch 16). Ratio: the median over rounds of the copies step / the plain step, with "
        "its 95% interval. Waiting: the share of a plain step a rank spends in collectives' "
        "waits.",
        "",
        "| plan | ranks | plain ms | 2 copies ms | ratio | 95% interval | waiting | loss gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        p = r["paired"]
        lines.append(
            f"| {r['case']} | {r['ranks']} | {r['ms']['1']:.1f} | {r['ms']['2']:.1f} | "
            f"{p['median']:.3f} | {p['low']:.3f}-{p['high']:.3f} | "
            f"{r['communication_share']:.0%} | {r['loss_gap']:.1e} |"
        )
    return "\n".join(lines)
