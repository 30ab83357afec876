"""The ``autoshard`` command line's options: every one with its help line and default shown."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoshard.cost.cluster import PRESETS

DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}

_USAGE = """\
autoshard demo                      # plan and train a small GPT on 4 CPU ranks, check it
autoshard redistribute --mesh dp=2,tp=2 --shape 16,32 --src dp,_ --dst _,tp
autoshard plan --model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \\
    --seq 2048 --batch 64 --cluster dgx-h100 --nodes 8 [--json plan.json]
autoshard calibrate --out cpu.json  # measure this machine into a cluster spec
"""


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

    _demo_options(
        command(
            "demo", "plan and train a small GPT on local CPU ranks, checked against one process"
        )
    )
    red = command("redistribute", "print the least-bytes redistribution plan of a tensor")
    red.add_argument("--mesh", required=True, help="axis sizes, major first: dp=2,tp=2")
    red.add_argument("--shape", required=True, help="global tensor shape: 16,32")
    red.add_argument(
        "--src", required=True, help="axes per dim, _ for none: dp,_ ; dp+tp,_ ; _,_,P:tp"
    )
    red.add_argument("--dst", required=True, help="the layout to move to, in the form of --src")
    red.add_argument("--dtype", default="f32", choices=sorted(DTYPES), help="element type")
    red.add_argument(
        "--picture",
        metavar="STEM",
        help="draw both layouts' tiles by rank: STEM-src.png and STEM-dst.png (matplotlib)",
    )
    _plan_options(command("plan", "search the fastest plan of a model on a cluster"))
    from autoshard.cli.simulate import add_options

    add_options(command("simulate", "play a pipeline schedule: its timeline, bubble, memory"))
    _train_options(command("train", "plan and train your own model under torchrun"))
    cal = command("calibrate", "measure this machine into a cluster spec JSON")
    cal.add_argument("--out", default="cluster.json", help="where to write the cluster spec")
    cal.add_argument(
        "--ranks", type=int, default=None,
        help="local ranks to time collectives on (CPU: 2; CUDA: every GPU here)",
    )  # fmt: skip
    cal.add_argument("--threads", type=int, default=1, help="threads per CPU rank")
    cal.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="what to measure: CPU ranks over gloo, or GPUs over NCCL (auto: CUDA where present)",
    )  # fmt: skip
    return parser


def _demo_options(p: argparse.ArgumentParser) -> None:
    from autoshard.cli.demo import DemoConfig

    d = DemoConfig()
    p.add_argument("--ranks", type=int, default=d.ranks, help="local CPU ranks (processes)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--layers", type=int, default=d.layers, help="GPT blocks")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length (bytes)")
    p.add_argument("--batch", type=int, default=d.batch, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument(
        "--search",
        default=d.search,
        choices=["optimal", "recursive"],
        help="plan search over the ranks' meshes",
    )
    p.add_argument("--every", type=int, default=d.every, help="steps between metrics lines")
    p.add_argument(
        "--layouts",
        action="store_true",
        help="instead: move a tensor between the layouts of Z = (X*W)*V on 4 ranks",
    )


def _pp(text: str) -> int | str:
    """``--pp``: a positive int, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of stages or auto") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value


