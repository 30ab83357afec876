"""``autoshard plan`` with pipeline stages (the pipeline flags given fixed, the others
searched): its table, and the plan without stages to compare with (``--pp auto``)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoshard.cli.args import offload_of
from autoshard.options import Options
from autoshard.plan_text import format_search, offload_lines
from autoshard.plan_text import human_bytes as size


@dataclasses.dataclass(frozen=True)
class PlanJob:
    """What ``autoshard plan`` plans: its flags, the cluster, the model (on meta) with its
    example batch and loss function, its block lists' real depth (fewer captured), the
    precision policy a run keeps, and when the command began."""

    args: Any
    spec: Any
    model: Any
    example: Any
    depth: Any
    loss_fn: Any
    policy: Any
    start: float

    def options(self) -> Options:
        """The options the flags give (``--pp auto`` fixes no degree; ``--offload auto``
        leaves the offload to the search)."""
        named = ("search", "tp", "cp", "tp_across_nodes", "attention", "sequence_parallel")
        named += ("zero", "microbatches", "schedule", "virtual_stages", "recompute")
        args, offload = self.args, offload_of(self.args)
        return Options(
            precision=self.policy,
            pp=args.pp if isinstance(args.pp, int) else None,
            copies=args.copies if isinstance(args.copies, int) else 1,
            offload=None if offload == "auto" else offload,
            **{name: getattr(args, name) for name in named},
        )

    def show(self, data: dict, captured_s: float, table: Callable[[], list[str]]) -> None:
        """The plan's JSON with the command's times: to the ``--json`` file, or alone on
        stdout for ``-``; else the lines of its ``table`` are printed."""
        data["predicted"]["capture_s"] = captured_s
        data["predicted"]["end_to_end_s"] = time.perf_counter() - self.start
        if self.args.json:
            text = json.dumps(data, indent=1)
            if self.args.json == "-":
                print(text)
                return
            Path(self.args.json).write_text(text + "\n")
        print("\n".join(table()))


def pipeline_plan(job: PlanJob, baseline: Any = None) -> int:
    """The fastest pipeline configuration that fits (the flags given fixed). ``baseline``
    (``--pp auto``): the plan without stages, (its step, a function that shows it), shown
    instead where it is faster or no pipeline fits."""
    from autoshard.cli.user_fn import global_rows
    from autoshard.graph import BlocksDiffer
    from autoshard.search import PlanningError
    from autoshard.search.pipelined import search_pipeline
    from autoshard.search.plans import staged_json

    opts, spec = job.options(), job.spec
    batch = global_rows(job.example, opts.microbatches)
    micro, captured_s = _micro_graphs(job, opts)
    searched = opts if offload_of(job.args) else opts.replace(offload={})  # left out: none
    try:
        best, tried, search_s = search_pipeline(
            micro, batch, spec.num_devices, spec, searched, job.depth
        )
    except BlocksDiffer:
        raise  # the caller captures every block
    except (PlanningError, ValueError) as err:
        if baseline is not None:
            print(f"with pipeline stages: {err}; the plan without them:", file=sys.stderr)
            return baseline[1]()
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 3
    step = best.predicted.step_time
    if baseline is not None and baseline[0] <= step:
        print(
            f"without pipeline stages {baseline[0] * 1e3:.1f} ms a step, with them (the best "
            f"of {len(tried)} priced) {step * 1e3:.1f} ms: the plan without them",
            file=sys.stderr,
        )
        return baseline[1]()
    data = staged_json(best, tried, search_s, opts)
    if baseline is not None:
        data["pipeline"]["without_stages_step_s"] = baseline[0]
    shown = (data, best.result, best.stage)
    job.show(data, captured_s[0], lambda: [*pipeline_lines(data, spec), format_search(*shown)])
    return 0


def _micro_graphs(job: PlanJob, opts: Options) -> tuple[Any, list]:
    """The model's graph for one of ``m`` micro-batches, as a function of ``m``, each checked
    against the depth it is priced at, and the seconds spent making them (a one-item list,
    added to as they are made)."""
    from autoshard.graph import check_depth
    from autoshard.graph.batches import micro_batch_graphs

    made = micro_batch_graphs(
        job.model,
        job.example,
        loss_fn=job.loss_fn,
        dtype=opts.policy.compute,
        searched=not opts.microbatches,
    )
    captured_s = [0.0]

    def micro(m: int) -> Any:
        began = time.perf_counter()
        graph = made(m)
        check_depth(graph, job.depth)
        captured_s[0] += time.perf_counter() - began
        return graph

    return micro, captured_s


def pipeline_lines(data: dict, spec: Any) -> list[str]:
    """The pipeline's headline, each pipeline rank's stages, times and memory, and the
    configurations the search priced."""
    from autoshard.schedule import looped, v_shape

    pipe = data["pipeline"]
    mesh = " x ".join(f"{k}({v})" for k, v in data["mesh"].items())
    lines = [
        f"pipeline: pp({pipe['pp']}) x {mesh} on {spec.num_devices} devices, "
        f"{pipe['schedule']}"
        + (f" ({pipe['virtual_stages']} stages a rank)" if pipe["virtual_stages"] > 1 else "")
        + f", {pipe['microbatches']} micro-batches, recompute {pipe['recompute']}"
        + f", ZeRO {pipe.get('zero', 0)}",
        f"predicted step {pipe['step_time_s'] * 1e3:.2f} ms, MFU {pipe['mfu'] * 100:.1f}%, "
        f"bubble {pipe['bubble'] * 100:.1f}%, peak memory {size(pipe['peak_memory_bytes'])} per "
        f"device (of {size(spec.memory_bytes)}); a stage sends {size(pipe['boundary_bytes'])} "
        "per micro-batch",
    ]
    if "without_stages_step_s" in pipe:
        lines.append(f"without stages: {pipe['without_stages_step_s'] * 1e3:.1f} ms")
    lines.append(
        "pipeline rank  stages  forward ms  backward ms  parameters  gradients  optimizer  "
        "activations"
    )
    # the stages' placement alone (making the schedule took seconds at 64 x 512)
    zbv = pipe["schedule"] == "zbv"
    placement = v_shape(pipe["pp"]) if zbv else looped(pipe["pp"], pipe["virtual_stages"])
    for r, mem in enumerate(pipe["memory_bytes"]):
        stages = [s for s, rank in enumerate(placement) if rank == r]
        fwd = sum(pipe["stage_seconds"][s][0] for s in stages) * 1e3
        bwd = sum(pipe["stage_seconds"][s][1] for s in stages) * 1e3
        lines.append(
            f"{r:>13}  {','.join(map(str, stages)):>6}  {fwd:>10.2f}  {bwd:>11.2f}  "
            + "  ".join(
                f"{size(mem[k]):>10}"
                for k in ("parameters", "gradients", "optimizer", "activations")
            )
        )
    return lines + offload_lines(data, data["predicted"]) + tried_lines(pipe)


def tried_lines(pipe: dict, shown: int = 8) -> list[str]:
    """The fastest configurations the search priced (those that fit first), with the
    search's time."""
    tried = pipe.get("tried", [])
    if len(tried) < 2:
        return []
    searched = ", ".join(pipe.get("searched", [])) or "nothing"
    lines = [
        f"pipeline search ({searched} searched): {len(tried)} configurations priced in "
        f"{pipe.get('search_s', 0.0):.2f} s; the fastest:"
    ]
    chosen = ("pp", "microbatches", "schedule", "virtual_stages", "recompute", "zero")
    ranked = sorted(tried, key=lambda t: (not t["fits"], t["step_s"]))
    for t in ranked[:shown]:
        v = f" v{t['virtual_stages']}" if t["virtual_stages"] > 1 else ""
        mark = "*" if all(t.get(k) == pipe.get(k) for k in chosen) else " "
        lines.append(
            f"{mark} pp {t['pp']:>3}  m {t['microbatches']:>4}  {t['schedule'] + v:<19} "
            f"recompute {t['recompute']:<9}  ZeRO {t.get('zero', 0)}  "
            f"{t['step_s'] * 1e3:>9.1f} ms  "
            f"{size(t['peak_bytes']):>10}{'' if t['fits'] else '  does not fit'}"
        )
    return lines


__all__ = ["PlanJob", "pipeline_lines", "pipeline_plan", "tried_lines"]
