"""autoshard's pipeline against torch.distributed.pipelining, in the same run.

The Llama reference model (4 layers, hidden 512, 8 heads, 4 kv heads, ffn 1024, seq 64,
vocab 128, so the two stages' work is within a few percent; global batch 16, float32, AdamW)
on 2 CPU ranks of 1 thread (gloo), cut the same way both ways:
``parallelize(model, batch, {"pp": 2}, schedule=..., microbatches=4, stages=[...])`` against
``PipelineStage`` modules holding the same layers, run by torch's schedule of the same
name (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` with 2 stages a rank,
``ScheduleInterleavedZeroBubble`` with one stage a rank: ZB-H1).
A step is forward, backward and the optimizer step, one of each way a round, the order turning
around every round; the ratio is the median over rounds of the two steps' ratio in each round,
with a bootstrap interval.

Then autoshard's recorded timeline (``pm.recording``): the measured bubble (the share of the
ranks' time, from the first compute to the last, that no compute runs) beside
(p-1)/(m+p-1), and the simulator's step from the measured median time of each action beside
the measured step; and the first rank's peak tensor bytes under each recompute mode.
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any

import torch

from bench.timing import in_turns, paired_ratio

NAME = "pipeline"

ROUNDS, WARMUP = 30, 3
BATCH, MICRO = 16, 4
CUTS = {1: ["layers.2"], 2: ["layers.1", "layers.2", "layers.3"]}  # stages a rank -> cuts
SCHEDULES = (("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
             ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
             ("zb-h1", "ScheduleInterleavedZeroBubble", 1))  # fmt: skip
#: torch's schedules that take a list of stages (one a rank is ZB-H1 for the zero-bubble one)
MULTI = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
HIDDEN, FFN = 512, 1024


def _model():
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("llama", vocab=128, seq=64, layers=4, heads=8, hidden=HIDDEN,
                              kv_heads=4, ffn=FFN)  # fmt: skip
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


class _Part(torch.nn.Module):
    """Layers ``lo:hi`` of the model, with the embedding first or the head last."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__()
        n = len(model.layers)
        self.emb = model.tok_embeddings if lo == 0 else None
        self.layers = torch.nn.ModuleList(model.layers[lo:hi])
        self.norm, self.output = (model.norm, model.output) if hi == n else (None, None)
        self.register_buffer("cos", model.rope_cos, persistent=False)
        self.register_buffer("sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        S = x.shape[1]
        for layer in self.layers:
            x = layer(x, self.cos[:S], self.sin[:S])
        return self.output(self.norm(x)) if self.output is not None else x


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    )


def _torch_side(model: Any, virtual: int, schedule: str, rank: int, world: int):
    import torch.distributed.pipelining as pipelining

    stages_total = world * virtual
    per = len(model.layers) // stages_total
    mine = [s for s in range(stages_total) if s % world == rank]
    stages = [
        pipelining.PipelineStage(
            _Part(model, s * per, (s + 1) * per), s, stages_total, torch.device("cpu")
        )  # fmt: skip
        for s in mine
    ]
    cls = getattr(pipelining, schedule)
    sched = cls(stages if schedule in MULTI else stages[0], MICRO, loss_fn=_loss)
    params = [p for s in stages for p in s.submod.parameters()]
    return sched, params


