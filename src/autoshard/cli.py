"""The ``autoshard`` command line.

autoshard demo                      # the seeds' Z = (X*W)*V layouts moved on 4 CPU ranks
autoshard redistribute --mesh dp=2,tp=2 --shape 16,32 --src dp,_ --dst _,tp
"""

from __future__ import annotations

import argparse
import sys

import torch

from autoshard.layout import Layout, LayoutError
from autoshard.redistribute import redistribution_plan

_DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}


def _parse_mesh(text: str) -> dict[str, int]:
    try:
        return {name: int(size) for name, size in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(
            f"--mesh: expected name=size,... such as dp=2,tp=2, got {text!r}"
        ) from None


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
    mesh = _parse_mesh(args.mesh)
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
    return 0


def _demo_rank(verbose: bool) -> list[str]:
    import torch.distributed as dist

    from autoshard import comm, gather_tensor, init_mesh, redistribute, shard_tensor

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
    from autoshard.testing import run_ranks

    results = run_ranks(_demo_rank, 4, False, timeout=120)
    print("\n\n".join(results[0]))
    print("\nall 4 ranks agree with the single-device tensor")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="autoshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="move tensors between layouts on 4 local CPU ranks")
    demo.set_defaults(run=_demo_command)
    plan = sub.add_parser("redistribute", help="print the least-bytes redistribution plan")
    plan.add_argument("--mesh", required=True, help="axis sizes, major first: dp=2,tp=2")
    plan.add_argument("--shape", required=True, help="global tensor shape: 16,32")
    plan.add_argument(
        "--src", required=True, help="axes per dim, _ for none: dp,_ ; dp+tp,_ ; _,_,P:tp"
    )
    plan.add_argument("--dst", required=True, help="same form as --src")
    plan.add_argument("--dtype", default="f32", choices=sorted(_DTYPES))
    plan.set_defaults(run=_redistribute_command)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
