"""The ``autoshard`` command line: what each command does (the options are in ``args``)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import warnings
from typing import Any

import torch

from autoshard.cli import simulate
from autoshard.cli.args import DTYPES as _DTYPES
from autoshard.cli.args import build_parser
from autoshard.layout import Layout
from autoshard.mesh import MeshError, mesh_info
from autoshard.plan_text import format_search
from autoshard.redistribution import redistribution_plan


def _parse_spec(text: str) -> tuple:
    """``dp,_`` or ``dp+tp,_`` (several axes on one dim, major first); ``P:tp`` entries mark
    partial axes: ``_,_,P:tp``."""
    parts = text.split(",")
    partial = [axis for p in parts if p.startswith("P:") for axis in p[2:].split("+")]
    dims = [p for p in parts if not p.startswith("P:")]
    spec = [None if p in ("_", "-", "", "None") else tuple(p.split("+")) for p in dims]
    return tuple(s[0] if s and len(s) == 1 else s for s in spec), tuple(partial)


def _layouts(shape: tuple, mesh: Any, dtype: torch.dtype, *texts: str) -> list[Layout]:
    """The layouts of a tensor of ``shape`` on ``mesh`` that ``texts`` name (``_parse_spec``)."""
    return [
        Layout.from_named(shape, spec, mesh, partial=partial, dtype=dtype)
        for spec, partial in map(_parse_spec, texts)
    ]


def _redistribute_command(args: argparse.Namespace) -> int:
    try:
        mesh = mesh_info(args.mesh).as_dict()
    except MeshError as err:
        raise MeshError(f"--mesh: {err}") from None
    shape = tuple(int(s) for s in args.shape.split(","))
    layouts = _layouts(shape, mesh, _DTYPES[args.dtype], args.src, args.dst)
    print(redistribution_plan(*layouts))
    if args.picture:
        from autoshard.pictures import layout_picture

        for end, layout in zip(("src", "dst"), layouts, strict=True):
            print(f"picture: {layout_picture(layout, f'{args.picture}-{end}.png')}")
    return 0


def _demo_rank() -> list[str]:
    import torch.distributed as dist

    from autoshard import comm
    from autoshard.mesh import init_mesh
    from autoshard.redistribution import gather_tensor, redistribute, shard_tensor

    mesh = init_mesh({"dp": 2, "tp": 2})
    full = torch.randn(16, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cases = [  # the layouts in --src's form
        ("data parallel -> whole (AllGather)", "dp,_", "_,_"),
        ("rows -> columns (AllToAll)", "dp+tp,_", "_,dp+tp"),
        ("pending sum over tp -> rows (ReduceScatter)", "dp,_,P:tp", "dp+tp,_"),
        ("dp x tp -> tp x dp (pairwise exchange)", "dp,tp", "tp,dp"),
    ]
    lines = []
    for title, *texts in cases:
        src, dst = _layouts(full.shape, mesh, full.dtype, *texts)
        with comm.counting() as counted:
            out = redistribute(shard_tensor(full, src), src, dst)
        if not torch.equal(gather_tensor(out, dst), full):
            raise RuntimeError(f"{title}: wrong result on rank {dist.get_rank()}")
        sent = sum(c["bytes"] for c in counted.values())
        plan = redistribution_plan(src, dst)
        lines.append(
            f"{title}\n{plan}\n  rank {dist.get_rank()}: sent {sent} B, result equals the "
            "global tensor"
        )
    return lines


def _demo_command(args: argparse.Namespace) -> int:
    if not args.layouts:
        from autoshard.cli.demo import DemoConfig, run_demo

        given = {f.name for f in dataclasses.fields(DemoConfig)} & set(vars(args))
        run_demo(DemoConfig(**{name: getattr(args, name) for name in given}))
        return 0
    from autoshard.testing import run_ranks

    results = run_ranks(_demo_rank, 4, timeout=120)
    print("\n\n".join(results[0]))
    print("\nall 4 ranks agree with the single-device tensor")
    return 0


def _reference_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """A reference model with two of its blocks, on the meta device, and its example batch
    (the model returns its loss)."""
    from autoshard.models import build, reference_config

    named = ("hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k")
    sizes = {name: getattr(args, name) for name in named}
    if args.untie_embeddings:
        sizes["tie_embeddings"] = False
    config = reference_config(args.model, layers=min(args.layers, 2), seq=args.seq or 128, **sizes)
    with torch.device("meta"):
        return build(config), config.example_batch(args.batch or 8)


def _plan_command(args: argparse.Namespace) -> int:
    import time

    from autoshard.cli.plan_pipeline import PlanJob
    from autoshard.cli.user_fn import plan_inputs
    from autoshard.graph import BlocksDiffer, blocks_cut
    from autoshard.search.driver import paused_gc

    start = time.perf_counter()
    with paused_gc():  # capture too makes many objects (docs/search.md)
        spec = _planned_cluster(args)
        if args.model == "dlrm" and not args.model_fn:
            return _plan_tables(args, spec)
        if args.model_fn:
            model, example, loss_fn = plan_inputs(args.model_fn, args.batch, args.seq)
            depth = None
        else:
            (model, example), depth, loss_fn = _reference_model(args), {"layers": args.layers}, None
        model, example, policy = _planned_precision(args, model, example)
        job = PlanJob(args, spec, model, example, depth, loss_fn, policy, start)
        if args.model_fn and not args.every_block:  # like blocks captured two, priced all
            try:
                with blocks_cut(model) as cut:
                    return _planned(dataclasses.replace(job, depth=cut or None))
            except BlocksDiffer as err:
                print(f"autoshard: {err}; capturing every block", file=sys.stderr)
        return _planned(job)


def _planned(job: Any) -> int:
    """The plan of the job's model."""
    from autoshard.cli.plan_pipeline import pipeline_plan

    opts = job.options()
    staged = opts.replace(pp=None if opts.pp == 1 else opts.pp).staged
    if job.args.copies == "auto" and (staged or job.args.pp == "auto"):
        raise ValueError("--copies auto is searched without stages; give stages a count")
    if job.args.copies != 1 and job.args.offload:
        raise ValueError("--offload: not yet planned with copies")
    if job.args.pp != "auto" and staged:
        # a pipeline flag given: the other pipeline flags are searched
        return pipeline_plan(job)
    return _searched(job)


