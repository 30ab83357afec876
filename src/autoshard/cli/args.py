"""The ``autoshard`` command line's options: every one with its help line and default shown."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoshard.cost.cluster import PRESETS
from autoshard.layout.text import DTYPE_NAMES
from autoshard.options import ATTENTION_METHODS, RECOMPUTE_MODES, SEARCHES
from autoshard.precision import PRECISIONS
from autoshard.schedule import SCHEDULES

#: the element types by the names a layout's text gives them (f32, bf16, ...)
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items() if dtype.is_floating_point}

_USAGE = """\
autoshard demo                      # plan and train a small GPT on 4 CPU ranks, check it
autoshard redistribute --mesh dp=2,tp=2 --shape 16,32 --src dp,_ --dst _,tp
autoshard plan --model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \\
    --seq 2048 --batch 64 --cluster dgx-h100 --nodes 8 [--json plan.json]
autoshard calibrate --out cpu.json  # measure this machine into a cluster spec
"""

#: the values an option may take, the same wherever it is given
CHOICES: dict[str, Any] = {
    "search": SEARCHES,
    "zero": [0, 1, 2, 3],
    "precision": list(PRECISIONS),
    "attention": ATTENTION_METHODS,
    "schedule": SCHEDULES,
    "recompute": RECOMPUTE_MODES,
}
_ATTENTION = "how attention computes over a split sequence (left out: searched)"
#: plan's and train's pipeline flags but --pp: any of them plans stages; those left out are
#: searched
_PIPELINE_HELP = {
    "microbatches": "micro-batches a step (they divide the batch; left out: searched)",
    "schedule": "pipeline schedule (left out: searched)",
    "virtual_stages": "stages a rank of interleaved-1f1b (left out: 2)",
    "recompute": "recompute of the repeated blocks in backward (left out: searched)",
}

_DEMO_HELP = {
    "ranks": "local CPU ranks (processes)",
    "steps": "training steps",
    "layers": "GPT blocks",
    "hidden": "hidden size",
    "heads": "attention heads",
    "seq": "sequence length (bytes)",
    "batch": "global batch (sequences)",
    "lr": "AdamW learning rate",
    "search": "plan search over the ranks' meshes",
    "every": "steps between metrics lines",
}

_TRAIN_HELP = {
    "steps": "optimizer steps in all",
    "batch_size": "global batch (samples)",
    "lr": "AdamW learning rate",
    "search": "plan search (not with --plan)",
    "plan": "a plan JSON file (autoshard plan --json)",
    "zero": "ZeRO stage",
    "precision": "compute precision (float32 master weights)",
    "clip": "clip the gradient norm to this",
    "checkpoint_dir": "checkpoints go here; a run resumes from the latest one in it",
    "checkpoint_every": "steps between checkpoints (0: none)",
    "log": "metrics of every step, one JSON per line",
    "log_every": "steps between printed lines",
    "seed": "data order and dropout seed",
    "cluster": "cluster preset or spec the search prices",
    "picture": "draw the loss and throughput of the metrics log here at the end (matplotlib)",
    "timeout": "the longest a rank waits for the others in a collective; then every rank "
    "stops and the ones that waited name the ranks that never arrived",
    "tp": "tensor-parallel degree (left out: searched)",
    "cp": "context-parallel degree: every sequence split over this many ranks",
    "attention": _ATTENTION,
    "ep": "expert-parallel degree: a mesh of dp x ep (x cp x tp where given), each MoE "
    "layer's experts split over ep",
    "sequence_parallel": "split every op over the tensor-parallel axes where it can be "
    "(Megatron's)",
    "copies": "cut each rank's batch into this many copies whose collectives overlap each "
    "other's compute (docs/parallelism/copies.md; 1: none)",
    "restart": "train from step 1 even where --checkpoint-dir holds checkpoints",
    "servers": "parameter servers: the first ranks hold the model's sparse tables by rows, the "
    "rest train as workers (docs/parallelism/parameter-server.md; 0: none)",
    "staleness": "with --servers: steps a worker may run ahead of its rows' oldest update "
    "(left out: synchronous)",
    "pp": "pipeline stages (left out: searched when another pipeline flag is given, else none)",
    **_PIPELINE_HELP,
}
_METAVARS = {"picture": "FILE.png", "timeout": "SECONDS"}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default after its help."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return f"autoshard {installed('autoshard')} (torch {torch.__version__})"
    except PackageNotFoundError:
        return f"autoshard (not installed; torch {torch.__version__})"


def build_parser(
    runs: Mapping[str, Callable[[argparse.Namespace], int]],
) -> argparse.ArgumentParser:
    """The parser; ``runs`` maps each command to what runs it (``args.run``)."""
    from autoshard.cli.demo import DemoConfig
    from autoshard.cli.simulate import add_options

    parser = argparse.ArgumentParser(
        prog="autoshard", description=_USAGE, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument("--debug", action="store_true", help="show the whole traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, formatter_class=_Formatter)
        p.set_defaults(run=runs[name])
        return p

    demo = command(
        "demo", "plan and train a small GPT on local CPU ranks, checked against one process"
    )
    _settings(demo, DemoConfig(), _DEMO_HELP, search={"choices": ["optimal", "recursive"]})
    demo.add_argument(
        "--layouts",
        action="store_true",
        help="instead: move a tensor between the layouts of Z = (X*W)*V on 4 ranks",
    )
    _redistribute_options(
        command("redistribute", "print the least-bytes redistribution plan of a tensor")
    )
    _plan_options(command("plan", "search the fastest plan of a model on a cluster"))
    add_options(command("simulate", "play a pipeline schedule: its timeline, bubble, memory"))
    _train_options(command("train", "plan and train your own model under torchrun"))
    cal = command("calibrate", "measure this machine into a cluster spec JSON")
    cal.add_argument("--out", default="cluster.json", help="where to write the cluster spec")
    cal.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="local ranks to time collectives on (CPU: 2; CUDA: every GPU here)",
    )
    cal.add_argument("--threads", type=int, default=1, help="threads per CPU rank")
    cal.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="what to measure: CPU ranks over gloo, or GPUs over NCCL (auto: CUDA where present)",
    )
    return parser


def _settings(p: argparse.ArgumentParser, config: Any, helps: dict[str, str], **given) -> None:
    """An option for each field of ``config`` that ``helps`` names, its default the field's
    and its type the field's annotation (``int | None``: int), a bool a switch; ``given``:
    an option's own keywords of ``add_argument`` (its choices, parser, metavar)."""
    for field in dataclasses.fields(config):
        if field.name not in helps:
            continue
        flag, default = f"--{field.name.replace('_', '-')}", getattr(config, field.name)
        if field.type == "bool":
            p.add_argument(flag, action="store_true", help=helps[field.name])
            continue
        kind = {"int": int, "float": float}.get(str(field.type).partition(" ")[0], str)
        keywords = {
            "type": kind,
            "choices": CHOICES.get(field.name),
            "metavar": _METAVARS.get(field.name),
        }
        keywords |= given.get(field.name, {})
        p.add_argument(flag, default=default, help=helps[field.name], **keywords)


