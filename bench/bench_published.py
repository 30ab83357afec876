"""Predictions against published runs: the throughput ``autoshard plan`` predicts for training
runs whose configuration and speed were published, each evaluated as given (model shape,
tensor and pipeline degrees, data-parallel degree, micro-batch, schedule, recompute, batch,
hardware), with the error per run.

Sources (the numbers are the papers'; the code that reads them is this file):

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198), Tables 3 and 4: GPT models of 22B, 175B, 530B and 1T parameters on
  Selene's A100 80GB nodes, fp16 mixed precision, one iteration's time with full recompute and
  with selective recompute and sequence parallelism.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21), Table 1: the weak-scaling GPT runs from 1.7B to 1T parameters on up
  to 3072 A100s, achieved teraFLOP/s per GPU. Its throughput counts the recompute forward
  (96 B s l h^2 (1 + s/6h + V/16lh) FLOPs an iteration); the step time is those FLOPs over
  the GPUs' achieved FLOP/s. The table gives no micro-batch size or schedule: 1 sequence a
  micro-batch and 1F1B are taken where there are stages, the whole local batch in one pass
  where there are none, full recompute throughout (the FLOPs count assumes it).

Every run is priced on the ``dgx-a100`` preset with one change, the software's: Megatron-LM of
2021-22 computed attention without a fused kernel, its scores written and read by separate
passes (scale, mask and softmax; dropout and its mask; the product with the values), so
``attention_score_bytes`` is set to the bytes those passes move per score element in fp16
(forward 13: write 2, softmax 2 + 2, dropout 2 + 2 + 1 of mask, read 2; backward 21); and its
data-parallel all-reduce of the gradients ran after the backward pass (Megatron-LM's local DDP
of that time: no overlap), so ``overlap_efficiency`` is 0. Gradients are summed in float32 (the
policy's master dtype).

One parameter was fitted: the A100 preset's matrix-product share at large sizes, 0.765 (cuBLAS's
large fp16 products sustaining 239 of the 312 TFLOP/s), set so that the 175B run with full
recompute (marked "fit") is predicted within 0.1%; no other run set anything.

Where autoshard's cost model holds a configuration over the device's 80 GiB, the step is
priced with the limit lifted and the table says so. Since sequence parallelism's activations
are priced as Megatron-LM keeps them (every term of a layer a t-th, the column-parallel
linears' inputs gathered again in backward), no run is.

The published H100 runs (``bench/published_h100.py``) are reported apart, each with its
predicted step in parts (``bench/published_parts.py``; ``python -m bench.published_parts
[RUN ...]`` plans only the H100 runs named, in about a minute each).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from bench import published_h100, published_parts

NAME = "published"

_GPT = {"seq": 2048, "vocab": 51200}
#: what every A100 run shares: the model, Megatron-LM's fp16 and no ZeRO, Selene
_A100 = {"model": "gpt", **_GPT, "zero": 0, "precision": "fp16", "cluster": "selene"}

#: Korthikanti et al. 2022, Tables 3-4: (name, heads, hidden, layers, tp, pp, GPUs, batch,
#: micro-batch, interleaved stages a rank, seconds with full recompute, seconds with selective
#: recompute and sequence parallelism)
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
]

#: Narayanan et al. 2021, Table 1: (name, heads, hidden, layers, tp, pp, GPUs, batch,
#: achieved teraFLOP/s per GPU)
NARAYANAN = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

#: the runs a parameter of the cost model was set from
FIT = {("korthikanti-2022", "175B full")}

#: what the published runs' software moved per attention score element, forward and backward
#: (bytes; fp16 scores materialized by separate passes)
SCORE_BYTES = [13.0, 21.0]


def _cluster(folder: Path) -> Path:
    """The dgx-a100 preset with attention as the published runs' software ran it."""
    from autoshard.cost import cluster_spec

    data = cluster_spec("dgx-a100").to_json() | {
        "attention_score_bytes": SCORE_BYTES,
        "overlap_efficiency": 0.0,  # the data-parallel all-reduce ran after backward
    }
    path = folder / "selene-megatron.json"
    path.write_text(json.dumps(data))
    return path


def _narayanan_seconds(heads, hidden, layers, gpus, batch, tflops) -> float:
    s, v, h, n = _GPT["seq"], _GPT["vocab"], hidden, layers
    flops = 96 * batch * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    return flops / (gpus * tflops * 1e12)


