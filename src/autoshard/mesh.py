"""Named device meshes over the world's ranks.

``init_mesh({"dp": 2, "tp": 2})`` gives a torch DeviceMesh whose axes are, like every device
matrix autoshard uses, contiguous runs of the world's factors in row-major rank order. autoshard's
own collectives create their process groups lazily (see :mod:`autoshard.comm`); the DeviceMesh is
what DTensor and the rest of torch.distributed take at the boundary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshError", "init_mesh"]


class MeshError(ValueError):
    """A mesh that does not fit the world it is asked for."""


def _check(axes: Mapping[str, int], world_size: int) -> None:
    if not axes:
        raise MeshError("a mesh needs at least one axis, e.g. {'dp': world_size}")
    bad = [
        f"{name}({size})" for name, size in axes.items() if not isinstance(size, int) or size < 1
    ]
    if bad:
        raise MeshError(f"mesh axis sizes must be positive integers: {', '.join(bad)}")
    product = math.prod(axes.values())
    if product != world_size:
        factors = " * ".join(f"{name}({size})" for name, size in axes.items())
        raise MeshError(f"mesh {factors} = {product} != world size {world_size}")


def _ensure_process_group(timeout_s: float) -> None:
    """Join the job torchrun (or any launcher setting RANK/WORLD_SIZE) describes."""
    if dist.is_initialized():
        return
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise MeshError(
            f"no process group and no launcher environment ({', '.join(missing)} unset): start "
            "with torchrun or call torch.distributed.init_process_group first"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def init_mesh(axes: Mapping[str, int], *, timeout_s: float = 600.0) -> DeviceMesh:
    """A DeviceMesh with named axes (major first) over all ranks, from an initialised process
    group or the torchrun environment; a MeshError names every factor if the sizes do not
    multiply to the world size."""
    axes = dict(axes)
    _ensure_process_group(timeout_s)
    _check(axes, dist.get_world_size())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ranks = torch.arange(dist.get_world_size()).reshape(tuple(axes.values()))
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(axes))
