"""Planning speed: ``autoshard plan`` from process start to the JSON file, capture included, and
the search alone, for the Llama-3-8B shape on 64 devices and a Llama-70B shape on 512 (8-device
H100 nodes), with each search; the recursive search's plan against the optimal one's; GPT-3
175B on 128 H100 nodes and a 1T GPT on 384 A100 nodes in pipeline stages (``--pp``); the MoE
shapes of Mixtral-8x7B on 64 H100s and DeepSeek-V3 on 1024, their experts' layout. And the
presets' predicted MFU for shapes published runs trained: Megatron-LM's GPT-1.7B on 32 A100s
(2021: 44% of peak) and Llama-3-8B at a larger batch. Each shape with a goal is planned once
more beside two processes that spin a core each (a busy machine): at most 3x its quiet time."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NAME = "plan"

SHAPES = {
    "llama3-8b": {
        "args": "--model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 "
        "--seq 2048 --batch 64 --vocab 128256",
        "nodes": 8,
    },
    "hf-llama3-8b": {  # transformers' LlamaForCausalLM, the user's own model (--model-fn)
        "args": "--model-fn bench.hf_models:llama3_8b",
        "nodes": 8,
    },
    "llama-70b": {
        "args": "--model llama --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 "
        "--seq 4096 --batch 64 --vocab 128256",
        "nodes": 64,
    },
    "gpt-1.7b": {
        "args": "--model gpt --layers 24 --hidden 2304 --heads 24 --seq 2048 --batch 512 "
        "--vocab 51200",
        "nodes": 4,
        "cluster": "dgx-a100",
    },
    "gpt3-175b": {  # Brown et al. 2020's shape; the stages, micro-batches, recompute given
        "args": "--model gpt --layers 96 --hidden 12288 --heads 96 --seq 2048 --batch 1536 "
        "--vocab 51200 --pp 16 --microbatches 96 --recompute full",
        "nodes": 128,
    },
    "gpt3-175b-searched": {  # the same shape, the pipeline degree, micro-batches, schedule
        # and recompute searched (nothing fits without stages)
        "args": "--model gpt --layers 96 --hidden 12288 --heads 96 --seq 2048 --batch 1536 "
        "--vocab 51200",
        "nodes": 128,
    },
    "gpt-1t": {  # Narayanan et al. 2021's 1T run: 3072 A100s, pp 64, batch 3072
        "args": "--model gpt --layers 128 --hidden 25600 --heads 160 --seq 2048 --batch 3072 "
        "--vocab 51200 --pp 64 --microbatches 512 --recompute full",
        "nodes": 384,
        "cluster": "dgx-a100",
    },
    "mixtral-8x7b": {  # Jiang et al. 2024's shape: 8 experts of ffn 14336, top 2
        "args": "--model moe --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 "
        "--experts 8 --top-k 2 --seq 4096 --batch 256 --vocab 32000",
        "nodes": 8,
    },
    "deepseek-v3-like": {  # DeepSeek-V3's MoE shape (256 experts of ffn 2048, top 8) on a
        # Llama block (GQA attention in place of MLA, every layer MoE)
        "args": "--model moe --layers 61 --hidden 7168 --heads 128 --kv-heads 8 --ffn 2048 "
        "--experts 256 --top-k 8 --seq 4096 --batch 1024 --vocab 129280",
        "nodes": 128,
    },
    "llama3-8b-bs256": {
        "args": "--model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 "
        "--seq 2048 --batch 256 --vocab 128256",
        "nodes": 8,
    },
}

#: planning-speed goals, seconds from process start to the JSON file on this machine
GOALS = {"llama3-8b": 3, "hf-llama3-8b": 5, "llama-70b": 5, "gpt3-175b-searched": 10, "gpt-1t": 30}

#: MFU published large runs reach (docs/cost.md): Llama 3 405B on H100 38-43%, Megatron-LM on
#: A100 44-52%, MegaScale 55.2%
PUBLISHED_MFU = (0.38, 0.55)


def _one(shape: str, search: str) -> dict:
    spec = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "autoshard.cli", "plan", *spec["args"].split()]
        cluster = spec.get("cluster", "dgx-h100")
        cmd += ["--cluster", cluster, "--nodes", str(spec["nodes"]), "--search", search]
        cmd += ["--json", str(out)]
        start = time.perf_counter()
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        data = json.loads(out.read_text())
    pred = data["predicted"]
    pipe = data.get("pipeline")  # with --pp: the pipeline's step, MFU and memory
    shown = pipe or pred
    mesh = ({"pp": pipe["pp"]} if pipe else {}) | data["mesh"]
    return {
        "shape": shape,
        "cluster": spec.get("cluster", "dgx-h100"),
        "devices": spec["nodes"] * 8,
        "search": search,
        "process_s": wall,
        "in_process_s": pred["end_to_end_s"],
        "capture_s": pred["capture_s"],
        "search_s": pred["search_s"],
        "mesh": mesh,
        "step_ms": shown["step_time_s"] * 1e3,
        "mfu": shown["mfu"],
        "peak_gib": shown["peak_memory_bytes"] / 2**30,
        "pipeline": {
            k: pipe.get(k) for k in ("schedule", "microbatches", "recompute", "bubble", "search_s")
        }
        if pipe
        else None,
        "command": "autoshard plan " + " ".join(cmd[4:-2]),
        "experts": [line for line in done.stdout.splitlines() if line.startswith("experts ")],
    }


#: a fresh process that captures the least model there is (one nn.Linear) as autoshard
#: captures it (in one trace, graph/traced.py: its first trace imports torch._dynamo and
#: torch._inductor, which torch's tracer needs), and the same importing transformers: the
#: floor under every figure above; and, for comparison, the same through torch.export. Each
#: ends as ``autoshard plan`` ends (``os._exit``, once its output is written): the
#: interpreter's teardown of torch._dynamo's modules, which the command skips, took 0.4-0.6 s
_LINEAR = "torch.nn.Linear(4, 4), (torch.randn(2, 4),)"
_CAPTURE = f"import torch; from autoshard.graph import capture; capture({_LINEAR})"
_EXPORT = f"import torch; torch.export.export({_LINEAR}, strict=False).run_decompositions({{}})"
_END = "; import os; os._exit(0)"
FLOORS = {
    "torch": "import torch" + _END,
    "capture": _CAPTURE + _END,
    "capture + transformers": "import transformers; " + _CAPTURE + _END,
    "export": _EXPORT + _END,
}


def _floors(tries: int = 3) -> dict[str, float]:
    """Seconds from process start to the end of each ``FLOORS`` import (the least of a few)."""
    out = {}
    for name, code in FLOORS.items():
        times = []
        for _ in range(tries):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - start)
        out[name] = min(times)
    return out


def _compile_bytecode() -> None:
    """autoshard's and this benchmark's modules compiled to bytecode before anything is timed,
    as ``pip install`` does for what it installs: this machine sets PYTHONDONTWRITEBYTECODE,
    so a process would otherwise compile an editable checkout's modules from source again
    (about 0.4 s of each planning process here; torch's and transformers' are compiled)."""
    import compileall

    import autoshard

    for where in (Path(autoshard.__file__).parent, Path(__file__).parent):
        compileall.compile_dir(str(where), quiet=1)


#: how many times each shape with a goal is planned (its figure: the median); the host's
#: load moves a single run by a second or more
GOAL_RUNS = 3

#: a busy machine: this many processes spinning a core each beside a shape with a goal, run
#: once more so (its busy time at most BUSY_GOAL times its quiet one)
BUSY_LOOPS = 2
BUSY_GOAL = 3.0


@contextmanager
def _busy(loops: int = BUSY_LOOPS) -> Iterator[None]:
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        time.sleep(0.5)  # (their interpreters started)
        yield
    finally:
        for proc in spinning:
            proc.kill()
            proc.wait()


def run(quick: bool) -> dict:
    _compile_bytecode()
    rows = []
    for shape in SHAPES:
        llama = shape.startswith("llama")
        searches = ("optimal", "recursive") if not quick and llama else ()
        for search in searches or ("optimal",):
            rows.append(_one(shape, search))
    # the goals' runs again, interleaved, so that a burst of load lands on one run of each
    timed = [r for r in rows if r["search"] == "optimal" and r["shape"] in GOALS]
    for r in timed:
        r["process_runs"] = [r["process_s"]]
    for _ in range(GOAL_RUNS - 1 if not quick else 0):
        for r in timed:
            r["process_runs"].append(_one(r["shape"], "optimal")["process_s"])
    for r in timed:
        r["process_s"] = statistics.median(r["process_runs"])
        with _busy():
            r["busy_s"] = _one(r["shape"], "optimal")["process_s"]
    return {"rows": rows, "floors": _floors()}


def summary(result: dict) -> str:
    lines = [
        "`autoshard plan` in a fresh process on this machine (2 cores), reference model captured "
        "on the meta device with 2 of its blocks and priced at full depth. Process: wall time "
        "from process start to the JSON file, autoshard's modules compiled to bytecode first "
        "as `pip install` does (this machine sets PYTHONDONTWRITEBYTECODE), the median of "
        f"{GOAL_RUNS} runs for a shape with a goal; search: building the cost graphs of every "
        "mesh shape and solving them.",
        "",
        "| model | cluster | devices | search | process s | busy s | capture s | search s | mesh "
        "| predicted step ms | MFU | peak GiB |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        mesh = " x ".join(f"{k}{v}" for k, v in r["mesh"].items())
        lines.append(
            f"| {r['shape']} | {r.get('cluster', 'dgx-h100')} | {r['devices']} | {r['search']} | "
            f"{r['process_s']:.2f} | "
            + (f"{r['busy_s']:.2f} | " if "busy_s" in r else "- | ")
            + f"{r['capture_s']:.2f} | {r['search_s']:.2f} | {mesh} | {r['step_ms']:.0f} | "
            f"{r['mfu'] * 100:.1f}% | {r['peak_gib']:.1f} |"
        )
    by = {(r["shape"], r["search"]): r for r in result["rows"]}
    for shape in SHAPES:
        if (shape, "optimal") in by and (shape, "recursive") in by:
            ratio = by[(shape, "recursive")]["step_ms"] / by[(shape, "optimal")]["step_ms"]
            lines.append(f"- {shape}: recursive's predicted step is {ratio:.3f}x optimal's.")
    floors = result.get("floors") or {}
    for name, seconds in floors.items():
        lines.append(f'- Floor: `python -c "{FLOORS[name]}"` takes {seconds:.2f} s here.')
    for r in result["rows"]:
        goal = GOALS.get(r["shape"]) if r["search"] == "optimal" else None
        if goal is not None:
            met = "under" if r["process_s"] < goal else "over"
            floor = floors.get("capture + transformers" if "hf" in r["shape"] else "capture")
            runs = r.get("process_runs") or [r["process_s"]]
            notes = []
            if len(runs) > 1:
                notes.append(f"median of {len(runs)}: " + ", ".join(f"{t:.2f}" for t in runs))
            if floor:
                notes.append(f"{r['process_s'] - floor:.1f} s past the imports' floor")
            said = f" ({'; '.join(notes)})" if notes else ""
            lines.append(
                f"- {r['shape']}: {r['process_s']:.1f} s from process start{said}, {met} the "
                f"goal of {goal} s."
            )
            if "busy_s" in r:
                ratio = r["busy_s"] / r["process_s"]
                lines.append(
                    f"- {r['shape']} beside {BUSY_LOOPS} busy loops: {r['busy_s']:.1f} s, "
                    f"{ratio:.2f}x quiet ({'within' if ratio <= BUSY_GOAL else 'over'} the "
                    f"{BUSY_GOAL:g}x goal)."
                )
    low, high = PUBLISHED_MFU
    for r in result["rows"]:
        if r["search"] == "optimal":
            inside = "inside" if low <= r["mfu"] <= high else "outside"
            lines.append(
                f"- {r['shape']} on {r.get('cluster', 'dgx-h100')}: predicted MFU "
                f"{r['mfu'] * 100:.1f}%, {inside} the {low:.0%}-{high:.0%} published runs reach."
            )
    for r in result["rows"]:
        if r.get("pipeline"):
            p = r["pipeline"]
            fits = "fits in 80 GiB" if r["peak_gib"] <= 80 else "does not fit in 80 GiB"
            lines.append(
                f"- {r['shape']}: {p['schedule']}, {p['microbatches']} micro-batches, recompute "
                f"{p['recompute']}: bubble {p['bubble'] * 100:.1f}%, peak {r['peak_gib']:.1f} "
                f"GiB per device ({fits})"
                + (f"; pipeline search {p['search_s']:.1f} s." if p.get("search_s") else ".")
            )
    for r in result["rows"]:
        for line in r.get("experts") or ():
            lines.append(f"- {r['shape']}: {line}.")
    lines.append("")
    lines.append("Commands: " + "; ".join(f"`{r['command']}`" for r in result["rows"]))
    return "\n".join(lines)