def runs() -> list[dict]:
    """Every published run: its source, shape, configuration and measured step seconds."""
    out = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, mbs, v, full, sel in KORTHIKANTI:
        for mode, seconds in (("full", full), ("selective+sp", sel)):
            out.append({
                "source": "korthikanti-2022", "run": f"{name} {mode}", "heads": heads,
                "hidden": hidden, "layers": layers, "tp": tp, "pp": pp, "gpus": gpus,
                "batch": batch, "microbatches": batch // (mbs * gpus // (tp * pp)),
                "schedule": "interleaved-1f1b" if v > 1 else "1f1b", "virtual_stages": v,
                "recompute": "full" if mode == "full" else "selective",
                "sequence_parallel": mode != "full", "seconds": seconds, **_A100,
            })  # fmt: skip
    for name, heads, hidden, layers, tp, pp, gpus, batch, tflops in NARAYANAN:
        dp = gpus // (tp * pp)
        out.append({
            "source": "narayanan-2021", "run": name, "heads": heads, "hidden": hidden,
            "layers": layers, "tp": tp, "pp": pp, "gpus": gpus, "batch": batch,
            "microbatches": batch // dp if pp > 1 else 1, "schedule": "1f1b",
            "virtual_stages": 1, "recompute": "full", "sequence_parallel": False,
            "seconds": _narayanan_seconds(heads, hidden, layers, gpus, batch, tflops), **_A100,
        })  # fmt: skip
    return out + published_h100.runs()


def _argv(r: dict, out: Path, cluster: Path) -> list[str]:
    # a model of the run's own code where autoshard's reference model differs from it
    sizes = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
    model = ["--model-fn", r["model_fn"]] if "model_fn" in r else ["--model", r["model"]]
    if "model_fn" not in r:
        model += [a for k in sizes if k in r for a in (f"--{k.replace('_', '-')}", str(r[k]))]
    argv = [
        "plan", *model, "--seq", str(r["seq"]),
        "--batch", str(r["batch"]), "--cluster", str(cluster), "--devices", str(r["gpus"]),
        "--precision", r["precision"], "--zero", str(r["zero"]), "--tp", str(r["tp"]),
        "--pp", str(r["pp"]), "--microbatches", str(r["microbatches"]),
        "--schedule", r["schedule"], "--json", str(out),
    ]  # fmt: skip
    if r["recompute"]:  # else searched
        argv += ["--recompute", r["recompute"]]
    if r["virtual_stages"] > 1:
        argv += ["--virtual-stages", str(r["virtual_stages"])]
    if r["sequence_parallel"]:
        argv.append("--sequence-parallel")
    if r.get("untie"):
        argv.append("--untie-embeddings")
    return argv


def _plan(argv: list[str], said: io.StringIO | None = None) -> int:
    """``autoshard`` run on ``argv``, its output dropped (its errors into ``said``)."""
    from autoshard.cli.main import main

    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(said or io.StringIO()),
    ):
        return main(argv)


