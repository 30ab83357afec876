"""``autoshard calibrate``: measure this machine into a :class:`ClusterSpec` (docs/search.md).

Each rank is one process of ``threads`` threads, and every rank measures at the same time, so a
device is measured as it runs in training: beside its neighbours. Measured: matrix-product FLOP/s
at sizes 16 to 512 (the best is the peak, the others its efficiency curve), the share of it
attention reaches forward and backward, memory bandwidth (a copy larger than the caches), the
per-op overhead (a small op through autograd), the memory passes of one AdamW step, and
all-reduce time at several message sizes, each all-reduce issued after a slice of compute as a
step issues them (docs/cost.md, "How calibrate measures on a shared host"), and the host's
numbers offload is priced by (``calibrate_host``). Latency and
bandwidth are the least-squares fit of the cost model's own all-reduce formula to those times.
Medians of repeated timings, the conditions compared taken in turns, then the median over
ranks.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoshard.cost.calibrate_host import median_seconds, with_host
from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.linkfit import fit_all_reduce, kind_factors


def _median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """The median seconds of ``reps`` calls of ``fn``. In a job of several ranks they start
    together, so each rank is measured beside neighbours that run the same thing (as in
    training), not beside whatever measurement another rank has reached."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return median_seconds(fn, reps, warmup=0)


#: rounds of each communication measurement; the conditions it compares take turns in each
ROUNDS = 11


def _in_turns(runs: Sequence[Callable[[], float]], rounds: int = ROUNDS) -> list[float]:
    """The median seconds of each of ``runs`` (each returns its own), run in turns for
    ``rounds`` rounds: a slower stretch of a shared host falls on every condition alike
    instead of on whichever was being measured, so their differences keep their sign."""
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, kept in zip(runs, samples, strict=True):
            kept.append(run())
    return [statistics.median(kept) for kept in samples]


#: cube-root sizes of the matrix products the efficiency curve is measured at
MATMUL_SIZES = (16, 32, 64, 128, 256, 384, 512)


def _matmul_rate(n: int, dtype: torch.dtype) -> float:
    """FLOP/s of an ``n``-cube product as training runs it: a linear layer's forward and both
    gradients (three products, two on transposed operands), each into a fresh output."""
    x = torch.randn(n, n, dtype=dtype, requires_grad=True)
    w = torch.randn(n, n, dtype=dtype, requires_grad=True)
    grad = torch.randn(n, n, dtype=dtype)

    def step() -> None:
        torch.nn.functional.linear(x, w).backward(grad)
        x.grad = w.grad = None

    reps = max(5, min(200, int(6e8 / (6 * n**3))))
    return 6 * n**3 / _median_time(step, reps=reps)


def measure_matmul(dtype: torch.dtype = torch.float32) -> tuple[float, list[list[float]]]:
    """Peak FLOP/s (the best product measured) and the share of it each size reaches."""
    rates = [_matmul_rate(n, dtype) for n in MATMUL_SIZES]
    peak = max(rates)
    return peak, [[float(n), r / peak] for n, r in zip(MATMUL_SIZES, rates, strict=True)]


def measure_attention(peak: float) -> list[float]:
    """The share of ``peak`` a causal attention reaches, forward and backward, at a training
    shape (4 sequences of 128, 4 heads of 64), counted as the time model counts it (the
    kernel's work on and below the diagonal)."""
    b, h, s, d = 4, 4, 128, 64
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    fwd_flops = 4 * b * h * s * s * d * (0.5 + 64 / s)
    grad = torch.randn(b, h, s, d)

    def forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fwd = _median_time(forward, reps=15)
    both = _median_time(lambda: forward().backward(grad), reps=15)
    return [
        min(1.0, fwd_flops / fwd / peak),
        min(1.0, 2 * fwd_flops / max(both - fwd, 1e-9) / peak),
    ]


def measure_compute(threads: int = 1) -> dict[str, Any]:
    """FLOP/s per dtype with the matrix-product efficiency curve and attention shares, memory
    bandwidth, op overhead and AdamW passes of this process."""
    torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    peak, curve = measure_matmul(torch.float32)
    out["float32"] = peak
    out["matmul_efficiency"] = curve
    out["attention_efficiency"] = measure_attention(peak)
    out["float64"] = _matmul_rate(256, torch.float64)
    return out | measure_optimizer()


