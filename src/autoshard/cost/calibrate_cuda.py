"""``autoshard calibrate`` on CUDA devices (docs/search.md): each rank measures its own device,
``cuda:LOCAL_RANK``, and with more than one rank NCCL's collectives between them.

Measured, in bfloat16 as training runs: matrix products of the cube-root sizes a plan's layers
have (a linear layer's forward and both gradients; the best is the peak, the others its
efficiency curve) and float32's peak; the fused attention a causal block runs, forward and
backward (the share of peak, counted as the time model counts a causal kernel); the experts'
grouped product against separate products of one expert's size; memory bandwidth (a copy of
a quarter of the device's memory at most); the per-kernel overhead; AdamW's memory passes;
NCCL's all-reduce fitted to the link model and its other collectives' factors over it; the
share of an NCCL all-reduce that products beside it hide (``overlap_efficiency``). Every
time is a median of CUDA-event timings after a warm-up.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from autoshard.cost.cluster import PRESETS, ClusterSpec
from autoshard.cost.linkfit import fit_all_reduce, kind_factors

#: cube-root sizes of the products measured: a plan's layers and their shards
CUDA_MATMUL_SIZES = (256, 512, 1024, 2048, 4096, 8192)
#: the attention measured: batch, heads, sequence, head dim (a causal training block)
ATTENTION_SHAPE = (2, 16, 4096, 128)
#: the experts measured: experts, token slots, hidden, ffn
GROUPED_SHAPE = (8, 16384, 2048, 1408)
#: NCCL all-reduce sizes (bytes) the link model is fitted to, and the other kinds' sizes
CUDA_COMM_SIZES = (1 << 20, 8 << 20, 64 << 20, 256 << 20)
CUDA_KIND_SIZES = (8 << 20, 64 << 20)
KINDS = ("reduce_scatter", "all_gather", "all_to_all")


def cuda_time(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
    """The median seconds of ``fn`` on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _linear_rate(n: int, dtype: torch.dtype, device: torch.device) -> float:
    x = torch.randn(n, n, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(n, n, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(n, n, dtype=dtype, device=device)

    def step() -> None:
        torch.nn.functional.linear(x, w).backward(grad)
        x.grad = w.grad = None

    return 6 * n**3 / cuda_time(step, reps=max(5, min(50, int(3e13 / (6 * n**3)))))


def measure_products(device: torch.device) -> dict[str, Any]:
    """bfloat16's peak (the best product) and curve; float32's peak at the largest size."""
    rates = [_linear_rate(n, torch.bfloat16, device) for n in CUDA_MATMUL_SIZES]
    peak = max(rates)
    curve = [[float(n), r / peak] for n, r in zip(CUDA_MATMUL_SIZES, rates, strict=True)]
    # float32 at the next-largest size, over bf16's share there: the same curve scaled
    fp32 = _linear_rate(CUDA_MATMUL_SIZES[-2], torch.float32, device) / curve[-2][1]
    return {"bfloat16": peak, "float16": peak, "float32": fp32, "matmul_efficiency": curve}


def measure_attention_cuda(device: torch.device, peak: float) -> dict[str, Any]:
    """The share of ``peak`` a causal fused attention reaches forward and backward, as the
    time model counts its work (``Attention.TILE``), and the kernel a ring's block runs."""
    from autoshard.ops import blocks
    from autoshard.ops.contraction import Attention

    b, h, s, d = ATTENTION_SHAPE
    q, k, v = (
        torch.randn(b, h, s, d, dtype=torch.bfloat16, device=device, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    work = min(1.0, 0.5 + Attention.TILE / (2 * s))
    flops = 4 * b * h * s * s * d * work

    def forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fwd = cuda_time(forward)
    both = cuda_time(lambda: forward().backward(grad))
    shares = [min(1.0, flops / fwd / peak), min(1.0, 2 * flops / max(both - fwd, 1e-9) / peak)]
    return {"attention_efficiency": shares, "attention_kernel": blocks.kernel(q, k, None)}


def measure_grouped(device: torch.device, curve: list[list[float]], peak: float) -> float:
    """The experts' grouped product (forward and backward) over the speed the curve gives a
    separate product of one expert's size: ``grouped_mm_efficiency``."""
    from autoshard.ops.grouped import grouped_ffn

    experts, slots, hidden, ffn = GROUPED_SHAPE
    bf16 = {"dtype": torch.bfloat16, "device": device}
    rows = torch.randn(slots, hidden, **bf16, requires_grad=True)
    gate_up = torch.randn(experts, 2 * ffn, hidden, **bf16, requires_grad=True)
    down = torch.randn(experts, hidden, ffn, **bf16, requires_grad=True)
    counts = torch.full((experts,), slots // experts, device=device)
    grad = torch.randn(slots, hidden, **bf16)

    def step() -> None:
        grouped_ffn(rows, counts, gate_up, down, "silu").backward(grad)
        rows.grad = gate_up.grad = down.grad = None

    rate = 3 * 2 * 3 * slots * hidden * ffn / cuda_time(step)
    per = slots // experts
    size = 3 / (1 / per + 1 / hidden + 1 / ffn)
    spec = dataclasses.replace(PRESETS["cpu"], matmul_efficiency=curve)
    return rate / (peak * spec.matmul_share(size))


def measure_device(device: torch.device) -> dict[str, Any]:
    """Everything one device measures of itself (the module's docstring)."""
    out = measure_products(device)
    out |= measure_attention_cuda(device, out["bfloat16"])
    out["grouped_mm_efficiency"] = measure_grouped(
        device, out["matmul_efficiency"], out["bfloat16"]
    )
    out["memory_bytes"] = float(torch.cuda.mem_get_info(device)[1])
    out["memory_bandwidth"] = _bandwidth(device)
    out["op_overhead"] = kernel_overhead(device, cuda_time)
    out["optimizer_passes"] = _adamw_passes(device, out["memory_bandwidth"])
    return out


def _bandwidth(device: torch.device) -> float:
    """Bytes/s of a copy of up to 1 GiB (read and written), far beyond the caches."""
    free = torch.cuda.mem_get_info(device)[0]
    big = torch.empty(min(1 << 30, free // 4) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(big)
    return 2 * big.numel() * 2 / cuda_time(lambda: dst.copy_(big))


def kernel_overhead(device: torch.device, timed: Callable[[Callable[[], None]], float]) -> float:
    """Seconds a small kernel costs beyond its work, through autograd (forward and backward),
    by ``timed`` (the CPU's median of repeats, or CUDA's events)."""
    x = torch.ones(4, device=device, requires_grad=True)
    ops = 50

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    return timed(chain) / (2 * ops)


def _adamw_passes(device: torch.device, bandwidth: float) -> float:
    """Bytes of memory traffic of a fused AdamW step per parameter byte."""
    params = [torch.nn.Parameter(torch.zeros(1 << 24, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
    return cuda_time(opt.step) * bandwidth / sum(p.numel() * 4 for p in params)


def _collective(kind: str, nbytes: int, world: int, group: Any, device: torch.device):
    import torch.distributed as dist

    part = torch.empty(nbytes // 2 // world, dtype=torch.bfloat16, device=device)
    whole = torch.ones(part.numel() * world, dtype=torch.bfloat16, device=device)
    if kind == "all_reduce":
        return _Reduce(whole, group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, whole, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, part, group=group)
    out = torch.empty_like(whole)
    return lambda: dist.all_to_all_single(out, whole, group=group)


@dataclasses.dataclass(frozen=True, eq=False)
class _Reduce:
    """An all-reduce of ``tensor`` over ``group``, called as the other kinds' closures are."""

    tensor: torch.Tensor
    group: Any

    def __call__(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(self.tensor, group=self.group)


def measure_nccl(device: torch.device) -> dict[str, Any]:
    """All-reduce over every rank at :data:`CUDA_COMM_SIZES` and the other kinds at
    :data:`CUDA_KIND_SIZES`, on an NCCL group beside the job's default one."""
    import torch.distributed as dist

    world = dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="nccl")
    dist.barrier(group=group, device_ids=[device.index])
    times = {
        "all_reduce": [
            cuda_time(_collective("all_reduce", n, world, group, device)) for n in CUDA_COMM_SIZES
        ],
    }
    for kind in KINDS:
        times[kind] = [
            cuda_time(_collective(kind, n, world, group, device)) for n in CUDA_KIND_SIZES
        ]
    times["overlap_efficiency"] = measure_overlap(device, group)
    return times


def measure_overlap(device: torch.device, group: Any, nbytes: int = 64 << 20) -> float:
    """The share of the shorter of an NCCL all-reduce and a burst of products that running
    them at once hides, ``(compute + comm - both) / min(compute, comm)``, as calibrate
    measures it on CPU ranks: the all-reduce posted asynchronously (NCCL's own stream), the
    bfloat16 products on the default stream meanwhile, sized to take about as long. Below
    1 where NCCL's kernels take the streaming multiprocessors the products would use."""
    import torch.distributed as dist

    reduce = _collective("all_reduce", nbytes, 1, group, device)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)

    def run(products: int, comm: bool) -> None:
        work = dist.all_reduce(reduce.tensor, group=group, async_op=True) if comm else None
        for _ in range(products):
            a @ a
        if work is not None:
            work.wait()  # the default stream waits for NCCL's: the end event sees both

    comm, one = cuda_time(lambda: run(0, True)), cuda_time(lambda: run(1, False))
    products = max(1, round(comm / one))
    compute, both = cuda_time(lambda: run(products, False)), cuda_time(lambda: run(products, True))
    return min(1.0, max(0.0, (compute + comm - both) / min(compute, comm)))


def _measure_rank() -> dict[str, Any]:
    import os

    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    out = measure_device(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        out["nccl"] = measure_nccl(device)
    return out


def cuda_spec(per_rank: list[dict[str, Any]], ranks: int, name: str) -> ClusterSpec:
    """The cluster spec from each rank's measurements (``measure_device``, with ``nccl`` from
    rank 0 when there are several): medians over ranks; the link fitted to NCCL's all-reduce
    and the other kinds' factors over it, or NVLink-class placeholders on one rank."""

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in per_rank)

    curves = [r["matmul_efficiency"] for r in per_rank]
    curve = [
        [size, statistics.median(c[i][1] for c in curves)] for i, (size, _) in enumerate(curves[0])
    ]
    shares = [statistics.median(r["attention_efficiency"][i] for r in per_rank) for i in (0, 1)]
    nccl = per_rank[0].get("nccl")
    factors: dict[str, float] = {}
    if nccl:
        link = fit_all_reduce(
            [(ranks, n, t) for n, t in zip(CUDA_COMM_SIZES, nccl["all_reduce"], strict=True)]
        )
        kinds = {k: v for k, v in nccl.items() if k in KINDS}
        factors = kind_factors(kinds, ranks, link["latency"], link["bandwidth"], CUDA_KIND_SIZES)
    else:  # one device: nothing between devices to measure
        link = {"latency": 5e-6, "bandwidth": 1e11}
    return ClusterSpec(
        name=name,
        nodes=1,
        devices_per_node=ranks,
        flops={k: median(k) for k in ("bfloat16", "float16", "float32")},
        memory_bytes=min(r["memory_bytes"] for r in per_rank),
        memory_bandwidth=median("memory_bandwidth"),
        intra_bandwidth=link["bandwidth"],
        intra_latency=link["latency"],
        inter_bandwidth=link["bandwidth"],
        inter_latency=link["latency"],
        op_overhead=median("op_overhead"),
        optimizer_passes=median("optimizer_passes"),
        matmul_efficiency=curve,
        attention_efficiency=shares,
        grouped_mm_efficiency=median("grouped_mm_efficiency"),
        collective_factors=factors,
        # NCCL on its own stream beside the products, measured (1 on one device: nothing to
        # overlap, as the GPU presets assume)
        overlap_efficiency=float(nccl.get("overlap_efficiency", 1.0)) if nccl else 1.0,
        extra={
            "device": "cuda",
            "attention_kernel": per_rank[0]["attention_kernel"],
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "nccl": nccl or {},
        },
    )


def calibrate_cuda(ranks: int = 1, name: str = "calibrated") -> ClusterSpec:
    """This machine's first ``ranks`` CUDA devices as one node."""
    if not torch.cuda.is_available():
        raise ValueError("calibrate on CUDA: no CUDA device here (torch.cuda.is_available())")
    if ranks > torch.cuda.device_count():
        raise ValueError(f"--ranks {ranks}: this machine has {torch.cuda.device_count()} GPUs")
    if ranks == 1:
        return cuda_spec([_measure_rank()], 1, name)
    from autoshard.testing import run_ranks

    return cuda_spec(run_ranks(_measure_rank, ranks, timeout=900), ranks, name)


__all__ = ["calibrate_cuda", "cuda_spec", "cuda_time", "measure_device", "measure_nccl"]
