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
copies (every wait of the counting layer timed) over the step. The exposed communication,
each collective's wait as the last of its ranks to reach it waits (an earlier rank's longer
wait is its peers' compute), with and without copies, is set against the cost model's for
the plan each run made, on this machine as ``autoshard calibrate`` measures it (the
calibration runs first), and each way's CPU seconds (every rank's process) against the cores
the step had: gloo's collectives are CPU work on the cores the ranks compute on, which
bounds what copies hide.
"""

from __future__ import annotations

import copy
import os
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


def _waiting(state: tuple, steps: int) -> tuple[dict, float, float]:
    """The seconds a step of ``state`` spends inside each collective's wait on this rank (the
    counting layer's waits, every one timed: the recorded timeline's), by what the watchdog
    knows it by (kind, group, number on the group), the step's, and the CPU seconds this
    rank's process (its compute and gloo's threads) used in it."""
    from autoshard import watch

    spent: dict[tuple, float] = {}
    waiting = watch.waiting

    class _Timed:
        def __init__(self, what: Any) -> None:
            self.what, self.inner = what, waiting(what)

        def __enter__(self) -> None:
            self.start = time.perf_counter()
            self.inner.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)
            seconds = (time.perf_counter() - self.start) / steps
            spent[self.what] = spent.get(self.what, 0.0) + seconds

    watch.waiting = _Timed
    try:
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            train_step(*state)
        total, cpu = time.perf_counter() - began, time.process_time() - cpu
    finally:
        watch.waiting = waiting
    return spent, total / steps, cpu / steps


def _exposed(spent: dict[tuple, float]) -> tuple[float, float]:
    """This rank's waits in a step: all of them, and each collective's wait as the last of
    its group's ranks to reach it waits (the least of the members' waits). A rank that
    arrives earlier waits besides for its peers' compute (their extra rows of experts, the
    host's scheduler): rank skew, which the cost model prices as compute (``sync_wait``),
    not as the collective's time."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, spent)
    last = sum(min(w.get(what, seconds) for w in everyone) for what, seconds in spent.items())
    return sum(spent.values()), last


def _predicted(pm: Any, spec: Any, copies: int) -> dict[str, float]:
    """The cost model's step and exposed communication of ``pm``'s plan (one copy's, as
    ``parallelize`` planned it) run as ``copies`` copies on ``spec``."""
    from autoshard.cost.copies import with_copies
    from autoshard.cost.estimate import estimate

    est = estimate(pm.plan, pm.captured[True], spec)
    est = with_copies(est, pm.plan, pm.captured[True], copies)
    return {"step_s": est.step_time, "exposed_comm_s": est.exposed_comm}


def _rank(case: str, rounds: int, spec: Any) -> dict:
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
    waits = {}
    for k in states:  # the slowest rank's waits and step, every rank's CPU, each way
        spent, step, cpu = _waiting(states[k], 4)
        measured = torch.tensor([*_exposed(spent), step], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        used = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(used)
        waits[str(k)] = {
            "waits_s": float(measured[0]),
            "exposed_comm_s": float(measured[1]),
            "step_s": float(measured[2]),
            "cpu_s": float(used[0]),
        }
    return {
        "case": case,
        "ranks": world,
        "ms": {k: statistics.median(times[k]) * 1e3 for k in times},
        "paired": paired_ratio(times["2"], times["1"]),
        "communication_share": waits["1"]["waits_s"] / waits["1"]["step_s"],
        "measured": waits,
        "predicted": {str(k): _predicted(states[k][0], spec, k) for k in states},
        "overlap_efficiency": spec.overlap_efficiency,
        "load_average": os.getloadavg()[0],
        "cores": len(os.sched_getaffinity(0)),
        "loss_gap": gap,
    }


def run(quick: bool) -> dict:
    from autoshard.cost.calibrate import calibrate
    from autoshard.testing import run_ranks

    rounds = 5 if quick else ROUNDS
    plans = [("tp", 2), ("ep", 2)] if quick else [("tp", 2), ("tp", 4), ("ep", 2)]
    specs = {n: calibrate(ranks=n, threads=1) for n in sorted({n for _, n in plans})}
    rows = [run_ranks(_rank, n, case, rounds, specs[n], timeout=1200)[0] for case, n in plans]
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
    return "\n".join(lines + [""] + _exposed_rows(result))


def _exposed_rows(result: dict) -> list[str]:
    """The exposed communication measured against the cost model's, each plan and way."""
    lines = [
        "Exposed communication: measured, the seconds a step of the slowest rank spends in the "
        "collectives' waits (4 steps of each way, every wait of the counting layer timed), "
        "each collective counted as the last of its ranks to reach it waits (the least wait "
        "of its members: what an earlier rank waits longer is its peers' compute, rank skew, "
        "which the cost model prices as compute); beside it every wait of the slowest rank, "
        "skew included. Predicted, `cost.estimate` of the plan the run made (one copy's "
        "graph, `cost.copies.with_copies` for 2 copies) on this machine as `autoshard "
        "calibrate` measures it (its `overlap_efficiency` in the last column).",
        "",
        "| plan | ranks | copies | exposed ms measured | all waits ms | predicted | error "
        "| step ms measured | predicted | CPU ms, all ranks | overlap_efficiency |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        for k in ("1", "2"):
            got, want = r["measured"][k], r["predicted"][k]
            error = want["exposed_comm_s"] / got["exposed_comm_s"] - 1
            lines.append(
                f"| {r['case']} | {r['ranks']} | {k} | {got['exposed_comm_s'] * 1e3:.1f} | "
                f"{got.get('waits_s', got['exposed_comm_s']) * 1e3:.1f} | "
                f"{want['exposed_comm_s'] * 1e3:.1f} | {error:+.0%} | "
                f"{got['step_s'] * 1e3:.1f} | {want['step_s'] * 1e3:.1f} | "
                f"{got['cpu_s'] * 1e3:.1f} | {r['overlap_efficiency']:.2f} |"
            )
    return lines + ["", _why(result)]


def _why(result: dict) -> str:
    """What bounds copies on this host, from the run's own numbers: the CPU work a step of
    every rank needs against what the cores give it, and the other processes' load."""
    parts = []
    for r in result["rows"]:
        one, two = r["measured"]["1"], r["measured"]["2"]
        parts.append(
            f"{r['case']} {r['ranks']}: {one['cpu_s'] / (r['cores'] * one['step_s']):.0%} busy, "
            f"copies {two['cpu_s'] / one['cpu_s']:.2f}x its CPU, load {r['load_average']:.1f}"
        )
    return (
        "Why copies do not pay here: a gloo collective over loopback is CPU work (its thread "
        "copies and sums on the cores the ranks compute on), so communication hides behind "
        "compute only where a core would otherwise idle. Each row's share of the cores the "
        "plain step's ranks keep busy (every rank's CPU seconds over the cores times the "
        "step), what 2 copies cost in CPU against it (a second round of op dispatches, "
        "collectives and their latencies) and the host's load average (other processes) "
        f"during the run: {'; '.join(parts)}. `bench/copies_bound.py` measures the same bound "
        "on k chunks of a product and its all-reduce (all-gather, reduce-scatter) interleaved "
        "against one chunk."
    )
