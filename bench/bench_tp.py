"""Megatron tensor parallel: autoshard against DTensor's ``parallelize_module``, in the same run.

The Llama reference model (hidden 256, 2 layers, 8 heads, 4 kv heads, ffn 512, seq 64, batch 8,
AdamW, float32) on a ``{"tp": N}`` mesh, its layers split the same way both ways: q, k, v, w1
and w3 by columns, wo and w2 by rows (attention head-split), embedding, norms and output
replicated. autoshard: ``parallelize(model, batch, {"tp": N}, strategies)``. DTensor:
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` as torch's tensor-parallel
tutorial sets them, the attention told its local head counts. One step of each a round, the
order turning around every round (``bench.timing.in_turns``); the ratio is the median over
rounds of the two steps' ratio, times of the slowest rank. Bytes sent per rank by the ring
formulas: autoshard's counting layer, and the same formulas over the functional collectives
DTensor issues. Memory per rank:
parameters, gradients and the distinct storages autograd saves for backward.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from typing import Any

import torch

from bench.timing import in_turns, paired_ratio

NAME = "tp"

STEPS, WARMUP = 20, 3
BATCH = 8

_COL = ((None, None, None), ("tp", None))
_ROW = ((None, None, "tp"), (None, "tp"))
STRATEGIES = {
    "layers.*.attention.w[qkv]": _COL,
    "layers.*.attention.wo": _ROW,
    "layers.*.feed_forward.w[13]": _COL,
    "layers.*.feed_forward.w2": _ROW,
}


def _model():
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config(
        "llama", vocab=512, seq=64, layers=2, heads=8, kv_heads=4, hidden=256, ffn=512
    )
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


def _dtensor_tp(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(block, mesh, plan)
        block.attention.num_heads //= tp  # the local heads, as the tutorial adjusts them
        block.attention.num_kv_heads //= tp
    return model


#: DTensor's functional collectives by the counting layer's names
_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class _FunctionalBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes per rank of the functional collectives DTensor issues, by the ring formulas."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.bytes, self.calls = world, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        from autoshard import comm

        op = str(func).split(".")  # _c10d_functional.all_reduce.default
        kind = _KINDS.get(op[1]) if op[0] == "_c10d_functional" and len(op) > 1 else None
        if kind is not None:
            x = args[0]
            self.calls += 1
            self.bytes += comm.collective_bytes(kind, self.world, x.numel() * x.element_size())
        return func(*args, **(kwargs or {}))


def _held_bytes(model: torch.nn.Module, step) -> int:
    """Parameters, gradients and the distinct storages autograd saves for backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = _local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return 2 * params + sum(storages.values())


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _rank(steps: int) -> dict:
    import torch.distributed as dist

    from autoshard import comm, parallelize, shard_inputs

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    model, batch = _model()
    theirs = _dtensor_tp(copy.deepcopy(model), tp)
    pm = parallelize(model, batch, {"tp": tp}, STRATEGIES)
    local = shard_inputs(batch, pm)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

    def ours_fb() -> None:
        pm(*local).backward()

    def theirs_fb() -> None:
        theirs(*batch).backward()

    def ours() -> None:
        ours_fb()
        opt.step()
        opt.zero_grad()

    def dtensor() -> None:
        theirs_fb()
        opt_theirs.step()
        opt_theirs.zero_grad()

    times = in_turns({"autoshard": ours, "dtensor": dtensor}, steps, WARMUP)
    with comm.counting() as counted:
        ours_fb()
    counter = _FunctionalBytes(tp)
    with counter:
        theirs_fb()
    held = {"autoshard": _held_bytes(pm, ours_fb), "dtensor": _held_bytes(theirs, theirs_fb)}
    loss, loss_theirs = float(pm(*local)), float(theirs(*batch))
    return {
        "ranks": tp,
        "autoshard_ms": statistics.median(times["autoshard"]) * 1e3,
        "dtensor_ms": statistics.median(times["dtensor"]) * 1e3,
        "paired": paired_ratio(times["autoshard"], times["dtensor"]),
        "autoshard_bytes": sum(c["bytes"] for c in counted.values()),
        "autoshard_calls": sum(c["calls"] for c in counted.values()),
        "dtensor_bytes": counter.bytes,
        "dtensor_calls": counter.calls,
        "autoshard_held": held["autoshard"],
        "dtensor_held": held["dtensor"],
        "loss_difference": abs(loss - loss_theirs),
    }


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    steps = 5 if quick else STEPS
    rows = [run_ranks(_rank, tp, steps, timeout=900)[0] for tp in (2, 4)]
    for r in rows:
        r["ratio"] = r["paired"]["median"]
    return {"steps": steps, "rows": rows}


def summary(result: dict) -> str:
    lines = [
        "Llama reference model (hidden 256, 2 layers, 8 heads, 4 kv heads, ffn 512, seq 64, "
        "batch 8, float32, AdamW) on CPU ranks of 1 thread (gloo), layers split Megatron's way "
        "both ways: autoshard `parallelize(model, batch, {'tp': N}, strategies)` against "
        "DTensor `parallelize_module` with `ColwiseParallel` (q, k, v, w1, w3) and "
        "`RowwiseParallel` (wo, w2); one step of each a round, the order turning around every "
        f"round, {result['steps']} rounds, times of the slowest rank. Ratio: the median over "
        "rounds of autoshard's step / DTensor's step of the same round, with its 95% interval "
        "(bootstrap over rounds). Held: "
        "parameters, gradients and the storages saved for backward, per rank.",
        "",
        "| ranks | autoshard ms | DTensor ms | ratio | 95% interval | autoshard B/rank (calls) "
        "| DTensor B/rank (calls) | autoshard held | DTensor held | loss difference |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        interval = f"{r['paired']['low']:.2f}-{r['paired']['high']:.2f}"
        lines.append(
            f"| {r['ranks']} | {r['autoshard_ms']:.1f} | {r['dtensor_ms']:.1f} | "
            f"{r['ratio']:.2f} | {interval} | "
            f"{r['autoshard_bytes'] / 2**20:.2f} MiB ({r['autoshard_calls']}) "
            f"| {r['dtensor_bytes'] / 2**20:.2f} MiB ({r['dtensor_calls']}) | "
            f"{r['autoshard_held'] / 2**20:.1f} MiB | {r['dtensor_held'] / 2**20:.1f} MiB | "
            f"{r['loss_difference']:.1e} |"
        )
    return "\n".join(lines)
