"""Predicted against measured step time on this machine: ``autoshard calibrate`` measures it
into a cluster spec, then plans (data parallel, Megatron tensor parallel, searched) train on 2
gloo ranks of 1 thread each; the cost model's estimate of each plan is compared with the median
measured step (forward, backward, AdamW step)."""

from __future__ import annotations

import math
import statistics
import time
import warnings

import torch

NAME = "predict"

STEPS, WARMUP, BLOCK = 18, 1, 3


def _megatron(name: str) -> dict:
    col = ((None, None, None), ("tp", None))
    row = ((None, None, "tp"), (None, "tp"))
    if name == "gpt":
        from autoshard import Factored

        qkv = Factored((3, 8, 32), (None, "tp", None))
        return {
            "layers.*.attn.c_attn": ((None, None, None), (qkv, None)),
            "layers.*.attn.c_proj": row,
            "layers.*.mlp.c_fc": col,
            "layers.*.mlp.c_proj": row,
        }
    return {
        "layers.*.attention.w[qkv]": col,
        "layers.*.attention.wo": row,
        "layers.*.feed_forward.w[13]": col,
        "layers.*.feed_forward.w2": row,
    }


def _model(name: str):
    from autoshard.models import build, reference_config

    sizes = {
        "gpt": {"vocab": 512, "seq": 64, "layers": 2, "heads": 8, "hidden": 256},
        "llama": {
            "vocab": 512,
            "seq": 64,
            "layers": 2,
            "heads": 8,
            "kv_heads": 4,
            "hidden": 256,
            "ffn": 512,
        },
        "mlp": {"hidden": 256, "ffn": 1024, "vocab": 16, "layers": 3},
    }[name]
    batch = 64 if name == "mlp" else 8
    torch.manual_seed(0)
    config = reference_config(name, **sizes)
    return build(config), config.example_batch(batch, torch.Generator().manual_seed(1))


PLANS = [
    ("gpt", "data parallel", {"dp": 2}, None),
    ("gpt", "Megatron tp", {"tp": 2}, "megatron"),
    ("llama", "data parallel", {"dp": 2}, None),
    ("llama", "Megatron tp", {"tp": 2}, "megatron"),
    ("mlp", "data parallel", {"dp": 2}, None),
    ("gpt", "searched (optimal)", 2, "search"),
    ("llama", "searched (recursive)", 2, "search-recursive"),
]


def _build(spec_json: dict) -> list:
    """Every distinct plan of PLANS on this rank: (model name, title, module, optimizer,
    inputs, captured). A searched plan that is one already built (the same strategies, mesh
    and ZeRO stage, e.g. the data-parallel plan) is that plan once, its title joined to the
    first's: it is not a second data point."""
    from autoshard import parallelize, shard_inputs
    from autoshard.graph.capture import capture_modes

    built, seen = [], {}
    for name, title, mesh, how in PLANS:
        model, batch = _model(name)
        captured = capture_modes(model, batch)
        if how and how.startswith("search"):
            search = "recursive" if how.endswith("recursive") else "optimal"
            pm = parallelize(
                model, batch, mesh, captured=captured, search=search, cluster=spec_json
            )
        else:
            strategies = _megatron(name) if how == "megatron" else None
            pm = parallelize(model, batch, mesh, strategies, captured=captured)
        same = (name, tuple(pm.plan.digests()[1:]))  # the layouts, whatever the mesh's names
        if same in seen:
            i = seen[same]
            built[i] = (name, f"{built[i][1]} = {title}", *built[i][2:])
            continue
        seen[same] = len(built)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        built.append((name, title, pm, opt, shard_inputs(batch, pm), captured))
    return built


