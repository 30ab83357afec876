"""A searched plan's table, from its JSON: the headline, the assumptions, the meshes tried, the
step layer by layer and each op's layouts. ``autoshard plan`` prints it; so may a program:

    p = autoshard.plan(model, example, "dgx-h100", num_devices=64)
    print(format_search(p.json, None, p))

(``str(p)`` is the op-by-op table of the plan itself, ``Plan.__str__``.)"""

from __future__ import annotations

from autoshard.cost.collectives import BUCKET_CAP_MB


def _assumptions(data: dict) -> list[str]:
    """What the prediction rests on: the precision planned in and the cluster's efficiencies."""
    c = data["cluster"]
    dtype = data["predicted"].get("dtype", "float32")
    peak = c["flops"].get(dtype) or max(c["flops"].values())
    shares = c.get("matmul_efficiency") or [[0, 1.0]]
    attention = c.get("attention_efficiency", [1.0, 1.0])
    policy = data.get("precision")
    kept = (
        f", {policy['master']} master weights, gradients and optimizer state, gradient sums in "
        f"{policy['reduce'] or policy['master']} (--precision)"
        if policy
        else " throughout"
    )
    return [
        f"precision: {dtype} compute{kept}; peak {peak / 1e12:.1f} TFLOP/s per device",
        f"assumes: matrix products at {shares[0][1]:.0%}-{shares[-1][1]:.0%} of peak by size, "
        f"attention {attention[0]:.0%} forward / {attention[1]:.0%} backward, memory "
        f"{c['memory_bandwidth'] / 1e9:.0f} GB/s, {c['op_overhead'] * 1e6:.1f} us per op; links "
        f"{c['intra_bandwidth'] / 1e9:.0f} GB/s in a node, {c['inter_bandwidth'] / 1e9:.0f} GB/s "
        f"across; gradient sums in {BUCKET_CAP_MB:.0f} MiB buckets overlapping backward, other "
        f"communication in line (docs/cost.md)",
    ]


def format_search(data: dict, result, built) -> str:
    """The searched plan (``built``, its JSON ``data``; ``result``: the search's, None where
    not at hand): mesh, predicted time, MFU and memory, the meshes tried, the time,
    communication and memory layer by layer, and every op's layouts with named dims."""
    pred = data.get("pipeline", {}).get("one_stage_one_microbatch") or data["predicted"]
    nodes = f" (graph of {result.graph.size[0]} decision nodes)" if result is not None else ""
    lines = _headline(data, pred) + [f"search '{pred['search']}' {pred['search_s']:.2f} s{nodes}"]
    lines += experts(built) + _sequence(built) + _assumptions(data)
    job = data["predicted"]  # a command's times, where it set them (PlanJob.show)
    if "capture_s" in job:
        lines.append(f"capture {job['capture_s']:.2f} s, end to end {job['end_to_end_s']:.2f} s")
    lines += _meshes(data, pred) + _copies(pred)
    lines += format_layers(pred.get("layers", []), pred["peak_memory_bytes"])
    lines += _named_strategies(data, built)
    lines += [f"warning: {w}" for w in data.get("warnings", [])]
    return "\n".join(lines)


def _headline(data: dict, pred: dict) -> list[str]:
    """The mesh, step, MFU and memory per device; for a stage plan (a pipeline's), what the
    search priced a stage by: the whole model, one micro-batch, on that stage's sub-mesh,
    which is no device's step or memory (the pipeline's are above it)."""
    mesh = " x ".join(f"{k}({v})" for k, v in data["mesh"].items())
    kinds = ", ".join(f"{k} {human_bytes(v)}" for k, v in pred.get("memory_bytes", {}).items())
    if "pipeline" in data:
        return [
            f"stage plan: mesh {mesh}, one stage's sub-mesh; priced for the whole model and one "
            f"micro-batch: {pred['step_time_s'] * 1e3:.2f} ms, "
            f"{human_bytes(pred['peak_memory_bytes'])} (ZeRO stage {data.get('zero', 0)}: "
            f"{kinds}); a stage runs its share of it",
        ]
    return [
        f"mesh {mesh} on {data['cluster']['name']} "
        f"({data['cluster']['nodes']} x {data['cluster']['devices_per_node']} devices)",
        f"predicted step {pred['step_time_s'] * 1e3:.2f} ms, MFU {pred['mfu'] * 100:.1f}%, "
        f"peak memory {human_bytes(pred['peak_memory_bytes'])} per device",
        f"ZeRO stage {data.get('zero', 0)}; memory per device: {kinds}",
    ] + offload_lines(data, pred)


