"""The host's numbers of a :class:`ClusterSpec` measured here (``autoshard calibrate``; what
offload is priced by, docs/cost.md "Offload"): its memory, the copy bandwidth between it and
a device, the throughput of torch's fused CPU AdamW on all its threads, and a file's write and
read throughput under the temporary directory with the space free there.

Each is the median of a few timings. The file is written with ``fsync`` and dropped from the
page cache (``posix_fadvise``) before it is read, so the read comes from the drive where the
system lets a process drop its pages.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from autoshard.cost.cluster import ClusterSpec

#: bytes of each copy, AdamW's parameter and file measured (past the caches, yet quick)
COPY_BYTES = 32 * 2**20
ADAM_ELEMENTS = 1 << 21
FILE_BYTES = 32 * 2**20


def median_seconds(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> float:
    """The median seconds of ``reps`` calls of ``fn``, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str = "cpu", nbytes: int = COPY_BYTES) -> float:
    """Bytes/s of the slower direction between the host and ``device`` (pinned host memory
    on CUDA; on the CPU, a copy between two host tensors, which is what the host tier's
    copies are there)."""
    n = nbytes // 4
    host = torch.empty(n, pin_memory=device == "cuda")
    there = torch.empty(n, device=device)

    def both(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            dst.copy_(src, non_blocking=True)
            if device == "cuda":
                torch.cuda.synchronize()

        return run

    seconds = max(median_seconds(both(there, host)), median_seconds(both(host, there)))
    return nbytes / seconds


def adam_rate(elements: int = ADAM_ELEMENTS) -> float:
    """Parameter elements a second torch's fused CPU AdamW steps (float32, all threads)."""
    param = torch.nn.Parameter(torch.randn(elements))
    param.grad = torch.randn(elements)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    return elements / median_seconds(opt.step)


def file_bandwidth(directory: str | None = None, nbytes: int = FILE_BYTES) -> tuple[float, float]:
    """(write, read) bytes/s of a file of ``nbytes`` under ``directory`` (the temporary one)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.TemporaryDirectory(dir=directory) as where:
        path = os.path.join(where, "probe")

        def write() -> None:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        def read() -> None:
            with open(path, "rb") as f:
                if hasattr(os, "posix_fadvise"):  # from the drive, not the page cache
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                while f.read(1 << 24):
                    pass

        written = nbytes / median_seconds(write, reps=3)
        return written, nbytes / median_seconds(read, reps=3)


def with_host(spec: ClusterSpec, device: str = "cpu", directory: str | None = None) -> ClusterSpec:
    """``spec`` with this host's numbers measured (one node: the machine calibrate runs on)."""
    write, read = file_bandwidth(directory)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dataclasses.replace(
        spec,
        host_memory_bytes=float(memory),
        host_adam_rate=adam_rate(),
        host_bandwidth=copy_bandwidth(device),
        nvme_bytes=float(shutil.disk_usage(directory or tempfile.gettempdir()).free),
        nvme_read_bandwidth=read,
        nvme_write_bandwidth=write,
    )


__all__ = ["adam_rate", "copy_bandwidth", "file_bandwidth", "median_seconds", "with_host"]
