"""``autoshard simulate``: a pipeline schedule played by the simulator, from a plan JSON
(``autoshard plan --pp ... --json plan.json``: the stages' predicted seconds) or from a named
schedule at nominal costs; beside a measured run's timeline when given (``pm.recording``:
each rank's ``pm.timeline`` in a JSON list, rank by rank)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autoshard.cost.pipeline import stage_costs
from autoshard.schedule import Schedule, Timeline, make_schedule, simulate, unit_cost, validate


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", nargs="?", help="a plan JSON with a pipeline (autoshard plan --pp)")
    p.add_argument("--schedule", default="1f1b", help="without a plan: the schedule (1f1b)")
    p.add_argument("--pp", type=int, default=4, help="without a plan: pipeline ranks (4)")
    p.add_argument("--microbatches", type=int, default=8, help="without a plan: micro-batches")
    p.add_argument("--virtual-stages", type=int, default=1, help="stages a rank (interleaved)")
    p.add_argument(
        "--measured",
        help="a measured step: JSON list per rank of [action, start s, end s] (pm.timeline)",
    )
    p.add_argument("--picture", metavar="FILE.png", help="draw the Gantt chart (matplotlib)")


def _from_plan(path: str) -> tuple[Schedule, Timeline, str, float]:
    data = json.loads(Path(path).read_text())
    pipe = data.get("pipeline")
    if pipe is None:
        raise ValueError(f"plan {path!r} has no pipeline (plan it with autoshard plan --pp N)")
    schedule = make_schedule(
        pipe["schedule"], pipe["pp"], pipe["microbatches"], pipe["virtual_stages"]
    )
    cost = stage_costs(pipe["stage_seconds"], pipe.get("stage_weight_seconds", []))
    hop = pipe.get("hop_s", 0.0)
    timeline = simulate(schedule, cost, lambda send: hop)
    return schedule, timeline, "predicted", pipe.get("after_schedule_s", 0.0)


def run(args: argparse.Namespace) -> int:
    after = 0.0  # what a plan's step adds after the schedule (``plan`` predicts the sum)
    if args.plan:
        schedule, timeline, title, after = _from_plan(args.plan)
    else:
        schedule = make_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        timeline, title = simulate(schedule, unit_cost), "nominal costs (F 1, B 2)"
    validate(schedule)
    step = f"{timeline.step:.1f} units"
    if args.plan:
        step = (
            f"{(timeline.step + after) * 1e3:.2f} ms (the schedule {timeline.step * 1e3:.2f} ms, "
            f"then gradient sums and optimizer step {after * 1e3:.2f} ms)"
        )
    print(schedule)
    print(
        f"{title}: step {step}, bubble {timeline.bubble * 100:.1f}%, micro-batches in flight "
        f"per stage {list(timeline.in_flight)}"
    )
    pictures = [(f"{schedule.name}: {title}", _events(timeline))]
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())
        print(f"measured: step {_span(measured) * 1e3:.2f} ms")
        pictures.append((f"{schedule.name}: measured", measured))
    if args.picture:
        from autoshard.pictures import gantt_picture

        unit = "ms" if args.plan or args.measured else "units"
        scale = 1e3 if unit == "ms" else 1.0
        print(f"picture: {gantt_picture(pictures, args.picture, scale, unit)}")
    return 0


def _events(timeline: Timeline) -> list[list[tuple[str, float, float]]]:
    return [[(str(e.action), e.start, e.end) for e in rank] for rank in timeline.events]


def _span(ranks: list) -> float:
    starts = [s for rank in ranks for _, s, _ in rank]
    ends = [e for rank in ranks for _, _, e in rank]
    return max(ends) - min(starts) if starts else 0.0


__all__ = ["add_options", "run"]