def offload_lines(data: dict, pred: dict) -> list[str]:
    """What the plan keeps off the device (docs/parallelism/offload.md): the host's and NVMe's bytes
    per device and the seconds the step waits for the offload."""
    if not data.get("offload"):
        return []
    kinds = ", ".join(f"{k}={v}" for k, v in data["offload"].items())
    tiers = "; ".join(
        f"{tier} {human_bytes(pred[key]['total'])}"
        for tier, key in (("host", "host_memory_bytes"), ("NVMe", "nvme_memory_bytes"))
    )
    return [f"offload {kinds}: {tiers} per device; the step waits {pred['offload_s']:.3f} s"]


def _copies(pred: dict) -> list[str]:
    """The copies planned (docs/parallelism/copies.md): the communication the step waits for
    with them and with the same copies run one after another, and the copies tried."""
    if "copies" not in pred:
        return []
    lines = [
        f"copies {pred['copies']}: exposed communication {pred['exposed_comm_s'] * 1e3:.3f} ms, "
        f"{pred['exposed_comm_without_copies_s'] * 1e3:.3f} ms without copies (the copies one "
        "after another)"
    ]
    if pred.get("copies_tried"):
        tried = ", ".join(
            f"{row['copies']}: {row['step_s'] * 1e3:.2f} ms (exposed communication "
            f"{row['exposed_comm_s'] * 1e3:.3f} ms)"
            for row in pred["copies_tried"]
        )
        lines.append(f"copies tried (predicted step, each searched): {tried}")
    return lines


def human_bytes(nbytes: float) -> str:
    """Bytes in the unit that shows them: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale or unit == "MiB" and nbytes >= 2**17:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _meshes(data: dict, pred: dict | None = None) -> list[str]:
    """The meshes tried: the estimate's step time where it priced them (the chosen one is
    the headline's), else the search's objective; a bound is a bound of the objective, shown
    beside the chosen mesh's objective (the quantity it was compared with)."""
    pred = pred or data["predicted"]
    lines = ["meshes tried (predicted step; ~ the search's objective where not predicted):"]
    chosen = (data["mesh"], data.get("zero", 0))
    best = pred.get("search_objective_s")
    for row in pred["meshes"]:
        shape = "x".join(str(v) for v in row["mesh"].values()) + f" ZeRO {row.get('zero', 0)}"
        if "step_s" not in row:
            if row.get("skipped") == "memory":
                least = human_bytes(row["least_memory"])
                lines.append(f"  {shape:>15}: does not fit: needs at least {least}")
                continue
            bound = f"{row['bound_s'] * 1e3:.2f} ms"
            if row.get("skipped"):
                than = f" (the chosen's: {best * 1e3:.2f} ms)" if best else ""
                lines.append(f"  {shape:>15}: not searched: its objective at least {bound}{than}")
            else:
                lines.append(f"  {shape:>15}: does not fit, bound {bound}")
            continue
        mark = "*" if (row["mesh"], row.get("zero", 0)) == chosen else " "
        seconds, memory = row.get("predicted_s"), row.get("predicted_memory")
        if mark == "*":
            seconds, memory = pred["step_time_s"], pred["peak_memory_bytes"]
        step = f"{seconds * 1e3:.2f} ms" if seconds else f"~{row['step_s'] * 1e3:.2f} ms"
        size = human_bytes(memory) if memory else "~" + human_bytes(row["memory"])
        objective = f" (objective ~{row['step_s'] * 1e3:.2f} ms)" if mark == "*" and best else ""
        lines.append(f"{mark} {shape:>15}: {step}, {size}{objective}")
    lines.append("  (* chosen)")
    return lines