def _rank(rounds: int) -> list[dict]:
    import copy

    import torch.distributed as dist

    from autoshard import parallelize

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for name, torch_name, virtual in SCHEDULES:
        model, batch = _model()
        sched, theirs_params = _torch_side(copy.deepcopy(model), virtual, torch_name, rank, world)
        pm = parallelize(model, batch, {"pp": world}, schedule=name, microbatches=MICRO,
                         stages=CUTS[virtual], virtual_stages=virtual)  # fmt: skip
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        opt_t = torch.optim.AdamW(theirs_params, lr=1e-4)
        holds_last = rank == (world * virtual - 1) % world
        losses: list[torch.Tensor] = []

        def ours(pm=pm, opt=opt, batch=batch) -> None:
            pm(*batch).backward()
            opt.step()
            opt.zero_grad()

        def theirs(
            sched=sched, opt_t=opt_t, holds_last=holds_last, losses=losses, batch=batch
        ) -> None:
            losses.clear()
            args = (batch[0],) if rank == 0 else ()
            kwargs = {"target": batch[1], "losses": losses} if holds_last else {}
            sched.step(*args, **kwargs)
            opt_t.step()
            opt_t.zero_grad()

        first = float(pm(*batch))  # the same first loss both ways (before any step)
        theirs_first = None
        times = in_turns({"autoshard": ours, "torch": theirs}, rounds, WARMUP)
        if holds_last and losses:
            theirs_first = float(torch.stack(losses).mean())
        pm.recording = True
        timelines = []
        for _ in range(5):
            dist.barrier()
            ours()
            timelines.append(list(pm.timeline))
        pm.recording = False
        gathered = [None] * world
        dist.all_gather_object(gathered, timelines)
        pm.counting_saved = True  # a step of its own: the hooks slow the step they count
        dist.barrier()
        ours()
        pm.counting_saved = False
        kept = [None] * world
        dist.all_gather_object(kept, dict(pm.saved_bytes.peak))
        rows.append({
            "schedule": name, "torch_schedule": torch_name, "virtual": virtual,
            "autoshard_ms": statistics.median(times["autoshard"]) * 1e3,
            "torch_ms": statistics.median(times["torch"]) * 1e3,
            "paired": paired_ratio(times["autoshard"], times["torch"]),
            "first_loss": first, "torch_last_loss": theirs_first,
            "timelines": gathered,
            "kept_first_stage": kept[0].get(0, 0),
            "schedule_json": pm.schedule.to_json(),
        })  # fmt: skip
    for recompute in ("none", "selective", "full"):  # memory only: 1F1B's peak with recompute
        rows.append({"recompute": recompute, "peak_first_rank": _peak(recompute, world)})
    return rows


def _peak(recompute: str, world: int) -> int:
    """The first pipeline rank's most bytes of tensor storage above what it held before, over
    a 1F1B step (forward and backward; ``LiveBytes``: every storage an operator makes,
    recomputation's and ``torch.utils.checkpoint``'s included)."""
    import torch.distributed as dist

    from autoshard import parallelize
    from autoshard.testing import LiveBytes

    model, batch = _model()
    pm = parallelize(model, batch, {"pp": world}, schedule="1f1b", microbatches=MICRO,
                     stages=CUTS[1], recompute=recompute)  # fmt: skip
    pm(*batch).backward()  # a first step: gradients exist, as in every later step
    with LiveBytes() as live:
        live.ignore(*pm.parameters(), *(p.grad for p in pm.parameters() if p.grad is not None))
        live.ignore(*batch)
        pm(*batch).backward()
    peaks = [None] * world
    dist.all_gather_object(peaks, live.peak)
    return peaks[0]


def _measured(row: dict) -> dict:
    """Bubble and step from the recorded timelines, and the simulator's step from the
    measured median time of each compute action."""
    from autoshard.schedule import Schedule, parse_action, simulate

    schedule = Schedule.from_json(row["schedule_json"])
    p, m = schedule.num_ranks, schedule.microbatches
    bubbles, steps, durations = [], [], {}
    for step in range(len(row["timelines"][0])):
        compute = [
            (parse_action(a), s, e)
            for rank in row["timelines"]
            for a, s, e in rank[step]
            if parse_action(a).is_compute
        ]
        first, last = min(s for _, s, _ in compute), max(e for _, _, e in compute)
        busy = sum(e - s for _, s, e in compute)
        bubbles.append(1 - busy / (p * (last - first)))
        steps.append(last - first)
        for a, s, e in compute:
            durations.setdefault((a.kind, a.stage), []).append(e - s)
    median = {k: statistics.median(v) for k, v in durations.items()}
    simulated = simulate(schedule, lambda a: median.get((a.kind, a.stage), 0.0)).step
    measured_step = statistics.median(steps)
    return {
        "bubble": statistics.median(bubbles),
        "formula": (p - 1) / (m + p - 1),
        "step_ms": measured_step * 1e3,
        "simulated_ms": simulated * 1e3,
        "simulated_error": simulated / measured_step - 1,
    }


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    rounds = 3 if quick else ROUNDS
    rows = run_ranks(_rank, 2, rounds, timeout=1800)[0]
    for r in rows:
        if "paired" in r:
            r["ratio"] = r["paired"]["median"]
            r |= _measured(r)
            del r["timelines"]
    _predicted([r for r in rows if "paired" in r])
    return {"rounds": rounds, "rows": rows}


def _predicted(rows: list[dict]) -> None:
    """The planner's predicted step of each schedule (``autoshard.plan`` with the pipeline
    given, for this machine as ``autoshard calibrate`` measures it) beside the measured one."""
    import autoshard
    from autoshard.cost.calibrate import calibrate

    spec = calibrate(ranks=2, threads=1)
    for r in rows:
        model, batch = _model()
        plan = autoshard.plan(model, batch, spec, num_devices=2, pp=2, microbatches=MICRO,
                              schedule=r["schedule"], virtual_stages=r["virtual"],
                              recompute="none")  # fmt: skip
        r["predicted_ms"] = plan.json["pipeline"]["step_time_s"] * 1e3
        r["predicted_error"] = r["predicted_ms"] / r["autoshard_ms"] - 1


