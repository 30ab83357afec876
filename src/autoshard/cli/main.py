"""The ``autoshard`` command line: what each command does (the options are in ``args``)."""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from autoshard.cli.args import DTYPES as _DTYPES
from autoshard.cli.args import build_parser
from autoshard.cost.collectives import BUCKET_CAP_MB
from autoshard.layout import Layout, LayoutError
from autoshard.mesh import MeshError, mesh_info
from autoshard.redistribution import redistribution_plan


def _parse_spec(text: str) -> tuple:
    """``dp,_`` or ``dp+tp,_`` (several axes on one dim, major first); ``P:tp`` entries mark
    partial axes: ``_,_,P:tp``."""
    entries = []
    partial = []
    for part in text.split(","):
        if part.startswith("P:"):
            partial.extend(part[2:].split("+"))
        elif part in ("_", "-", "", "None"):
            entries.append(None)
        else:
            axes = tuple(part.split("+"))
            entries.append(axes[0] if len(axes) == 1 else axes)
    return tuple(entries), tuple(partial)


def _redistribute_command(args: argparse.Namespace) -> int:
    try:
        mesh = mesh_info(args.mesh).as_dict()
    except MeshError as err:
        raise MeshError(f"--mesh: {err}") from None
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = _DTYPES[args.dtype]
    layouts = []
    for text in (args.src, args.dst):
        spec, partial = _parse_spec(text)
        try:
            layouts.append(Layout.from_named(shape, spec, mesh, partial=partial, dtype=dtype))
        except LayoutError as err:
            print(f"autoshard: {err}", file=sys.stderr)
            return 2
    print(redistribution_plan(*layouts))
    if args.picture:
        from autoshard.pictures import layout_picture

        for end, layout in zip(("src", "dst"), layouts, strict=True):
            print(f"picture: {layout_picture(layout, f'{args.picture}-{end}.png')}")
    return 0


