"""autoshard's context parallelism against torch's experimental ``context_parallel``, in the
same run.

The Llama reference model (2 layers, hidden 256, 8 heads, ffn 512, vocab 128, causal; global
batch 2 of sequence 2048, float32, AdamW) on 2 CPU ranks of 1 thread (gloo), each rank fed
half of every sequence:

- autoshard: ``parallelize(model, batch, {"cp": 2}, attention="ring")`` (key/value blocks
  passed around the ranks, the causal work balanced by dealing each rank an early and a late
  chunk) and ``attention="allgather"`` (the keys and values gathered, each rank's rows masked
  from their offset);
- torch: ``context_parallel(mesh, buffers=[ids, targets, rope tables], ...)`` around forward
  and backward, with its head-tail load balance, the key/value rotation ``"alltoall"`` (its
  ring) and ``"allgather"``, the gradients averaged by ``DistributedDataParallel``.

torch 2.13's ``context_parallel`` handles only the CUDA attention kernels; on CPU the fused
kernel is ``_scaled_dot_product_flash_attention_for_cpu``, so the bench registers that kernel
with it (a sharding rule for the sequence split and a handler calling torch's own
``_templated_ring_attention`` and its backward): torch's ring, run on the CPU kernel.

A step is forward, backward and the optimizer step; each way once a round, the order turning
around every round. Ratio: the median over rounds of autoshard's step over torch's, with its
bootstrap interval. Bytes: what each rank sends in a step, autoshard's counted by its
collectives, torch's by a dispatch mode seeing its functional collectives.
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any

import torch

from bench.timing import in_turns, paired_ratio

NAME = "context"
SEQ, BATCH, HIDDEN, HEADS, FFN, VOCAB, LAYERS = 2048, 2, 256, 8, 512, 128, 2
ROUNDS, WARMUP = 20, 2
#: (autoshard's attention method, torch's key/value rotation) compared
PAIRS = (("ring", "alltoall"), ("allgather", "allgather"))


def _model(seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("llama", layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                              kv_heads=HEADS, ffn=FFN, vocab=VOCAB, seq=seq)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, VOCAB, (BATCH, seq), generator=gen) for _ in range(2))
    return build(config), batch


def _enable_cpu_kernel() -> None:
    """Let torch's context parallelism run the CPU flash-attention kernel: every tensor of it
    split along the sequence (dim 2), and its calls routed to torch's ring (forward) and ring
    backward, as it routes the CUDA kernels."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import (
        expand_to_full_mesh_op_strategy,
        register_op_strategy,
    )
    from torch.distributed.tensor.experimental._context_parallel import _attention

    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    seq = Shard(2)

    @register_op_strategy(forward)
    def _forward_rule(schema: Any) -> Any:  # output, logsumexp, query, key, value
        mesh = schema.get_mesh_from_args()
        return expand_to_full_mesh_op_strategy(mesh, schema, [[seq] * 5], input_index=2)

    @register_op_strategy(backward)
    def _backward_rule(schema: Any) -> Any:  # dq, dk, dv, then every tensor input
        mesh = schema.get_mesh_from_args(validate=False)
        inputs = sum(isinstance(a, OpStrategy) for a in schema.args_schema)
        return expand_to_full_mesh_op_strategy(mesh, schema, [[seq] * (3 + inputs)], input_index=3)

    def route(op: Any, args: tuple, kwargs: dict) -> Any:
        dispatcher = DTensor._op_dispatcher
        info = dispatcher.unwrap_to_op_info(op, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        group = info.compute_mesh.get_group()
        a, kw = list(info.local_args), dict(info.local_kwargs)
        if op is forward:
            result = _attention._templated_ring_attention(
                group, 2, forward, *a[:3], is_causal=a[4], dropout_p=a[3], scale=kw.get("scale")
            )
        else:
            grad, q, k, v, out, lse, dropout_p, causal = a[:8]
            result = _attention._templated_ring_attention_backward(
                group, 2, backward, grad_out=grad, grad_out_name="grad_out", query=q, key=k,
                value=v, out=out, logsumexp=lse, is_causal=causal, dropout_p=dropout_p,
                scale=kw.get("scale"),
            )  # fmt: skip
        return dispatcher.wrap(tuple(result), info.output_sharding.output_spec)

    _attention.custom_ops[forward] = route
    _attention.custom_ops[backward] = route


class _FunctionalBytes:
    """The bytes this rank sends through the functional collectives torch's context
    parallelism calls (``permute_tensor``: its ring's block passed on; ``all_gather_single``:
    its all-gather rotation), counted as autoshard counts them: a block sent whole, ``g - 1``
    blocks of an all-gather."""

    NAMES = ("permute_tensor", "all_gather_single")

    def __init__(self) -> None:
        self.bytes = 0.0

    def __enter__(self) -> _FunctionalBytes:
        import torch.distributed._functional_collectives as funcol

        self._kept = {n: getattr(funcol, n) for n in self.NAMES if hasattr(funcol, n)}
        for name, fn in self._kept.items():
            setattr(funcol, name, self._counted(name, fn))
        return self

    def _counted(self, name: str, fn: Any) -> Any:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            g = torch.distributed.get_world_size()
            self.bytes += nbytes * (g - 1) if name == "all_gather_single" else nbytes
            return fn(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed._functional_collectives as funcol

        for name, fn in self._kept.items():
            setattr(funcol, name, fn)


def _rank(rounds: int, seq: int) -> list[dict]:
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.parallel import DistributedDataParallel

    from autoshard import comm, parallelize, shard_inputs

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    _enable_cpu_kernel()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rows = []
    for method, rotate in PAIRS:
        model, batch = _model(seq)
        theirs_model = copy.deepcopy(model)
        pm = parallelize(model, batch, {"cp": world}, attention=method)
        mine = shard_inputs(batch, pm)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        ddp = DistributedDataParallel(theirs_model, broadcast_buffers=False)
        opt_t = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        losses: dict[str, float] = {}

        def ours(pm=pm, opt=opt, mine=mine, losses=losses) -> None:
            loss = pm(*mine)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses["autoshard"] = float(loss)

        tables = (theirs_model.rope_cos, theirs_model.rope_sin)

        def theirs(
            ddp=ddp, opt_t=opt_t, batch=batch, rotate=rotate, tables=tables, losses=losses
        ) -> None:
            set_rotate_method(rotate)
            inner = ddp.module
            # the rank's part of the ids, targets and rotary tables, in the balancer's order
            ids, targets, cos, sin = (t.clone() for t in (*batch, *tables))
            buffers = [ids, targets, cos, sin]
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0, 0],
                                  no_restore_buffers=set(buffers)):  # fmt: skip
                inner.rope_cos, inner.rope_sin = cos, sin
                loss = ddp(ids, targets)
                loss.backward()
            inner.rope_cos, inner.rope_sin = tables
            opt_t.step()
            opt_t.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses["torch"] = float(mean) / world

        times = in_turns({"autoshard": ours, "torch": theirs}, rounds, WARMUP)
        with comm.counting() as counted:
            ours()
        counter = _FunctionalBytes()
        with counter:
            theirs()
        rows.append({
            "method": method, "rotate": rotate,
            "autoshard_ms": statistics.median(times["autoshard"]) * 1e3,
            "torch_ms": statistics.median(times["torch"]) * 1e3,
            "paired": paired_ratio(times["autoshard"], times["torch"]),
            "autoshard_bytes": sum(c["bytes"] for c in counted.values()),
            "autoshard_kinds": {k: c["calls"] for k, c in counted.items()},
            "torch_bytes_attention": counter.bytes,
            "losses": dict(losses),
        })  # fmt: skip
    return rows


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    rounds, seq = (3, 512) if quick else (ROUNDS, SEQ)
    rows = run_ranks(_rank, 2, rounds, seq, timeout=3000)[0]
    for r in rows:
        r["ratio"] = r["paired"]["median"]
    return {"rounds": rounds, "seq": seq, "rows": rows}