def measure_optimizer() -> dict[str, float]:
    """Memory bandwidth, op overhead and the memory passes of one step of ``torch.optim``'s
    AdamW as the user's runs on this process's threads (what the device's update is priced
    by, ``cost.compute.optimizer_time``)."""
    big = torch.empty(64 * 2**20 // 4)  # 64 MiB: training's tensors do not live in cache
    dst = torch.empty_like(big)
    seconds = _median_time(lambda: dst.copy_(big), reps=9)
    bandwidth = 2 * big.numel() * 4 / seconds
    from autoshard.cost.calibrate_cuda import kernel_overhead

    cpu = torch.device("cpu")
    overhead = kernel_overhead(cpu, lambda chain: _median_time(chain, reps=15))
    # A model's parameters: several tensors of a few MiB, stepped one after the other.
    params = [torch.nn.Parameter(torch.zeros(2**19)) for _ in range(8)]  # 8 x 2 MiB
    for param in params:
        param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW(params, lr=1e-6)
    seconds = _median_time(opt.step, reps=7)
    traffic = max(seconds - 10 * overhead * len(params), 0.0) * bandwidth
    passes = traffic / sum(p.numel() * 4 for p in params)
    return {"memory_bandwidth": bandwidth, "op_overhead": overhead, "optimizer_passes": passes}


#: 256-cube products between two timed collectives (about 10 ms on a CPU rank): a
#: collective follows a layer's or a backward's compute. A rank's wait for a collective grows
#: with the time since its last one (its peers, their threads and the host's vCPUs have gone
#: idle, and the ranks have drifted apart), so bursts of back-to-back calls price it low.
GAP_PRODUCTS = 32
#: all-reduce message sizes (bytes) the latency and bandwidth are fitted to
COMM_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _group_sizes(world: int) -> list[int]:
    """The group sizes all-reduce is measured at: powers of two up to the world, and the world."""
    if world < 2:
        return []
    return sorted({2**k for k in range(1, int(math.log2(world)) + 1)} | {world})


def _measure_comm(threads: int, sizes: tuple[int, ...] = COMM_SIZES) -> dict[int, list[float]]:
    """Per-call all-reduce time at each size, with compute between calls, for groups of ranks
    ``0..g-1`` of each size ``g`` (rank 0's numbers are the ones kept)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank = dist.get_rank()
    a = torch.randn(256, 256)
    calls = 4
    out: dict[int, list[float]] = {}
    for g in _group_sizes(dist.get_world_size()):
        group = dist.new_group(list(range(g)))
        if rank < g:

            def burst(tensors: list[torch.Tensor | None], group: object = group) -> float:
                dist.barrier(group=group)
                start = time.perf_counter()
                for t in tensors:
                    for _ in range(GAP_PRODUCTS):
                        a @ a
                    if t is not None:
                        dist.all_reduce(t, group=group)
                return time.perf_counter() - start

            times = []
            for nbytes in sizes:
                tensors = [torch.ones(nbytes // 4) for _ in range(calls)]
                burst(tensors)  # warm-up
                base, total = _in_turns([lambda: burst([None] * calls), lambda t=tensors: burst(t)])
                times.append(max(total - base, 1e-7) / calls)
            out[g] = times
        dist.barrier()
    return out


#: collectives whose speed is measured against the link model fitted on all-reduce
OTHER_KINDS = ("reduce_scatter", "all_gather", "all_to_all")
#: the sizes (bytes per rank: reduce-scatter's and all-to-all's input, all-gather's output)
KIND_SIZES = (64 << 10, 1 << 20, 4 << 20)


def _kind_call(kind: str, nbytes: int, world: int) -> Callable[[], object]:
    """One call of collective ``kind`` over every rank, on ``nbytes`` per rank."""
    import torch.distributed as dist

    whole, part = torch.ones(nbytes // 4), torch.empty(nbytes // 4 // world)
    # the names torch keeps (the older ones warn on every call), as comm calls them
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, whole)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(whole, part)
    out = torch.empty_like(whole)
    return lambda: dist.all_to_all_single(out, whole)


def _measure_kinds(threads: int) -> dict[str, list[float]]:
    """Per-call seconds of each of :data:`OTHER_KINDS` at :data:`KIND_SIZES` over every rank,
    issued between slices of compute as the all-reduce samples are."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    a, calls = torch.randn(256, 256), 4
    world = dist.get_world_size()

    def burst(call: Callable[[], object] | None) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            for _ in range(GAP_PRODUCTS):
                a @ a
            if call is not None:
                call()
        return time.perf_counter() - start

    out: dict[str, list[float]] = {}
    for kind in OTHER_KINDS:
        out[kind] = []
        for nbytes in KIND_SIZES:
            call = _kind_call(kind, nbytes, world)
            burst(call)  # warm-up
            base, total = _in_turns([lambda: burst(None), lambda call=call: burst(call)])
            out[kind].append(max(total - base, 1e-7) / calls)
    return out


def _measure_overlap(threads: int, nbytes: int = 4 << 20) -> float:
    """The share of the shorter of a compute burst and an all-reduce that running them at once
    hides, ``(compute + comm - both) / min(compute, comm)``, the burst sized to take about
    as long as the all-reduce (backward beside a bucket's sum)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    a, flat = torch.randn(256, 256), torch.ones(nbytes // 4)

    def run(products: int, comm: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        work = dist.all_reduce(flat, async_op=True) if comm else None
        for _ in range(products):
            a @ a
        if work is not None:
            work.wait()
        return time.perf_counter() - start

    run(1, True)  # warm-up
    comm, eight = _in_turns([lambda: run(0, True), lambda: run(8, False)], rounds=5)
    products = max(1, round(8 * comm / eight))
    comm, compute, both = _in_turns(
        [lambda: run(0, True), lambda: run(products, False), lambda: run(products, True)],
        rounds=2 * ROUNDS,  # a share of a difference: the noisiest number calibrate keeps
    )
    return min(1.0, max(0.0, (compute + comm - both) / min(compute, comm)))


def _measure_sync_wait(threads: int) -> float:
    """The share of the compute between two synchronizing collectives a rank spends waiting
    for the slowest one (stragglers: the OS, a shared host): the extra time per all-reduce of
    4 bytes when the ranks compute long between calls, over the extra compute."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    a = torch.randn(256, 256)
    tiny = torch.ones(1)

    def segment(products: int, sync: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(6):
            for _ in range(products):
                a @ a
            if sync:
                dist.all_reduce(tiny)
        return time.perf_counter() - start

    def extra(products: int) -> tuple[float, float]:
        synced, alone = _in_turns(
            [lambda: segment(products, True), lambda: segment(products, False)],
            rounds=2 * ROUNDS,
        )
        return max(synced - alone, 0.0), alone

    short_wait, short = extra(2)
    long_wait, long = extra(40)
    return max(long_wait - short_wait, 0.0) / max(long - short, 1e-9)


def _measure_rank(threads: int) -> dict[str, float]:
    import torch.distributed as dist

    dist.barrier()
    out: dict[str, Any] = dict(measure_compute(threads))
    out["comm"] = _measure_comm(threads)
    out["kinds"] = _measure_kinds(threads) if dist.get_world_size() > 1 else {}
    out["overlap_efficiency"] = _measure_overlap(threads) if dist.get_world_size() > 1 else 1.0
    out["sync_wait"] = _measure_sync_wait(threads) if dist.get_world_size() > 1 else 0.0
    return out


def calibrate(
    ranks: int = 2, threads: int = 1, name: str = "calibrated", device: str = "cpu"
) -> ClusterSpec:
    """This machine as ``ranks`` devices in one node: CPU processes of ``threads`` threads
    over gloo, or with ``device="cuda"`` its first ``ranks`` GPUs over NCCL
    (``calibrate_cuda``)."""
    if device != "cpu":
        return with_host(_on_device(ranks, name, device), device)
    from autoshard.testing import run_ranks

    per_rank = run_ranks(_measure_rank, ranks, threads, timeout=600)
    comm, kinds = per_rank[0].pop("comm"), per_rank[0].pop("kinds")
    for r in per_rank[1:]:
        r.pop("comm"), r.pop("kinds")
    curves = [r.pop("matmul_efficiency") for r in per_rank]
    attention = [r.pop("attention_efficiency") for r in per_rank]
    m = {key: statistics.median(r[key] for r in per_rank) for key in per_rank[0]}
    curve = [
        [size, statistics.median(c[i][1] for c in curves)] for i, (size, _) in enumerate(curves[0])
    ]
    shares = [statistics.median(a[i] for a in attention) for i in range(2)]
    samples = [
        (g, s, t) for g, times in comm.items() for s, t in zip(COMM_SIZES, times, strict=True)
    ]
    if samples:
        m |= fit_all_reduce(samples)
    else:  # one rank: nothing to measure; a placeholder link
        m |= {"latency": 1e-5, "bandwidth": 1e10}
    per_group = {
        str(g): fit_all_reduce([(g, s, t) for s, t in zip(COMM_SIZES, times, strict=True)])
        for g, times in comm.items()
    }
    flops = {key: v for key, v in m.items() if key.startswith("float")}
    flops["float64"] = m["float64"] / curve[MATMUL_SIZES.index(256)][1]  # on the same curve
    spec = ClusterSpec(
        name=name,
        nodes=1,
        devices_per_node=ranks,
        flops=flops,
        memory_bytes=8e9,  # CPU ranks share the host's memory; a GPU's is calibrate_cuda's
        memory_bandwidth=m["memory_bandwidth"],
        intra_bandwidth=m["bandwidth"],
        intra_latency=m["latency"],
        inter_bandwidth=m["bandwidth"],
        inter_latency=m["latency"],
        op_overhead=m["op_overhead"],
        optimizer_passes=m["optimizer_passes"],
        sync_wait=m["sync_wait"],
        collective_factors=kind_factors(kinds, ranks, m["latency"], m["bandwidth"], KIND_SIZES),
        overlap_efficiency=m["overlap_efficiency"],
        matmul_efficiency=curve,
        attention_efficiency=shares,
        extra={
            "threads_per_rank": threads,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "all_reduce_fit_per_group_size": per_group,
        },
    )
    return with_host(spec)


def _on_device(ranks: int, name: str, device: str) -> ClusterSpec:
    if device != "cuda":
        raise ValueError(f"calibrate: device {device!r}; expected cpu or cuda")
    from autoshard.cost.calibrate_cuda import calibrate_cuda

    return calibrate_cuda(ranks, name)


__all__ = [
    "calibrate",
    "fit_all_reduce",
    "kind_factors",
    "measure_attention",
    "measure_compute",
    "measure_optimizer",
    "measure_matmul",
]