def summary(result: dict) -> str:
    lines = [
        f"Llama reference model (4 layers, hidden {HIDDEN}, 8 heads, 4 kv heads, ffn {FFN}, "
        "seq 64, vocab 128, "
        f"global batch {BATCH}, {MICRO} micro-batches, float32, AdamW) on 2 CPU ranks of 1 "
        "thread (gloo), the same stages both ways: autoshard `parallelize(model, batch, "
        "{'pp': 2}, schedule=..., stages=[...])` against torch.distributed.pipelining "
        "(`PipelineStage` per stage, torch's schedule of the same name), one step of each a "
        f"round, the order turning around every round, {result['rounds']} rounds, times of the "
        "slowest rank. Ratio: the median over rounds of autoshard's step / torch's, with its "
        "95% interval; below 1 autoshard is faster. Bubble: measured from autoshard's recorded "
        "timeline (the share of the two ranks' time from the first compute to the last with no "
        "compute running; median of 5 steps) beside (p-1)/(m+p-1) = 1/5 (GPipe's and 1F1B's "
        "at nominal costs; interleaved's and ZB-H1's are lower); simulated: "
        "`autoshard.schedule.simulate` of the same schedule from the measured median time of "
        "each action, beside the measured span.",
        "",
        "| schedule | stages a rank | autoshard ms | torch ms | ratio | 95% interval | "
        "bubble | (p-1)/(m+p-1) | span ms | simulated ms | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    timed = [r for r in result["rows"] if "paired" in r]
    for r in timed:
        p = r["paired"]
        lines.append(
            f"| {r['schedule']} (torch {r['torch_schedule']}) | {r['virtual']} | "
            f"{r['autoshard_ms']:.1f} | {r['torch_ms']:.1f} | {p['median']:.3f} | "
            f"{p['low']:.3f}-{p['high']:.3f} | {r['bubble']:.3f} | {r['formula']:.3f} | "
            f"{r['step_ms']:.1f} | {r['simulated_ms']:.1f} | {r['simulated_error']:+.0%} |"
        )
    lines += [
        "",
        "The planner's prediction (`autoshard.plan(model, batch, spec, num_devices=2, pp=2, "
        "microbatches=4, schedule=...)` for this machine as `autoshard calibrate` measures it) "
        "beside autoshard's measured step (forward, backward and the optimizer step):",
        "",
        "| schedule | measured ms | predicted ms | error |",
        "|---|---:|---:|---:|",
    ]
    for r in timed:
        if "predicted_ms" in r:
            lines.append(
                f"| {r['schedule']} | {r['autoshard_ms']:.1f} | {r['predicted_ms']:.1f} | "
                f"{r['predicted_error']:+.0%} |"
            )
    lines += [
        "",
        "Kept for backward on the first stage (the most bytes of the tensors autograd saved, "
        "recorded with saved-tensor hooks in one step): GPipe holds all "
        f"{MICRO} micro-batches, 1F1B p = 2 of them.",
        "",
        "| schedule | first stage kept MiB | of 1F1B's |",
        "|---|---:|---:|",
    ]
    base = next((r["kept_first_stage"] for r in timed if r["schedule"] == "1f1b"), 0)
    for r in timed:
        kept = r.get("kept_first_stage", 0)
        share = f"{kept / base:.2f}" if base else "n/a"
        lines.append(f"| {r['schedule']} | {kept / 2**20:.2f} | {share} |")
    peaks = [r for r in result["rows"] if "peak_first_rank" in r]
    lines += [
        "",
        "Recompute under 1F1B: the first rank's most bytes of tensor storage above what it held "
        "before a step (`autoshard.testing.LiveBytes`, every storage an operator makes, "
        "recomputation's included; the step's second call, gradients already allocated).",
        "",
        "| recompute | first rank peak MiB | of none's |",
        "|---|---:|---:|",
    ]
    none = next((r["peak_first_rank"] for r in peaks if r["recompute"] == "none"), 0)
    for r in peaks:
        share = f"{r['peak_first_rank'] / none:.2f}" if none else "n/a"
        lines.append(f"| {r['recompute']} | {r['peak_first_rank'] / 2**20:.2f} | {share} |")
    return "\n".join(lines)