def summary(result: dict) -> str:
    lines = [
        f"Llama reference model ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, ffn {FFN}, "
        f"vocab {VOCAB}, causal; global batch {BATCH} of sequence {result['seq']}, float32, "
        "AdamW) on 2 CPU ranks of 1 thread (gloo), each rank fed half of every sequence: "
        "autoshard `parallelize(model, batch, {'cp': 2}, attention=...)` against torch's "
        "experimental `context_parallel` (head-tail load balance, the rotation named; the "
        "CPU flash-attention kernel registered with it, its gradients averaged by DDP), one "
        f"step of each a round, the order turning around every round, {result['rounds']} "
        "rounds, times of the slowest rank. Ratio: the median over rounds of autoshard's "
        "step / torch's, with its 95% interval; below 1 autoshard is faster. Bytes: sent by "
        "a rank in a step; autoshard's counted by its collectives (attention and the "
        "gradient sums), torch's by its functional collectives (attention only: DDP's "
        "gradient all-reduce, the same bytes as autoshard's, is not among them).",
        "",
        "| autoshard | torch | autoshard ms | torch ms | ratio | 95% interval | "
        "autoshard bytes | torch attention bytes |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        p = r["paired"]
        lines.append(
            f'| `attention="{r["method"]}"` | rotate `{r["rotate"]}` | '
            f"{r['autoshard_ms']:.1f} | {r['torch_ms']:.1f} | {p['median']:.3f} | "
            f"{p['low']:.3f}-{p['high']:.3f} | {r['autoshard_bytes'] / 2**20:.2f} MiB | "
            f"{r['torch_bytes_attention'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines)
