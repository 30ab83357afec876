"""The rank's device (docs/devices.md): where its shards live and every tensor it makes is
made, chosen once for a run; and the host beside it, through which the few values the host
must read (the counts of an uneven exchange) are staged.

Under NCCL each rank computes on ``cuda:LOCAL_RANK`` unless ``parallelize(device=)`` says
otherwise; under gloo on the CPU. A model built on the CPU or on meta is cut there and moved
a shard at a time (``runtime.program.ParallelModule``), so the device never holds the whole
model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DeviceError", "host_ints", "rank_device"]


class DeviceError(ValueError):
    """A device this rank cannot compute on, named with why."""


def rank_device(device: Any = None) -> torch.device:
    """The device this rank computes on: ``device`` as given, else ``cuda:LOCAL_RANK`` under
    a NCCL process group, else the CPU. A CUDA device becomes the current one (NCCL's
    streams and buffers are made there). An error names a device this rank cannot use."""
    nccl = dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
    if device is None:
        count = max(1, torch.cuda.device_count()) if nccl else 1
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % count if nccl else 0))
        device = f"cuda:{local}" if nccl else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device={str(device)!r}, but this torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif nccl and "gloo" not in str(dist.get_backend()):
        raise DeviceError(
            f"device={str(device)!r} under the NCCL backend, which moves CUDA tensors only: "
            "give a cuda device, or make the process group with gloo"
        )
    return device


def host_ints(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Small integer tensors of the device read on the host (the counts an uneven exchange
    takes as its split sizes), each as a flat list: one copy for all of them, from CUDA into
    pinned memory without blocking, then one wait for the stream up to that copy (the one
    host sync such an exchange needs)."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if flat.device.type == "cuda":
        # host: the staging buffer the host reads, pinned so the copy runs asynchronously
        host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=True)
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        copied.synchronize()
        flat = host
    values = flat.tolist()
    out, at = [], 0
    for t in tensors:
        out.append(values[at : at + t.numel()])
        at += t.numel()
    return out