def _step(pm, opt, local) -> list[float]:
    """One timed step after a barrier: the slowest rank's total, forward, backward and
    optimizer seconds."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = pm(*local)
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    opt.step()
    opt.zero_grad()
    end = time.perf_counter()
    elapsed = torch.tensor(
        [end - start, forward - start, backward - forward, end - backward], dtype=torch.float64
    )
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return [float(e) for e in elapsed]


def _rank(spec_json: dict, steps: int) -> list[dict]:
    from autoshard.cost import estimate
    from autoshard.cost.cluster import ClusterSpec

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    spec = ClusterSpec.from_json(spec_json)
    built = _build(spec_json)
    # the plans take turns: a slower stretch of this shared machine falls on all of them alike
    # instead of on whichever plan it was timing. A turn is one step not kept (it brings the
    # plan's model back into the caches, which the plan before evicted) and BLOCK kept; each
    # round starts one plan later.
    timings: list[list[list[float]]] = [[] for _ in built]
    rounds = WARMUP + -(-steps // BLOCK)
    for r in range(rounds):
        for turn in range(len(built)):
            i = (r + turn) % len(built)
            _, _, pm, opt, local, _ = built[i]
            for k in range(1 + BLOCK):
                elapsed = _step(pm, opt, local)
                if r >= WARMUP and k > 0 and len(timings[i]) < steps:
                    timings[i].append(elapsed)
    rows = []
    for (name, title, pm, _, _, captured), times in zip(built, timings, strict=True):
        predicted = estimate(pm.plan, captured[True], spec)
        mesh_desc = " x ".join(
            f"{k}{v}" for k, v in zip(pm.plan.mesh.names, pm.plan.mesh.sizes, strict=True)
        )
        medians = [statistics.median(t) * 1e3 for t in zip(*times, strict=True)]
        rows.append(
            {
                "model": name,
                "plan": title,
                "mesh": mesh_desc,
                "measured_ms": medians[0],
                "measured_phases_ms": medians[1:],
                "predicted_phases_ms": [
                    (predicted.compute_forward + predicted.comm_forward) * 1e3,
                    (
                        predicted.step_time
                        - predicted.compute_forward
                        - predicted.comm_forward
                        - predicted.optimizer
                    )
                    * 1e3,
                    predicted.optimizer * 1e3,
                ],  # fmt: skip
                "predicted_ms": predicted.step_time * 1e3,
                "zero": pm.plan.zero,
                # what a searched plan splits (its parameters' layouts when not replicated)
                "split_params": {
                    fqn: str(p.layout)
                    for fqn, p in pm.plan.params.items()
                    if p.layout.local_numel != math.prod(p.layout.shape)
                },
                "compute_ms": predicted.compute * 1e3,
                "comm_ms": predicted.comm * 1e3,
                "optimizer_ms": predicted.optimizer * 1e3,
            }
        )
    return rows


def run(quick: bool) -> dict:
    import json
    from pathlib import Path

    from autoshard.cost.calibrate import calibrate
    from autoshard.testing import run_ranks

    spec = calibrate(ranks=2, threads=1)
    steps = 5 if quick else STEPS
    rows = run_ranks(_rank, 2, spec.to_json(), steps, timeout=900)[0]
    for r in rows:
        r["error"] = (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
    result = {"spec": spec.to_json(), "rows": rows, "steps": steps, "distinct": True}
    # the previous run, kept beside this one: the goal holds over two runs
    stored = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
    if stored.exists():
        before = json.loads(stored.read_text())
        result["previous"] = {
            "date": before.get("date"),
            "commit": str(before.get("machine", {}).get("git_commit"))[:10],
            "errors": [r["error"] for r in before["result"]["rows"]],
        }
    return result


def summary(result: dict) -> str:
    spec = result["spec"]
    rows = result["rows"]
    errors = [abs(r["error"]) for r in rows]
    lines = [
        f"Calibrated spec (`autoshard calibrate`): {spec['flops']['float32'] / 1e9:.1f} GFLOP/s "
        f"f32, memory {spec['memory_bandwidth'] / 1e9:.1f} GB/s, op overhead "
        f"{spec['op_overhead'] * 1e6:.1f} us, gloo {spec['intra_bandwidth'] / 1e9:.2f} GB/s, "
        f"{spec['intra_latency'] * 1e6:.0f} us latency. 2 ranks of 1 thread, float32; median of "
        f"{result.get('steps', STEPS)} steps of the slowest rank; the plans take turns of "
        f"{BLOCK} steps after one not kept (a warm-up round first); a step is forward, backward "
        "and AdamW.",
        "",
        "| model | plan | mesh | measured ms | predicted ms | error | forward | backward | "
        "optimizer |",
        "|---|---|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        phases = [
            f"{m:.1f} / {p:.1f}"
            for m, p in zip(
                r.get("measured_phases_ms", []), r.get("predicted_phases_ms", []), strict=True
            )
        ] or ["", "", ""]
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['mesh']} | {r['measured_ms']:.1f} | "
            f"{r['predicted_ms']:.1f} | {r['error'] * 100:+.0f}% | {' | '.join(phases)} |"
        )
    lines.append("")
    lines.append(
        "Phases: measured / predicted ms (forward with its communication; backward with its "
        "communication and the gradient buckets' exposed part; the optimizer step)."
    )
    for r in rows:
        if not r["plan"].startswith("searched"):
            continue
        splits = ", ".join(f"`{k}` {v}" for k, v in r.get("split_params", {}).items())
        what = f"splits {splits}" if splits else "splits no parameter"
        zero = f", ZeRO {r['zero']}" if "zero" in r else ""  # recorded since 2026-11-24
        lines += ["", f"{r['model']} {r['plan']}: {what}{zero}."]
    lines.append("")
    lines.append(
        f"Median absolute error {statistics.median(errors) * 100:.0f}% over {len(rows)} "
        # runs before 2026-11-24 timed a searched plan equal to another one twice
        f"{'distinct plans' if result.get('distinct') else 'plans'} "
        f"(max {max(errors) * 100:.0f}%)."
    )
    previous = result.get("previous")
    if previous:
        before = [abs(e) for e in previous["errors"]]
        signed = ", ".join(f"{e * 100:+.0f}%" for e in previous["errors"])
        lines.append(
            f"The run before ({previous['date']}, commit {previous['commit']}): median "
            f"absolute error {statistics.median(before) * 100:.0f}% (max "
            f"{max(before) * 100:.0f}%); errors in the order above: {signed}."
        )
    return "\n".join(lines)