def _train_options(p: argparse.ArgumentParser) -> None:
    from autoshard.cli.train import TrainConfig

    d = TrainConfig(target="")
    p.add_argument(
        "target",
        help="module:function returning (model, dataset or batch[, "
        "loss_fn]) or a dict; or a TOML file with a [train] table of these options",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node")
    p.add_argument("--nnodes", default=None, help="nodes, passed to torchrun")
    p.add_argument("--node-rank", default=None, help="this node's rank, passed to torchrun")
    p.add_argument("--master-addr", default=None, help="rank 0's host, passed to torchrun")
    p.add_argument("--master-port", default=None, help="rank 0's port, passed to torchrun")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (samples)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument(
        "--search",
        default=d.search,
        choices=["optimal", "recursive", "propagate"],
        help="plan search (not with --plan)",
    )
    p.add_argument("--plan", default=d.plan, help="a plan JSON file (autoshard plan --json)")
    p.add_argument("--zero", type=int, default=d.zero, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument(
        "--precision",
        default=d.precision,
        choices=["fp32", "bf16", "fp16"],
        help="compute precision (float32 master weights)",
    )
    p.add_argument("--clip", type=float, default=d.clip, help="clip the gradient norm to this")
    p.add_argument(
        "--checkpoint-dir",
        default=d.checkpoint_dir,
        help="checkpoints go here; a run resumes from the latest one in it",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="steps between checkpoints (0: none)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="train from step 1 even where --checkpoint-dir holds checkpoints",
    )
    _pipeline_options(
        p,
        int,
        "pipeline stages (left out: searched when another pipeline flag is given, else none)",
    )
    _train_parallel_options(p)
    _train_output_options(p, d)


def _train_parallel_options(p: argparse.ArgumentParser) -> None:
    """The parallel degrees and layouts ``autoshard train`` may fix (the others searched)."""
    p.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel degree (left out: searched)"
    )
    p.add_argument(
        "--cp",
        type=int,
        default=None,
        help="context-parallel degree: every sequence split over this many ranks",
    )
    p.add_argument(
        "--attention",
        default=None,
        choices=["allgather", "ulysses", "ring"],
        help="how attention computes over a split sequence (left out: searched)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree: a mesh of dp x ep (x cp x tp where given), each MoE "
        "layer's experts split over ep",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split every op over the tensor-parallel axes where it can be (Megatron's)",
    )


def _pipeline_options(p: argparse.ArgumentParser, pp_type: Any, pp_help: str) -> None:
    """Pipeline stages, for ``autoshard plan`` and ``autoshard train``: any of them plans
    stages; those left out are searched."""
    p.add_argument("--pp", type=pp_type, default=None, help=pp_help)
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches a step (they divide the batch; left out: searched)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        choices=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"],
        help="pipeline schedule (left out: searched)",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="stages a rank of interleaved-1f1b (left out: 2)",
    )
    p.add_argument(
        "--recompute",
        default=None,
        choices=["none", "selective", "full"],
        help="recompute of the repeated blocks in backward (left out: searched)",
    )


def _train_output_options(p: argparse.ArgumentParser, d: Any) -> None:
    p.add_argument("--log", default=d.log, help="metrics of every step, one JSON per line")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between printed lines")
    p.add_argument("--seed", type=int, default=d.seed, help="data order and dropout seed")
    p.add_argument("--cluster", default=d.cluster, help="cluster preset or spec the search prices")
    p.add_argument(
        "--picture",
        metavar="FILE.png",
        default=d.picture,
        help="draw the loss and throughput of the metrics log here at the end (matplotlib)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        metavar="SECONDS",
        help="the longest a rank waits for the others in a collective; then every rank stops "
        "and the ones that waited name the ranks that never arrived",
    )


def _plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama",
        choices=["llama", "gpt", "mlp", "moe"],
        help="reference model to plan (not with --model-fn); moe: llama with a mixture of "
        "experts for its feed-forward",
    )
    p.add_argument(
        "--model-fn",
        help="module:function returning (model, dataset or batch[, loss_fn]) or a dict, as "
        "for train; modules of the current directory are found",
    )
    p.add_argument(
        "--every-block",
        action="store_true",
        help="with --model-fn: capture every block of a list of like blocks (by default two "
        "are captured and all priced)",
    )
    p.add_argument("--layers", type=int, default=2, help="blocks (two are planned, all priced)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--heads", type=int, default=8, help="attention heads (they divide --hidden)")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="key/value heads of grouped-query attention (llama; None: --heads)",
    )
    p.add_argument(
        "--ffn",
        type=int,
        default=None,
        help="feed-forward width, each expert's for moe (None: the model's rule from --hidden)",
    )
    p.add_argument("--experts", type=int, default=None, help="experts of each MoE layer (moe)")
    p.add_argument("--top-k", type=int, default=None, help="experts each token goes to (moe)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--untie-embeddings", action="store_true", help="gpt: its own lm_head weight")
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length (None: 128; with --model-fn: dim 1 of every input of two or more "
        "dims, None: the data's)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch, sequences per step (None: 8; with --model-fn: dim 0 of every input, "
        "None: the batch's, or 8 samples of the dataset)",
    )
    _plan_cluster_options(p)
    _plan_pipeline_options(p)


def _plan_pipeline_options(p: argparse.ArgumentParser) -> None:
    _pipeline_options(
        p,
        _pp,
        "pipeline stages (1: none; auto: search them beside the plan without; left out: "
        "searched when another pipeline flag is given or nothing fits without stages)",
    )


def _plan_precision_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        default="bf16",
        choices=["fp32", "bf16", "fp16"],
        help="the mixed precision policy planned, as parallelize(precision=...) runs it: bf16 "
        "computes in bfloat16 and keeps float32 master weights, gradients and Adam moments "
        "(docs/precision.md)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="train in this one dtype throughout instead of a --precision policy (the model, "
        "its gradients and optimizer state all in it)",
    )


def _plan_parallel_options(p: argparse.ArgumentParser) -> None:
    """The parallel degrees and the ZeRO stage a plan may fix (the others are searched)."""
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel degree, fixed (left out: searched; may span nodes when given)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="ZeRO stage, fixed (left out: searched)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: every sequence split over this many devices, a cp "
        "mesh axis (1: none fixed; the search may still split the sequence)",
    )


def _plan_cluster_options(p: argparse.ArgumentParser) -> None:
    _plan_precision_options(p)
    p.add_argument(
        "--cluster",
        default="dgx-h100",
        help=f"a preset ({', '.join(PRESETS)}) or a cluster spec JSON file (autoshard calibrate)",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes (None: the preset's)")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices in all, instead of --nodes (fewer than a node, or whole nodes)",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory per device in GiB (None: the cluster's)",
    )
    p.add_argument(
        "--search",
        default="optimal",
        choices=["optimal", "recursive", "propagate"],
        help="search algorithm (docs/search.md)",
    )
    p.add_argument(
        "--tp-across-nodes", action="store_true", help="let tensor-parallel axes span nodes"
    )
    _plan_parallel_options(p)
    p.add_argument(
        "--attention",
        default=None,
        choices=["allgather", "ulysses", "ring"],
        help="how attention computes over a split sequence (left out: searched)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split every op over the tensor-parallel axes where it can be: norms, dropouts "
        "and residuals by sequence between the tensor-parallel linears (Megatron's)",
    )
    p.add_argument("--json", help="write the plan JSON here ('-': to stdout, no table)")
    p.add_argument(
        "--picture",
        metavar="FILE.png",
        help="draw the plan's per-layer time, communication and memory here (matplotlib)",
    )


__all__ = ["DTYPES", "build_parser", "version"]