def _demo_rank(verbose: bool) -> list[str]:
    import torch.distributed as dist

    from autoshard import comm
    from autoshard.mesh import init_mesh
    from autoshard.redistribution import gather_tensor, redistribute, shard_tensor

    mesh = init_mesh({"dp": 2, "tp": 2})
    full = torch.randn(16, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cases = [
        ("data parallel -> whole (AllGather)", ("dp", None), (None, None), ()),
        ("rows -> columns (AllToAll)", (("dp", "tp"), None), (None, ("dp", "tp")), ()),
        (
            "pending sum over tp -> rows (ReduceScatter)",
            ("dp", None),
            (("dp", "tp"), None),
            ("tp",),
        ),
        ("dp x tp -> tp x dp (pairwise exchange)", ("dp", "tp"), ("tp", "dp"), ()),
    ]
    lines = []
    for title, src_spec, dst_spec, partial in cases:
        src = Layout.from_named(full.shape, src_spec, mesh, partial=partial, dtype=full.dtype)
        dst = Layout.from_named(full.shape, dst_spec, mesh, dtype=full.dtype)
        with comm.counting() as counted:
            out = redistribute(shard_tensor(full, src), src, dst)
        ok = torch.equal(gather_tensor(out, dst), full)
        sent = sum(c["bytes"] for c in counted.values())
        plan = redistribution_plan(src, dst)
        lines.append(
            f"{title}\n{plan}\n  rank {dist.get_rank()}: sent {sent} B, result "
            f"{'equals' if ok else 'DIFFERS FROM'} the global tensor"
        )
        if not ok:
            raise RuntimeError(f"{title}: wrong result on rank {dist.get_rank()}")
    return lines


def _demo_command(args: argparse.Namespace) -> int:
    if not args.layouts:
        from autoshard.cli.demo import DemoConfig, run_demo

        names = ("ranks", "steps", "layers", "hidden", "heads", "seq", "batch", "lr", "search")
        run_demo(DemoConfig(**{n: getattr(args, n) for n in names}, every=args.every))
        return 0
    from autoshard.testing import run_ranks

    results = run_ranks(_demo_rank, 4, False, timeout=120)
    print("\n\n".join(results[0]))
    print("\nall 4 ranks agree with the single-device tensor")
    return 0


def _reference_model(args: argparse.Namespace):
    """A reference model with two of its blocks, on the meta device, its example batch (the
    model returns its loss) and its real depth."""
    from autoshard.models import build, reference_config

    config = reference_config(
        args.model,
        layers=min(args.layers, 2),
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        vocab=args.vocab,
        seq=args.seq,
    )
    with torch.device("meta"):
        model = build(config)
        example = config.example_batch(args.batch)
    return model, example, {"layers": args.layers}, None


def _user_model(target: str):
    from autoshard.cli.train import user_function

    try:
        made = user_function(target)
    except ValueError as err:
        raise ValueError(f"--model-fn {err}") from err
    if not isinstance(made, tuple | list) or len(made) not in (2, 3):
        raise ValueError(
            f"--model-fn {target!r}: expected (model, example_inputs[, loss_fn]), got "
            f"{type(made).__name__}"
        )
    if len(made) == 2:
        return made[0], tuple(made[1]), None, None
    return made[0], tuple(made[1]), None, made[2]


def _plan_command(args: argparse.Namespace) -> int:
    import time

    from autoshard.cost import cluster_spec
    from autoshard.graph import capture
    from autoshard.search import PlanningError, run_search
    from autoshard.search.driver import build_plan

    start = time.perf_counter()
    spec = cluster_spec(args.cluster)
    devices = args.devices or (args.nodes * spec.devices_per_node if args.nodes else None)
    spec = cluster_spec(spec, devices)
    if args.memory_gib:
        from dataclasses import replace

        spec = replace(spec, memory_bytes=args.memory_gib * 2**30)
    if args.model_fn:
        model, example, depth, loss_fn = _user_model(args.model_fn)
    else:
        model, example, depth, loss_fn = _reference_model(args)
    if args.dtype != "f32":
        model = model.to(_DTYPES[args.dtype])
        example = tuple(t.to(_DTYPES[args.dtype]) if t.is_floating_point() else t for t in example)
    if args.pp > 1 or args.recompute != "none":
        return _pipeline_plan(args, spec, model, example, depth, loss_fn, start)
    captured = capture(model, example, {}, loss_fn=loss_fn, train=True)
    captured_s = time.perf_counter() - start
    try:
        result = run_search(
            captured,
            spec.num_devices,
            spec,
            search=args.search,
            depth=depth,
            tp_across_nodes=args.tp_across_nodes,
        )
    except PlanningError as err:
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 3
    built = build_plan(captured, result, spec)
    data = built.json
    data["predicted"]["capture_s"] = captured_s
    data["predicted"]["end_to_end_s"] = time.perf_counter() - start
    _write_json(args.json, data)
    if args.json != "-":
        print(format_search(data, result, built))
    if args.picture:
        from autoshard.pictures import plan_picture

        print(f"picture: {plan_picture(data, args.picture)}")
    return 0


def _write_json(where: str | None, data: dict) -> None:
    """``--json``: the plan to a file, or to stdout for ``-``."""
    import json

    if not where:
        return
    text = json.dumps(data, indent=1)
    if where == "-":
        print(text)
    else:
        with open(where, "w") as f:
            f.write(text + "\n")


def _pipeline_plan(args, spec, model, example, depth, loss_fn, start) -> int:
    """``autoshard plan --pp``: the stage plan for one micro-batch, the stages and schedule
    priced together; the table adds the pipeline's step, bubble and each rank's memory."""
    import time

    from autoshard.graph import capture
    from autoshard.search import PlanningError
    from autoshard.search.pipelined import pipeline_json, plan_stages

    m = args.microbatches or 4 * args.pp
    if args.batch % m:
        print(f"autoshard: error: --microbatches {m} does not divide --batch {args.batch}",
              file=sys.stderr)  # fmt: skip
        return 2
    micro = tuple(t[: t.shape[0] // m] for t in example)
    captured = capture(model, micro, {}, loss_fn=loss_fn, train=True)
    captured_s = time.perf_counter() - start
    try:
        pp_plan = plan_stages(captured, spec.num_devices, spec, args.pp, m, args.schedule,
                              args.virtual_stages, args.recompute, args.search, depth,
                              args.tp_across_nodes)  # fmt: skip
    except (PlanningError, ValueError) as err:
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 3
    data = dict(pp_plan.stage.json)
    data["pipeline"] = pipeline_json(pp_plan, spec.num_devices)
    data["predicted"]["capture_s"] = captured_s
    data["predicted"]["end_to_end_s"] = time.perf_counter() - start
    _write_json(args.json, data)
    if args.json != "-":
        print("\n".join(_pipeline_lines(data, spec)))
        print(format_search(data, pp_plan.result, pp_plan.stage))
    return 0


def _pipeline_lines(data: dict, spec) -> list[str]:
    pipe = data["pipeline"]
    mesh = " x ".join(f"{k}({v})" for k, v in data["mesh"].items())
    lines = [
        f"pipeline: pp({pipe['pp']}) x {mesh} on {spec.num_devices} devices, "
        f"{pipe['schedule']}"
        + (f" ({pipe['virtual_stages']} stages a rank)" if pipe["virtual_stages"] > 1 else "")
        + f", {pipe['microbatches']} micro-batches, recompute {pipe['recompute']}",
        f"predicted step {pipe['step_time_s'] * 1e3:.1f} ms, MFU {pipe['mfu'] * 100:.1f}%, "
        f"bubble {pipe['bubble'] * 100:.1f}%, peak memory {_size(pipe['peak_memory_bytes'])} per "
        f"device (of {_size(spec.memory_bytes)}); a stage sends {_size(pipe['boundary_bytes'])} "
        "per micro-batch",
        "pipeline rank  stages  forward ms  backward ms  parameters  gradients  optimizer  "
        "activations",
    ]
    from autoshard.schedule import make_schedule

    sched = make_schedule(
        pipe["schedule"], pipe["pp"], pipe["microbatches"], pipe["virtual_stages"]
    )
    for r, mem in enumerate(pipe["memory_bytes"]):
        stages = sched.stages_of(r)
        fwd = sum(pipe["stage_seconds"][s][0] for s in stages) * 1e3
        bwd = sum(pipe["stage_seconds"][s][1] for s in stages) * 1e3
        lines.append(
            f"{r:>13}  {','.join(map(str, stages)):>6}  {fwd:>10.2f}  {bwd:>11.2f}  "
            + "  ".join(
                f"{_size(mem[k]):>10}"
                for k in ("parameters", "gradients", "optimizer", "activations")
            )
        )
    lines.append("(the stage plan below is one micro-batch's on one stage's sub-mesh; its "
                 "step and memory are the whole model's, for the search)")  # fmt: skip
    return lines


def _assumptions(data: dict) -> list[str]:
    """What the prediction rests on: the precision planned in and the cluster's efficiencies."""
    c = data["cluster"]
    dtype = data["predicted"].get("dtype", "float32")
    peak = c["flops"].get(dtype) or max(c["flops"].values())
    shares = c.get("matmul_efficiency") or [[0, 1.0]]
    attention = c.get("attention_efficiency", [1.0, 1.0])
    return [
        f"precision: {dtype} compute (--dtype); peak {peak / 1e12:.1f} TFLOP/s per device",
        f"assumes: matrix products at {shares[0][1]:.0%}-{shares[-1][1]:.0%} of peak by size, "
        f"attention {attention[0]:.0%} forward / {attention[1]:.0%} backward, memory "
        f"{c['memory_bandwidth'] / 1e9:.0f} GB/s, {c['op_overhead'] * 1e6:.1f} us per op; links "
        f"{c['intra_bandwidth'] / 1e9:.0f} GB/s in a node, {c['inter_bandwidth'] / 1e9:.0f} GB/s "
        f"across; gradient sums in {BUCKET_CAP_MB:.0f} MiB buckets overlapping backward, other "
        f"communication in line (docs/cost.md)",
    ]


def format_search(data: dict, result, built=None) -> str:
    """The searched plan: mesh, predicted time, MFU and memory, the meshes tried, the time,
    communication and memory layer by layer, and every op's layouts with named dims."""
    pred = data["predicted"]
    mesh = " x ".join(f"{k}({v})" for k, v in data["mesh"].items())
    lines = [
        f"mesh {mesh} on {data['cluster']['name']} "
        f"({data['cluster']['nodes']} x {data['cluster']['devices_per_node']} devices)",
        f"predicted step {pred['step_time_s'] * 1e3:.2f} ms, MFU {pred['mfu'] * 100:.1f}%, "
        f"peak memory {_size(pred['peak_memory_bytes'])} per device",
        f"ZeRO stage {data.get('zero', 0)}; memory per device: "
        + ", ".join(f"{k} {_size(v)}" for k, v in pred.get("memory_bytes", {}).items()),
        f"search '{pred['search']}' {pred['search_s']:.2f} s "
        f"(graph of {result.graph.size[0]} decision nodes)",
    ]
    lines += _assumptions(data)
    if "end_to_end_s" in pred:
        lines.append(f"capture {pred['capture_s']:.2f} s, end to end {pred['end_to_end_s']:.2f} s")
    lines += _meshes(data)
    lines += format_layers(pred.get("layers", []), pred["step_time_s"], pred["peak_memory_bytes"])
    if built is not None:
        lines += _named_strategies(data, built)
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    """Bytes in the unit that shows them: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale or unit == "MiB" and nbytes >= 2**17:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _meshes(data: dict) -> list[str]:
    """The meshes tried: the estimate's step time where it priced them (the chosen one is
    the headline's), else the search's objective."""
    pred = data["predicted"]
    lines = ["meshes tried (predicted step; ~ the search's objective where not predicted):"]
    chosen = (data["mesh"], data.get("zero", 0))
    for row in pred["meshes"]:
        shape = "x".join(str(v) for v in row["mesh"].values()) + f" ZeRO {row.get('zero', 0)}"
        if "step_s" not in row:
            bound = f"{row['bound_s'] * 1e3:.2f} ms"
            why = "not searched: its lower bound" if row.get("skipped") else "does not fit, bound"
            lines.append(f"  {shape:>15}: {why} {bound}")
            continue
        mark = "*" if (row["mesh"], row.get("zero", 0)) == chosen else " "
        seconds, memory = row.get("predicted_s"), row.get("predicted_memory")
        if mark == "*":
            seconds, memory = pred["step_time_s"], pred["peak_memory_bytes"]
        step = f"{seconds * 1e3:.2f} ms" if seconds else f"~{row['step_s'] * 1e3:.2f} ms"
        size = _size(memory) if memory else "~" + _size(row["memory"])
        lines.append(f"{mark} {shape:>15}: {step}, {size}")
    lines.append("  (* chosen)")
    return lines


def format_layers(rows: list[dict], step_s: float, peak_bytes: float) -> list[str]:
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
            f"{r['comm_s'] * 1e3:>7.3f}  {_size(r['memory_bytes'])}"
        )
    compute = sum(r["blocks"] * r["compute_s"] for r in rows)
    comm = sum(r["blocks"] * r["comm_s"] for r in rows)
    memory = sum(r["blocks"] * r["memory_bytes"] for r in rows)
    lines.append(
        f"  {'total'.ljust(width)}  {'':>6}  {compute * 1e3:>10.3f}  {comm * 1e3:>7.3f}  "
        f"{_size(memory)}  = step {(compute + comm) * 1e3:.2f} ms, peak {_size(peak_bytes)}"
    )
    return lines


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


def _train_command(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from autoshard.cli.train import TrainConfig, check, launch, worker

    if args.target.endswith(".toml"):
        cfg = TrainConfig.from_toml(args.target)
    else:
        names = [f.name for f in dataclasses.fields(TrainConfig)]
        cfg = TrainConfig(**{n: getattr(args, n) for n in names})
    if "LOCAL_RANK" in os.environ:  # already a rank torchrun started (the user's torchrun)
        worker(cfg)
        return 0
    check(cfg)  # the user's mistakes, once and before any rank starts
    passed = [
        f"--{flag.replace('_', '-')}={getattr(args, flag)}"
        for flag in ("nnodes", "node_rank", "master_addr", "master_port")
        if getattr(args, flag) is not None
    ]
    return launch(cfg, args.nproc_per_node, passed)


def _calibrate_command(args: argparse.Namespace) -> int:
    from autoshard.cost.calibrate import calibrate

    spec = calibrate(args.ranks, args.threads)
    spec.save(args.out)
    gb = 1e9
    print(
        f"{args.out}: {spec.flops['float32'] / 1e9:.1f} GFLOP/s f32, "
        f"{spec.flops['float64'] / 1e9:.1f} GFLOP/s f64, memory {spec.memory_bandwidth / gb:.1f} "
        f"GB/s, op overhead {spec.op_overhead * 1e6:.1f} us, gloo {spec.intra_bandwidth / gb:.2f} "
        f"GB/s and {spec.intra_latency * 1e6:.0f} us latency ({args.ranks} ranks)"
    )
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the input's, told in one line (``--debug`` shows the traceback)."""
    from autoshard.graph.capture import CaptureError
    from autoshard.search import PlanningError

    return (MeshError, LayoutError, PlanningError, CaptureError, ValueError, OSError, ImportError)


def _simulate_command(args: argparse.Namespace) -> int:
    from autoshard.cli.simulate import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    # torch's own deprecation notices (pytree's LeafSpec, from torch.export) are not the user's
    # to act on; they would open every command's output.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|copyreg)(\.|$)")
    parser = build_parser(
        {
            "demo": _demo_command,
            "redistribute": _redistribute_command,
            "plan": _plan_command,
            "calibrate": _calibrate_command,
            "train": _train_command,
            "simulate": _simulate_command,
        }
    )
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except _user_errors() as err:
        if args.debug:
            raise
        parser.exit(2, f"autoshard: error: {_one_line(err)}\n")
    except Exception as err:
        if args.debug:
            raise
        parser.exit(
            1,
            f"autoshard: internal error: {type(err).__name__}: {_one_line(err)} "
            "(--debug shows where)\n",
        )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