def _redistribute_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", required=True, help="axis sizes, major first: dp=2,tp=2")
    p.add_argument("--shape", required=True, help="global tensor shape: 16,32")
    p.add_argument(
        "--src", required=True, help="axes per dim, _ for none: dp,_ ; dp+tp,_ ; _,_,P:tp"
    )
    p.add_argument("--dst", required=True, help="the layout to move to, in the form of --src")
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES), help="element type")
    p.add_argument(
        "--picture",
        metavar="STEM",
        help="draw both layouts' tiles by rank: STEM-src.png and STEM-dst.png (matplotlib)",
    )


def _count_or_auto(what: str) -> Callable[[str], int | str]:
    """An option's type: a positive int (a number of ``what``), or ``auto``."""

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a number of {what} or auto") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text}: at least 1")
        return value

    return parse


def _train_options(p: argparse.ArgumentParser) -> None:
    from autoshard.cli.train import TrainConfig

    p.add_argument(
        "target",
        help="module:function returning (model, dataset or batch[, "
        "loss_fn]) or a dict; or a TOML file with a [train] table of these options",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node")
    for flag, what in (
        ("nnodes", "nodes"),
        ("node-rank", "this node's rank"),
        ("master-addr", "rank 0's host"),
        ("master-port", "rank 0's port"),
    ):
        p.add_argument(f"--{flag}", help=f"{what}, passed to torchrun")
    _settings(p, TrainConfig(""), _TRAIN_HELP)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The defaults and types of ``autoshard plan``'s settings (its flags, as ``_settings``
    reads a config)."""

    model: str = "llama"
    rows: int | None = None
    model_fn: str | None = None
    every_block: bool = False
    layers: int = 2
    hidden: int = 256
    heads: int = 8
    kv_heads: int | None = None
    ffn: int | None = None
    experts: int | None = None
    top_k: int | None = None
    vocab: int = 32000
    untie_embeddings: bool = False
    seq: int | None = None
    batch: int | None = None
    precision: str = "bf16"
    dtype: str | None = None
    cluster: str = "dgx-h100"
    nodes: int | None = None
    devices: int | None = None
    memory_gib: float | None = None
    search: str = "optimal"
    json: str | None = None
    picture: str | None = None
    tp_across_nodes: bool = False
    tp: int | None = None
    zero: int | None = None
    cp: int = 1
    attention: str | None = None
    sequence_parallel: bool = False
    copies: int | str = 1
    offload: list | None = None
    nvme: str | None = None
    pp: int | str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None


_PLAN_HELP = {
    "model": "reference model to plan (not with --model-fn); moe: llama with a mixture of "
    "experts for its feed-forward; dlrm: its tables priced on parameter servers, split by "
    "rows, replicated",
    "rows": "with --model dlrm: rows of each table (None: 1000)",
    "model_fn": "module:function returning (model, dataset or batch[, loss_fn]) or a dict, as "
    "for train; modules of the current directory are found",
    "every_block": "with --model-fn: capture every block of a list of like blocks (by default "
    "two are captured and all priced)",
    "layers": "blocks (two are planned, all priced)",
    "hidden": "hidden size",
    "heads": "attention heads (they divide --hidden)",
    "kv_heads": "key/value heads of grouped-query attention (llama; None: --heads)",
    "ffn": "feed-forward width, each expert's for moe (None: the model's rule from --hidden)",
    "experts": "experts of each MoE layer (moe)",
    "top_k": "experts each token goes to (moe)",
    "vocab": "vocabulary size",
    "untie_embeddings": "gpt: its own lm_head weight",
    "seq": "sequence length (None: 128; with --model-fn: dim 1 of every input of two or more "
    "dims, None: the data's)",
    "batch": "global batch, sequences per step (None: 8; with --model-fn: dim 0 of every "
    "input, None: the batch's, or 8 samples of the dataset)",
    "precision": "the mixed precision policy planned, as parallelize(precision=...) runs it: "
    "bf16 computes in bfloat16 and keeps float32 master weights, gradients and Adam moments "
    "(docs/precision.md)",
    "dtype": "train in this one dtype throughout instead of a --precision policy (the model, "
    "its gradients and optimizer state all in it)",
    "cluster": f"a preset ({', '.join(PRESETS)}) or a cluster spec JSON file (autoshard calibrate)",
    "nodes": "nodes (None: the preset's)",
    "devices": "devices in all, instead of --nodes (fewer than a node, or whole nodes)",
    "memory_gib": "memory per device in GiB (None: the cluster's)",
    "search": "search algorithm (docs/search.md)",
    "json": "write the plan JSON here ('-': to stdout, no table)",
    "picture": "draw the plan's per-layer time, communication and memory here (matplotlib)",
    "tp_across_nodes": "let tensor-parallel axes span nodes",
    "tp": "tensor-parallel degree, fixed (left out: searched; may span nodes when given)",
    "zero": "ZeRO stage, fixed (left out: searched)",
    "cp": "context-parallel degree: every sequence split over this many devices, a cp mesh "
    "axis (1: none fixed; the search may still split the sequence)",
    "attention": _ATTENTION,
    "sequence_parallel": "split every op over the tensor-parallel axes where it can be: norms, "
    "dropouts and residuals by sequence between the tensor-parallel linears (Megatron's)",
    "copies": "copies each rank's batch is cut into, interleaved so one copy's communication "
    "runs beside another's compute (auto: searched among 1, 2 and 4; docs/parallelism/copies.md)",
    "offload": "keep off the device (docs/parallelism/offload.md): optimizer[=fraction], "
    "parameters (ZeRO 3), activations[=module glob], embeddings[=module glob]; repeat for "
    "several; auto: searched where nothing fits without (left out: nothing offloaded)",
    "nvme": "keep the host's offloaded state in files (under PATH) on the nodes' NVMe",
    "pp": "pipeline stages (1: none; auto: search them beside the plan without; left out: "
    "searched when another pipeline flag is given or nothing fits without stages)",
    **_PIPELINE_HELP,
}


def _plan_options(p: argparse.ArgumentParser) -> None:
    _settings(
        p,
        PlanConfig(),
        _PLAN_HELP,
        model={"choices": ["llama", "gpt", "mlp", "moe", "dlrm"]},
        dtype={"choices": sorted(DTYPES)},
        copies={"type": _count_or_auto("copies")},
        offload={"action": "append", "type": _offload_flag, "metavar": "KIND[=VALUE]"},
        nvme={"nargs": "?", "const": True, "metavar": "PATH"},
        pp={"type": _count_or_auto("stages")},
    )


def _offload_flag(text: str) -> tuple[str, Any]:
    """One ``--offload``: a kind and its value (a fraction, a glob, or the whole)."""
    kind, _, value = text.partition("=")
    if kind == "auto" and not value:
        return kind, True
    if kind == "optimizer":
        try:
            return kind, float(value) if value else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"optimizer={value}: expected a fraction") from None
    if kind in ("activations", "embeddings"):
        return kind, value or "*"
    if kind == "parameters" and not value:
        return kind, True
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected optimizer[=fraction], parameters, activations[=glob], "
        "embeddings[=glob] or auto"
    )


def offload_of(args: argparse.Namespace) -> dict[str, Any] | str | None:
    """What ``--offload`` and ``--nvme`` ask for: the kinds as ``offload=`` takes them,
    "auto" (searched) or None (nothing)."""
    kinds = dict(args.offload or [])
    if kinds.pop("auto", False):
        if kinds or args.nvme:
            raise ValueError("--offload auto searches the offload: give no other kind with it")
        return "auto"
    if args.nvme:  # alone: the whole optimizer's host part, kept in files
        kinds = {"optimizer": 1.0} | kinds | {"nvme": args.nvme}
    return kinds or None


__all__ = ["CHOICES", "DTYPES", "build_parser", "offload_of", "version"]
