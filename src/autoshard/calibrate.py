"""``autoshard calibrate``: measure this machine into a :class:`ClusterSpec` (docs/search.md).

Each rank is one process of ``threads`` threads. Measured: matmul FLOP/s per dtype, memory
bandwidth (a large copy), the per-op overhead (a small op through autograd), and gloo all-reduce
time for a small and a large message, from which latency and bandwidth follow by the same
formula the cost model prices with. Medians of repeated timings.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from autoshard.cluster import ClusterSpec


def _median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute(threads: int = 1) -> dict[str, float]:
    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    n = 384
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        seconds = _median_time(lambda a=a, b=b: a @ b, reps=15)
        out[str(dtype).removeprefix("torch.")] = 2 * n**3 / seconds
    big = torch.empty(16 * 2**20 // 4)  # 16 MiB
    dst = torch.empty_like(big)
    seconds = _median_time(lambda: dst.copy_(big), reps=15)
    out["memory_bandwidth"] = 2 * big.numel() * 4 / seconds
    x = torch.ones(4, requires_grad=True)
    ops = 50

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    out["op_overhead"] = _median_time(chain, reps=15) / (2 * ops)
    return out


def _measure_comm_rank(threads: int) -> dict[str, float]:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    g = dist.get_world_size()
    small = torch.zeros(1)
    big = torch.zeros(2**20)  # 4 MiB

    def timed(t: torch.Tensor) -> float:
        def once() -> None:
            dist.barrier()
            dist.all_reduce(t)

        barrier = _median_time(dist.barrier, reps=20)
        return max(0.0, _median_time(once, reps=20) - barrier)

    t_small, t_big = timed(small), timed(big)
    steps = math.ceil(math.log2(g))
    latency = t_small / (2 * steps)
    nbytes = big.numel() * 4
    bandwidth = 2 * (g - 1) / g * nbytes / max(t_big - 2 * steps * latency, 1e-9)
    return {"latency": latency, "bandwidth": bandwidth}


def calibrate(ranks: int = 2, threads: int = 1, name: str = "calibrated") -> ClusterSpec:
    """This machine as ``ranks`` devices in one node."""
    from autoshard.testing import run_ranks

    compute = measure_compute(threads)
    comm = run_ranks(_measure_comm_rank, ranks, threads, timeout=300)[0]
    flops = {k: v for k, v in compute.items() if k.startswith("float")}
    return ClusterSpec(
        name=name,
        nodes=1,
        devices_per_node=ranks,
        flops=flops,
        memory_bytes=float(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else 8e9,
        memory_bandwidth=compute["memory_bandwidth"],
        intra_bandwidth=comm["bandwidth"],
        intra_latency=comm["latency"],
        inter_bandwidth=comm["bandwidth"],
        inter_latency=comm["latency"],
        op_overhead=compute["op_overhead"],
        overlap=False,
        extra={"threads_per_rank": threads, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")},
    )


__all__ = ["calibrate", "measure_compute"]
