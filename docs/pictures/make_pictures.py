"""Draw the example pictures of docs/pictures.md with autoshard.pictures.
Run: ``python docs/pictures/make_pictures.py``."""

from __future__ import annotations

import math
import random
from pathlib import Path

from autoshard import Layout
from autoshard.pictures import layout_picture, metrics_picture, plan_picture

HERE = Path(__file__).parent


def example_plan() -> dict:
    """A searched plan's JSON as ``autoshard plan --json`` writes it (a GPT-2 small sized model
    on dp=2 x tp=4), cut to the fields the picture reads."""
    rows = [
        ("wte", 1, 0.41e-3, 0.00e-3, 0.30 * 2**30),
        ("wpe", 1, 0.02e-3, 0.00e-3, 0.01 * 2**30),
        ("layers.*", 12, 1.62e-3, 0.21e-3, 0.45 * 2**30),
        ("ln_f", 1, 0.03e-3, 0.00e-3, 0.02 * 2**30),
        ("lm_head", 1, 1.10e-3, 0.08e-3, 0.55 * 2**30),
        ("gradient sums (exposed)", 1, 0.00e-3, 0.64e-3, 0.00),
        ("optimizer step", 1, 0.52e-3, 0.00e-3, 0.90 * 2**30),
    ]
    layers = [
        {"layer": name, "blocks": blocks, "compute_s": compute, "comm_s": comm, "memory_bytes": mem}
        for name, blocks, compute, comm, mem in rows
    ]
    step = sum(r["blocks"] * (r["compute_s"] + r["comm_s"]) for r in layers)
    memory = sum(r["blocks"] * r["memory_bytes"] for r in layers)
    return {
        "mesh": {"dp": 2, "tp": 4},
        "zero": 0,
        "predicted": {"step_time_s": step, "peak_memory_bytes": 1.15 * memory, "layers": layers},
    }


def example_metrics() -> list[dict]:
    """Records as ``autoshard train`` writes them, one per step (the first step compiles)."""
    noise = random.Random(0)
    records = []
    for step in range(1, 61):
        seconds = 0.090 if step == 1 else 0.050 + noise.gauss(0, 0.002)
        loss = 1.2 + 4.3 * math.exp(-step / 12) + noise.gauss(0, 0.05)
        records.append(
            {"step": step, "loss": loss, "step_s": seconds, "samples_per_s": 8 / seconds,
             "bytes_sent": 1_572_864, "grad_norm": None}
        )  # fmt: skip
    return records


def main() -> None:
    rows_cols = Layout.from_named((8, 8), ("dp", "tp"), {"dp": 2, "tp": 2})
    print(layout_picture(rows_cols, HERE / "layout_dp_tp.png"))
    print(plan_picture(example_plan(), HERE / "plan_breakdown.png"))
    print(metrics_picture(example_metrics(), HERE / "metrics.png"))


if __name__ == "__main__":
    main()