def _searched(job: Any) -> int:
    """The plan without stages, or with them where none fits without."""
    import time

    from autoshard.cli.args import offload_of
    from autoshard.cli.plan_pipeline import pipeline_plan
    from autoshard.graph import capture, check_depth
    from autoshard.graph.batches import micro_batch_graphs
    from autoshard.search import PlanningError
    from autoshard.search.copies import batch_of, search_copies, searched_with
    from autoshard.search.result_plan import build_plan

    dtype = job.policy.compute
    captured = capture(job.model, job.example, {}, loss_fn=job.loss_fn, train=True, dtype=dtype)
    check_depth(captured, job.depth)
    captured_s = time.perf_counter() - job.start
    devices = job.spec.num_devices
    try:
        keywords = {**job.options().search_keywords(), "offload": offload_of(job.args)}
        search = searched_with(devices, job.spec, depth=job.depth, **keywords)
        if job.args.copies == 1:
            result = search(captured, 1)
            built = build_plan(captured, result, job.spec)
        else:  # each copy count searched on one copy's graph
            micro = micro_batch_graphs(job.model, job.example, loss_fn=job.loss_fn, dtype=dtype)
            result, built = search_copies(
                lambda k: captured if k == 1 else micro(k),
                batch_of(captured),
                job.args.copies,
                search,
                job.spec,
            )
    except PlanningError as err:
        if job.args.pp not in (None, "auto") or job.args.copies != 1:  # --pp 1: no stages
            print(f"autoshard: error: {err}", file=sys.stderr)
            return 3
        print(f"without pipeline stages: {_one_line(err)}", file=sys.stderr)
        print("searching pipeline stages", file=sys.stderr)
        return pipeline_plan(job)

    def show() -> int:
        return _show_plan(job, built, result, captured_s)

    if job.args.pp == "auto":  # the pipeline search's best against the plan without stages
        return pipeline_plan(job, baseline=(built.predicted.step_time, show))
    return show()


