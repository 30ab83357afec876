"""Where a published run's predicted step goes: ``python -m bench.published_parts [RUN ...]``.

Plans each published H100 run as ``python -m bench published`` plans it (the same command on
the same cluster files; the runs named, every one when none is) and splits its predicted step
into what the cost model prices apart: the busiest pipeline rank's compute by kind of op
(matrix products, attention, the loss, norms and other elementwise ops, views, which cost a
kernel's overhead alone), the tensor-parallel communication the ops wait for, what recompute
runs again, the schedule's bubble, the data-parallel sums and ZeRO's gathers the step waits
for after the schedule, and the optimizer step. The parts add up to the predicted step.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: the columns of a run's parts, in the order they are printed
PARTS = (
    "matrix products", "attention", "loss", "norms", "elementwise", "views",
    "tp comm", "recompute", "bubble", "dp comm", "optimizer",
)  # fmt: skip
#: beside the parts: the data-parallel sums and ZeRO's gathers of the rank a step, hidden or not
ALL_DP = "dp comm priced"
#: beside the parts: the kernels the busiest rank launches a step (forward, backward and what
#: recompute runs again), each priced at the cluster's ``op_overhead`` inside its kind's time
KERNELS = "kernels"

#: what the parts table of ``bench published`` shows
DESCRIBED = (
    "Where each H100 run's predicted step goes (`python -m bench.published_parts [RUN ...]` "
    "prints the same), milliseconds a step, the parts adding up to the predicted step: the "
    "busiest pipeline rank's compute by kind of op over its micro-batches (matrix products "
    "and attention priced by their FLOPs, the loss, norms and other elementwise ops by their "
    "bytes, views by a kernel's overhead alone), the tensor-parallel moves the ops wait for "
    "(`tp comm`), what recompute runs again, the schedule's bubble, the data-parallel "
    "gradient sums and ZeRO's gathers the step waits for after the schedule (`dp comm`: "
    "the sums beside the last micro-batch's backward, the gathers beside the first one's "
    "forward) and the optimizer step; then all of the rank's data-parallel traffic a step, "
    "hidden or not (`dp comm priced`), and the kernels the rank launches a step (forward, "
    "backward and recompute; each pays 4 us of overhead inside its kind's time)."
)


@contextlib.contextmanager
def captured() -> Iterator[dict]:
    """While open, each pipeline plan ``autoshard plan`` picks lands in the dict yielded
    (``plan``, with ``graph``, the graph of its micro-batch it was priced on)."""
    from autoshard.search import pipelined

    got: dict = {}
    real = pipelined.search_pipeline

    def search(capture, *args, **kwargs):
        graphs: dict = {}

        def graph(m: int):
            graphs[m] = capture(m)
            return graphs[m]

        best, tried, seconds = real(graph, *args, **kwargs)
        got.update(plan=best, graph=graphs[best.schedule.microbatches])
        return best, tried, seconds

    pipelined.search_pipeline = search
    try:
        yield got
    finally:
        pipelined.search_pipeline = real


def parts(plan, og, overlap: float) -> dict[str, float]:
    """A pipeline plan's predicted step (``plan.predicted.step_time``) in :data:`PARTS`, in
    seconds, and :data:`ALL_DP`: the busiest rank's compute by kind and its in-line
    communication (the kinds' shares of the whole model's, scaled to the rank's blocks), what
    recompute runs again, the bubble, the sums and gathers waited for after the schedule
    (``overlap``: the cluster's ``overlap_efficiency``) and the optimizer step (as
    ``price_pipeline`` takes them)."""
    from autoshard.cost.breakdown import kind_breakdown
    from autoshard.cost.pipeline import Piece, model_pieces

    est, pipe, m = plan.stage.predicted, plan.predicted, plan.schedule.microbatches
    pre, block, count, post = model_pieces(est, og)
    stages = len(pipe.stage_seconds)
    shares = [count // stages + (1 if s >= stages - count % stages else 0) for s in range(stages)]
    busy = max(range(stages), key=lambda s: sum(pipe.stage_seconds[s]))
    again = {"full": block.forward, "selective": block.again_selective}.get(plan.recompute, 0.0)
    recompute = m * shares[busy] * again
    rank = m * sum(pipe.stage_seconds[busy]) - recompute
    kinds = kind_breakdown(est, og)
    whole = sum(k.forward_s + k.backward_s + k.comm_forward_s + k.comm_backward_s for k in kinds)
    out = dict.fromkeys(PARTS, 0.0)
    for k in kinds:
        name = "views" if k.kind == "inputs" else k.kind
        out[name] += rank / whole * (k.forward_s + k.backward_s)
        out["tp comm"] += rank / whole * (k.comm_forward_s + k.comm_backward_s)
    out["recompute"] = recompute
    out["bubble"] = pipe.timeline.step - m * sum(pipe.stage_seconds[busy])
    state = sum(est.memory[k] for k in ("parameters", "gradients", "optimizer")) or 1.0
    tail = (0.0, 0.0, 0.0)
    for s, n in enumerate(shares):
        p = (pre if s == 0 else Piece()) + block.scaled(n) + (post if s == stages - 1 else Piece())
        waited = max(0.0, p.grad_sums - overlap * p.backward)
        waited += max(0.0, p.gathers - overlap * p.forward)
        optimizer = sum(p.state.values()) / state * est.optimizer
        tail = max(tail, (waited + optimizer, waited, p.grad_sums + p.gathers), key=lambda t: t[0])
    out["dp comm"], out["optimizer"], out[ALL_DP] = tail[1], tail[0] - tail[1], tail[2]
    out[KERNELS] = m * _kernels(est, og, plan.recompute, shares[busy], count)
    return out


def _kernels(est, og, recompute: str | None, blocks: int, count: int) -> float:
    """Kernels a micro-batch launches on a rank holding ``blocks`` of the ``count`` blocks:
    every op priced forward and every one priced backward, plus the forward ops recompute runs
    again (full: all of a block's; selective: all but its matrix products), the ops outside
    the blocks counted with the rank's share of the blocks (the first and last stages hold
    them; the busiest rank's share is close to its blocks')."""
    from autoshard.cost.collectives import PRODUCTS

    prefix = next(iter(og.repeated), None)
    inside = outside = again = 0.0
    for node in og.graph.nodes:
        if node.name not in est.by_node:
            continue
        terms, copies = est.by_node[node.name]
        info = og[node]
        n = copies * ((terms.compute_forward > 0) + (terms.compute_backward > 0))
        if info.block is None or info.block[0] != prefix:
            outside += n
            continue
        inside += n
        product = str(info.op).split(".")[0] in PRODUCTS
        again += copies * (terms.compute_forward > 0) * (recompute == "full" or not product)
    again = again if recompute in ("full", "selective") else 0.0
    return (inside + again + outside) * blocks / max(count, 1)


def run_parts(r: dict, cluster: Path) -> dict[str, float]:
    """Run ``r`` of ``bench published`` planned as that bench plans it, in :data:`PARTS`,
    with its predicted and published step (``predicted``, ``published``)."""
    import json

    from bench.bench_published import _argv, _plan

    with tempfile.TemporaryDirectory() as tmp, captured() as got:
        out = Path(tmp) / "plan.json"
        if _plan(_argv(r, out, cluster)) != 0:
            raise RuntimeError(f"{r['run']}: the plan failed")
    overlap = json.loads(cluster.read_text()).get("overlap_efficiency", 1.0)
    found = parts(got["plan"], got["graph"], overlap)
    return found | {"predicted": got["plan"].predicted.step_time, "published": r["seconds"]}


def table(rows: list[tuple[str, dict[str, float]]]) -> list[str]:
    """The runs' parts as a Markdown table, milliseconds a step."""
    head = ["run", "published ms", "predicted ms", "error", *PARTS, ALL_DP, KERNELS]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name, p in rows:
        error = p["published"] / p["predicted"] - 1
        cells = [f"{p['published'] * 1e3:.0f}", f"{p['predicted'] * 1e3:.0f}", f"{error:+.1%}"]
        cells += [f"{p[k] * 1e3:.1f}" for k in (*PARTS, ALL_DP)] + [f"{p.get(KERNELS, 0):.0f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(names: list[str]) -> int:
    from bench import published_h100

    with tempfile.TemporaryDirectory() as tmp:
        clusters = published_h100.clusters(Path(tmp))
        chosen = [r for r in published_h100.runs() if not names or r["run"] in names]
        rows = []
        for r in chosen:
            rows.append((r["run"], run_parts(r, clusters[r["cluster"]])))
            print(table(rows)[-1], flush=True)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