def format_layers(rows: list[dict], peak_bytes: float) -> list[str]:
    """The step layer by layer (a repeated block list once, per block, with its count); the
    total counts every block and equals the headline."""
    if not rows:
        return []
    width = max(len(r["layer"]) for r in rows)
    head = f"  {'layer'.ljust(width)}  blocks  compute ms  comm ms  memory"
    lines = ["per layer (a repeated block's values are one block's):", head]
    for r in rows:
        lines.append(
            f"  {r['layer'].ljust(width)}  {r['blocks']:>6}  {r['compute_s'] * 1e3:>10.3f}  "
            f"{r['comm_s'] * 1e3:>7.3f}  {human_bytes(r['memory_bytes'])}"
        )
    compute = sum(r["blocks"] * r["compute_s"] for r in rows)
    comm = sum(r["blocks"] * r["comm_s"] for r in rows)
    memory = sum(r["blocks"] * r["memory_bytes"] for r in rows)
    lines.append(
        f"  {'total'.ljust(width)}  {'':>6}  {compute * 1e3:>10.3f}  {comm * 1e3:>7.3f}  "
        f"{human_bytes(memory)}  = step {(compute + comm) * 1e3:.2f} ms, "
        f"peak {human_bytes(peak_bytes)}"
    )
    return lines


def experts(built) -> list[str]:
    """One line per experts op of the plan: how its experts are spread and their tokens moved."""
    import torch

    from autoshard.ops.experts import axes_of, dispatch_group

    lines = []
    seen = set()
    for info in built.graph.ops():
        key = built.graph.key_pattern(info)
        if info.node.target is not torch.ops.autoshard.experts.default or key in seen:
            continue
        seen.add(key)
        strategy = built.nodes[info.node.name].strategy
        weights = strategy.ins[3]
        total, held = weights.shape[0], weights.local_shape()[0]
        axes = axes_of(weights, 0)
        group = dispatch_group(strategy, weights.ranks[0])
        where = f"over {'*'.join(axes)}" if axes else "on every device"
        how = (
            f"tokens dispatched and combined by all-to-all in groups of {len(group)}"
            if len(group) > 1
            else "each device its experts' share of its tokens (summed)"
            if axes
            else "each device every expert on its tokens"
        )
        lines.append(f"experts {key}: {total} {where}, {held} a device; {how}")
    return lines


def _sequence(built) -> list[str]:
    """How the plan splits the inputs' sequence (context parallelism) and computes attention
    over it."""
    from autoshard.search.plans import attention_methods

    lines = []
    for name, layout in built.inputs.items():
        if len(layout.shape) >= 2:
            axes = [a for _, a in layout.factors[1] if a >= 0]
            if axes:
                ways = layout.shape[1] // layout.local_shape()[1]
                named = " x ".join(layout.axis_names[a] for a in axes)
                lines.append(f"sequence of input {name}: split {ways} ways over {named}")
    return lines + attention_methods(built)


def _named_strategies(data: dict, built) -> list[str]:
    """Each decision op's layouts with named dims (``x[b@dp, s, in] -> [b@dp, s, out]``)."""
    from autoshard.search.describe import describe_input, describe_op, dim_names

    og = built.graph
    names = dim_names(og)
    first = {}
    for info in og.ops():
        first.setdefault(og.key_pattern(info), info.node)
    width = max((len(k) for k in data["strategies"]), default=10)
    lines = ["layouts (dim@axis: split over that mesh axis; {sum:axis}: partial sums):"]
    for key in data["strategies"]:
        node = first.get(key)
        if node is not None and node.name in built.nodes:
            text = describe_op(og, node, built.nodes[node.name].strategy, names)
            lines.append(f"  {key.ljust(width)}  {text}")
    for name, layout in built.inputs.items():
        lines.append(f"  input {name}: {describe_input(layout, og.by_name[name], names)}")
    return lines


__all__ = ["experts", "format_layers", "format_search", "human_bytes", "offload_lines"]