def _plan_tables(args: argparse.Namespace, spec: Any) -> int:
    """``--model dlrm``: its tables priced three ways (``cost.tables``)."""
    from autoshard.cost.tables import TableShape, describe
    from autoshard.models import reference_config

    c = reference_config("dlrm", rows=args.rows)
    shape = TableShape(c.num_tables, c.num_rows, c.embedding_dim, c.bag_size, args.batch or 256)
    print("\n".join(describe(shape, spec.num_devices, spec)))
    return 0


def _planned_cluster(args: argparse.Namespace):
    """The cluster ``--cluster``, ``--nodes``/``--devices`` and ``--memory-gib`` name."""
    from autoshard.cost import cluster_spec
    from autoshard.search.driver import mesh_shapes

    spec = cluster_spec(args.cluster)
    for flag in ("nodes", "devices"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag} {getattr(args, flag)}: at least 1")
    devices = args.devices or (args.nodes * spec.devices_per_node if args.nodes else None)
    spec = cluster_spec(spec, devices)
    # --cp and --tp divide the devices, told before any capture (the search's own check)
    mesh_shapes(spec.num_devices, spec, cp=args.cp, tp_degree=args.tp)
    if args.memory_gib:
        spec = dataclasses.replace(spec, memory_bytes=args.memory_gib * 2**30)
    return spec


def _planned_precision(args: argparse.Namespace, model, example):
    """The model and batch to plan and the precision policy a run keeps them under:
    ``--dtype`` casts them (one dtype throughout, no policy), else ``--precision``'s policy
    with the model's own dtype for its master weights."""
    from autoshard.precision import precision_policy

    if args.dtype is not None:
        import torch.utils._pytree as pytree

        dtype = _DTYPES[args.dtype]

        def cast(t: Any) -> Any:
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return model.to(dtype), pytree.tree_map(cast, example), precision_policy("fp32")
    return model, example, precision_policy(args.precision).resolve(model)


def _show_plan(job: Any, built: Any, result: Any, captured_s: float) -> int:
    """The plan without stages: its JSON (``--json``, with the options it was made under),
    its table and its picture."""
    args, data = job.args, built.json
    copies = data["predicted"].get("copies", 1)
    opts = job.options()
    offload = data.get("offload", opts.offload)  # as searched
    data["options"] = opts.replace(copies=copies, offload=offload).as_json()
    job.show(data, captured_s, lambda: [format_search(data, result, built)])
    if args.picture:
        from autoshard.pictures import plan_picture

        print(f"picture: {plan_picture(data, args.picture)}")
    return 0


def _train_command(args: argparse.Namespace) -> int:
    from autoshard.cli.train import TrainConfig, launch, worker
    from autoshard.cli.train_check import check

    if args.target.endswith(".toml"):
        cfg = TrainConfig.from_toml(args.target)
    else:
        names = [f.name for f in dataclasses.fields(TrainConfig)]
        cfg = TrainConfig(**{n: getattr(args, n) for n in names})
    if "LOCAL_RANK" in os.environ:  # already a rank torchrun started (the user's torchrun)
        worker(cfg)
        return 0
    check(cfg, args.nproc_per_node, args.nnodes)  # the user's mistakes, before any rank starts
    passed = [
        f"--{flag.replace('_', '-')}={getattr(args, flag)}"
        for flag in ("nnodes", "node_rank", "master_addr", "master_port")
        if getattr(args, flag) is not None
    ]
    return launch(cfg, args.nproc_per_node, passed)