def _predict(r: dict, cluster: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp, published_parts.captured() as got:
        out = Path(tmp) / "plan.json"
        argv = _argv(r, out, cluster)
        start, said = time.perf_counter(), io.StringIO()
        code = _plan(argv, said)
        # over the device's memory in autoshard's model: an A100 run is priced regardless
        # (its table says so); an H100 run is not (it must fit: the row says it does not)
        lifted = code == 3 and r["cluster"] == "selene"
        if lifted:
            argv += ["--memory-gib", "100000"]
            code = _plan(argv)
        wall = time.perf_counter() - start
        shown = [a if a != str(cluster) else cluster.name for a in argv]
        command = "autoshard " + " ".join(a for a in shown if a not in ("--json", str(out)))
        if code == 3:
            least = re.search(r"needs ([0-9.]+) GiB", said.getvalue())
            return {"predicted_s": None, "peak_gib": float(least[1]) if least else None,
                    "over_memory": False, "plan_s": wall, "command": command}  # fmt: skip
        if code != 0:
            raise RuntimeError(f"autoshard {' '.join(argv)} exited {code}")
        data = json.loads(out.read_text())
    pipe = data["pipeline"]
    parts = {}
    if r["cluster"] != "selene":  # where an H100 run's step goes (bench/published_parts.py)
        overlap = json.loads(cluster.read_text()).get("overlap_efficiency", 1.0)
        parts["parts"] = published_parts.parts(got["plan"], got["graph"], overlap)
    return parts | {
        "predicted_s": pipe["step_time_s"],
        "peak_gib": pipe["peak_memory_bytes"] / 2**30,
        "over_memory": lifted,
        "bubble": pipe["bubble"],
        "recompute_planned": pipe["recompute"],
        "plan_s": wall,
        "command": command,
    }


#: the runs whose model and cluster are also searched, and planned on a Megatron-style grid
#: (every tp of a node and pp dividing the devices and the layers, 1, 2 or 4 sequences a
#: micro-batch, 1F1B, the recompute mode searched, ZeRO 0): the search must reach at least
#: the best of the grid and of the published configuration
COMPARED = ("22B full", "175B full", "1.7B", "3.6B", "7.5B", "18.4B")


def _step(argv: list[str], cluster: Path) -> tuple[float, dict] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        if _plan([*argv, "--cluster", str(cluster), "--json", str(out)]) != 0:
            return None
        data = json.loads(out.read_text())
    return (data.get("pipeline") or data["predicted"])["step_time_s"], data


def _grid(r: dict, cluster: Path) -> dict:
    """The best Megatron-style grid configuration of run ``r``'s model and cluster, and the
    plan autoshard searches with nothing fixed (``--pp auto``), priced by the same model."""
    base = ["plan", "--model", "gpt", "--layers", str(r["layers"]), "--hidden", str(r["hidden"]),
            "--heads", str(r["heads"]), "--seq", str(_GPT["seq"]), "--vocab", str(_GPT["vocab"]),
            "--batch", str(r["batch"]), "--devices", str(r["gpus"]),
            "--precision", "fp16"]  # fmt: skip
    best, tried = None, 0
    for tp in (1, 2, 4, 8):
        for pp in range(1, r["gpus"] // tp + 1):
            dp = r["gpus"] // (tp * pp)
            if r["gpus"] % (tp * pp) or r["layers"] % pp:
                continue
            for mbs in (1, 2, 4):
                m = r["batch"] // (dp * mbs) if r["batch"] % (dp * mbs) == 0 else 0
                if m == 0 or (pp > 1 and m < pp):
                    continue
                fixed = ["--tp", str(tp), "--pp", str(pp), "--microbatches", str(m),
                         "--schedule", "1f1b", "--zero", "0"]  # fmt: skip
                got, tried = _step(base + fixed, cluster), tried + 1
                if got is not None and (best is None or got[0] < best["step_s"]):
                    rc = got[1]["pipeline"]["recompute"]
                    best = {"step_s": got[0], "tp": tp, "pp": pp, "mbs": mbs, "recompute": rc}
    searched = _step([*base, "--pp", "auto"], cluster)
    pipe = searched[1].get("pipeline") or {} if searched else {}
    return {
        "grid": best,
        "grid_tried": tried,
        "searched_s": searched[0] if searched else None,
        "searched_mesh": ({"pp": pipe["pp"]} if pipe else {}) | searched[1]["mesh"]
        if searched
        else None,
        "searched_config": {k: pipe.get(k) for k in ("microbatches", "schedule", "recompute")}
        if pipe
        else None,
    }


def run(quick: bool) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {"selene": _cluster(Path(tmp))} | published_h100.clusters(Path(tmp))
        chosen = runs()[:2] + published_h100.runs()[:2] if quick else runs()
        for r in chosen:
            got = _predict(r, clusters[r["cluster"]])
            # throughput error: predicted tokens a second over published ones, less one (None:
            # the configuration does not fit the device in autoshard's model)
            error = r["seconds"] / got["predicted_s"] - 1 if got["predicted_s"] else None
            rows.append(r | got | {"error": error, "fit": (r["source"], r["run"]) in FIT})
        compared = [
            {"run": r["run"], "published_config_s": row["predicted_s"]}
            | _grid(r, clusters["selene"])
            for r, row in zip(runs(), rows, strict=False)
            if r["run"] in COMPARED and r["cluster"] == "selene" and not quick
        ]
    return {"rows": rows, "score_bytes": SCORE_BYTES, "compared": compared}


def _parts(rows: list[dict]) -> list[str]:
    """Where each run's predicted step goes, in milliseconds (``python -m bench.published_parts``
    prints the same for the runs it is given)."""
    got = [
        (r["run"], r["parts"] | {"predicted": r["predicted_s"], "published": r["seconds"]})
        for r in rows
        if r.get("parts")
    ]
    if not got:
        return []
    return ["", published_parts.DESCRIBED, "", *published_parts.table(got)]


def _stats(rows: list[dict]) -> str:
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    misfits = len(rows) - len(errors)
    unplanned = f"; {misfits} of {len(rows)} do not fit 80 GiB in autoshard's model" * (misfits > 0)
    if not errors:
        return "none planned" + unplanned
    mean, worst = statistics.mean(errors) * 100, max(errors) * 100
    return f"mean {mean:.1f}%, max {worst:.1f}% over {len(errors)} runs{unplanned}"


def _table(rows: list[dict]) -> list[str]:
    """The rows' table, then their errors: over all, over those no parameter was set from,
    and by source."""
    lines = [
        "| source | run | tp | pp | GPUs | batch | micro-batches | schedule | recompute "
        "| published s | predicted s | error | peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        sched = r["schedule"] + (f" v{r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        rc = r["recompute"] or f"searched: {r.get('recompute_planned') or '-'}"
        rc += " + sp" if r["sequence_parallel"] else ""
        rc += f", ZeRO {r['zero']}" if r.get("zero") else ""
        mark = " (fit)" if r["fit"] else ""
        got = (
            f"{r['predicted_s']:.2f} | {r['error'] * 100:+.1f}% | {r['peak_gib']:.1f}"
            f"{' (over 80)' if r.get('over_memory') else ''}"
            if r["predicted_s"]
            else f"does not fit | | least {r['peak_gib']:.1f}"
        )
        lines.append(
            f"| {r['source']} | {r['run']}{mark} | {r['tp']} | {r['pp']} | {r['gpus']} | "
            f"{r['batch']} | {r['microbatches']} | {sched} | {rc} | {r['seconds']:.2f} | {got} |"
        )
    unfit = [r for r in rows if not r["fit"]]
    lines += [
        "",
        f"- Absolute error, every run: {_stats(rows)}.",
        f"- Runs not used to set any parameter: {_stats(unfit)}.",
    ]
    for source in sorted({r["source"] for r in rows}):
        lines.append(f"- {source}: {_stats([r for r in rows if r['source'] == source])}.")
    return lines


def summary(result: dict) -> str:
    rows = result["rows"]
    a100 = [r for r in rows if r.get("cluster", "selene") == "selene"]
    h100 = [r for r in rows if r.get("cluster", "selene") != "selene"]
    score = "/".join(f"{b:g}" for b in result.get("score_bytes", SCORE_BYTES))
    lines = [
        "Published Megatron-LM runs on A100 80GB nodes: Narayanan et al. 2021 (SC21, "
        '"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", '
        "Table 1: teraFLOP/s per GPU, turned into seconds an iteration by its FLOPs formula) "
        'and Korthikanti et al. 2022 (arXiv 2205.05198, "Reducing Activation Recomputation '
        "in Large Transformer Models\", Tables 3-4: seconds an iteration). Each run's "
        "configuration planned as given (`--tp`, `--pp`, `--microbatches`, `--schedule`, "
        "`--recompute`, `--sequence-parallel`, `--zero 0`, `--precision fp16`) on the "
        "`dgx-a100` preset with the runs' software described (`selene-megatron.json`: "
        f"attention without a fused kernel, {score} bytes a score forward/backward; the "
        "data-parallel all-reduce after backward, `overlap_efficiency` 0). Where a table is "
        "silent (Narayanan's micro-batch and schedule): one sequence a micro-batch and 1F1B "
        "with stages, the local batch in one pass without. Error: predicted throughput over "
        "published, less one (positive: predicted faster). One parameter fitted: the A100's "
        "large-product share, on the run marked (fit).",
        "",
        *_table(a100),
        "",
        published_h100.DESCRIBED,
        "",
        *_table(h100),
        *_parts(h100),
    ]
    if result.get("compared"):
        lines += [
            "",
            "Search quality, same cost model: the published configuration, the best of a "
            "Megatron-style grid (tp 1-8, pp dividing the devices and layers, 1, 2 or 4 "
            "sequences a micro-batch, 1F1B, recompute searched, ZeRO 0) and autoshard's plan "
            "with nothing fixed (`--pp auto`):",
            "",
            "| run | published config s | best grid s (tp, pp, micro-batch, recompute) "
            "| searched s | searched plan |",
            "|---|---:|---|---:|---|",
        ]
        for c in result["compared"]:
            g = c["grid"] or {}
            grid = (
                f"{g['step_s']:.2f} (tp {g['tp']}, pp {g['pp']}, {g['mbs']}, {g['recompute']}; "
                f"{c['grid_tried']} tried)"
                if g
                else "none fits"
            )
            mesh = " x ".join(f"{k}{v}" for k, v in (c["searched_mesh"] or {}).items())
            cfg = c.get("searched_config") or {}
            shown = ", ".join(f"{v}" for v in cfg.values() if v is not None)
            lines.append(
                f"| {c['run']} | {c['published_config_s']:.2f} | {grid} | "
                f"{c['searched_s']:.2f} | {mesh}{', ' + shown if shown else ''} |"
            )
    lines.append("")
    lines.append("Commands: " + "; ".join(f"`{r['command']}`" for r in rows))
    return "\n".join(lines)