def _calibrate_command(args: argparse.Namespace) -> int:
    from autoshard.cost.calibrate import calibrate

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = args.ranks or (torch.cuda.device_count() if device == "cuda" else 2)
    spec = calibrate(ranks, args.threads, device=device)
    spec.save(args.out)
    gb = 1e9
    print(
        f"host: {spec.host_memory_bytes / gb:.0f} GB, copies {spec.host_bandwidth / gb:.1f} GB/s, "
        f"fused CPU AdamW {spec.host_adam_rate / 1e6:.0f} M elements/s; files "
        f"{spec.nvme_write_bandwidth / gb:.2f} GB/s written, {spec.nvme_read_bandwidth / gb:.2f} "
        "GB/s read"
    )
    if device == "cuda":
        link = "NCCL" if ranks > 1 else "no link measured"
        print(
            f"{args.out}: {spec.flops['bfloat16'] / 1e12:.0f} TFLOP/s bf16, "
            f"{spec.flops['float32'] / 1e12:.0f} TFLOP/s f32, attention "
            f"{spec.attention_efficiency[0]:.2f}/{spec.attention_efficiency[1]:.2f} of peak "
            f"({spec.extra['attention_kernel']}), grouped GEMM {spec.grouped_mm_efficiency:.2f}, "
            f"memory {spec.memory_bandwidth / gb:.0f} GB/s, {link} "
            f"{spec.intra_bandwidth / gb:.0f} GB/s ({ranks} GPUs)"
        )
        return 0
    print(
        f"{args.out}: {spec.flops['float32'] / 1e9:.1f} GFLOP/s f32, "
        f"{spec.flops['float64'] / 1e9:.1f} GFLOP/s f64, memory {spec.memory_bandwidth / gb:.1f} "
        f"GB/s, op overhead {spec.op_overhead * 1e6:.1f} us, gloo {spec.intra_bandwidth / gb:.2f} "
        f"GB/s and {spec.intra_latency * 1e6:.0f} us latency ({ranks} ranks)"
    )
    return 0


#: the errors that are the input's, told in one line (``--debug`` shows the traceback): every
#: error autoshard raises about its input (a mesh's, a layout's, a plan's, a capture's) is a
#: ValueError
_USER_ERRORS = (ValueError, OSError, ImportError)


def _parsed(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = build_parser(
        {
            "demo": _demo_command,
            "redistribute": _redistribute_command,
            "plan": _plan_command,
            "calibrate": _calibrate_command,
            "train": _train_command,
            "simulate": simulate.run,
        }
    )
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # torch's own deprecation notices (pytree's LeafSpec, from torch.export) are not the user's
    # to act on; they would open every command's output.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|copyreg)(\.|$)")
    # no collection while the command is read: one there (the parser's imports may start
    # it) walks every object torch made on import (70 ms)
    was, ends = gc.isenabled(), False
    gc.disable()
    try:
        parser, args = _parsed(argv)
        ends = argv is None and args.command in ("plan", "simulate")
    finally:
        # the collector stays off to the end of a process that plans and exits: the search
        # pauses it (``paused_gc``), and turning it on again after the search would start a
        # full collection over the millions of objects left (0.37 s after Llama-3-8B's plan)
        if was and not ends:
            gc.enable()
    try:
        code = args.run(args)
    except _USER_ERRORS as err:
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
    finally:
        if argv is None:
            # the process's command (not a call from Python): it ends next, and the
            # interpreter's last collection would walk everything the command made (3 s
            # after planning a large model) only to free memory the process gives back
            gc.freeze()
    if ends:
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """The process ends now, with ``code``, its output flushed: a command that planned
    leaves millions of small objects (the search's caches), and freeing them one by one as
    the interpreter shuts down took 0.15 s after Llama-70B's plan, more after larger ones (it
    only returns memory the process gives back whole). Its files are closed already; nothing
    else is pending. Output to a reader that has gone (``| head``) ends it with code 1."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            code = code or 1
    os._exit(code)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
