"""Meshes: the one place a mesh is parsed, checked against the world, and made a DeviceMesh.

A mesh is named axes over ranks ``0..N-1`` in row-major order, major axis first. Users give it
as a DeviceMesh, ``{"dp": 2, "tp": 2}``, ``"dp=2,tp=2"``, ``[("dp", 2), ("tp", 2)]``, an int (one
``dp`` axis) or a tuple of sizes (``dp``, then ``tp``); :func:`mesh_info` turns any of them into
a :class:`MeshInfo`. ``init_mesh({"dp": 2, "tp": 2})`` gives a torch DeviceMesh whose axes are,
like every device matrix autoshard uses, contiguous runs of the world's factors. autoshard's own
collectives create their process groups lazily (see :mod:`autoshard.comm`); the DeviceMesh is
what DTensor and the rest of torch.distributed take at the boundary.
"""

from __future__ import annotations

import atexit
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoshard import comm, watch

__all__ = [
    "MeshError",
    "MeshInfo",
    "NCCL_ENVIRONMENT",
    "TRACE_PREFIX",
    "check_world",
    "ensure_process_group",
    "group_timeout",
    "init_mesh",
    "mesh_axes",
    "mesh_info",
    "nccl_environment",
]


class MeshError(ValueError):
    """A mesh that does not fit the world it is asked for, or cannot be read."""


@dataclass(frozen=True)
class MeshInfo:
    """Named axes over ranks ``0..N-1``, which of them are data parallel (``dp``, ``dp_*``
    and ``ep``, which outside the experts is data parallel: an unconfigured op falls back to
    splitting its batch over those, and the experts op spreads its experts over ``ep``) and
    which are context parallel (``cp``, ``cp_*``: the inputs' sequence dim is split over
    those, docs/parallelism/sequence.md)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    dp: tuple[str, ...] = ()
    cp: tuple[str, ...] = ()

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def size_of(self, names: Sequence[str]) -> int:
        return math.prod(self.sizes[self.names.index(n)] for n in names)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def describe(self, sep: str = " * ") -> str:
        """``dp(2) * tp(2)``: how errors and tables name the mesh."""
        return sep.join(f"{n}({s})" for n, s in zip(self.names, self.sizes, strict=True))


def _pairs(mesh: Any) -> list[tuple[Any, Any]]:
    if hasattr(mesh, "mesh_dim_names"):
        names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
        return list(zip(names, tuple(mesh.mesh.shape), strict=True))
    if isinstance(mesh, bool):
        raise MeshError(f"mesh {mesh!r}: expected an int, a mapping of axis sizes or a DeviceMesh")
    if isinstance(mesh, int):
        return [("dp", mesh)]
    if isinstance(mesh, str):
        try:
            return [(n.strip(), int(s)) for n, s in (part.split("=") for part in mesh.split(","))]
        except ValueError:
            raise MeshError(f"mesh {mesh!r}: expected name=size,... such as dp=2,tp=2") from None
    if isinstance(mesh, Mapping):
        return list(mesh.items())
    if isinstance(mesh, Sequence) and all(isinstance(m, int) for m in mesh):
        if len(mesh) > 2:
            raise MeshError(f"mesh {tuple(mesh)}: name the axes of a mesh of more than 2 axes")
        return list(zip(("dp", "tp"), mesh, strict=False))
    if isinstance(mesh, Sequence) and all(isinstance(p, Sequence) and len(p) == 2 for p in mesh):
        return [tuple(p) for p in mesh]
    raise MeshError(f"mesh {mesh!r}: expected an int, a mapping of axis sizes or a DeviceMesh")


def mesh_info(mesh: Any) -> MeshInfo:
    """Any form of mesh (see the module docstring) as a :class:`MeshInfo`."""
    if isinstance(mesh, MeshInfo):
        return mesh
    pairs = _pairs(mesh)
    if not pairs:
        raise MeshError("a mesh needs at least one axis, e.g. {'dp': world_size}")
    names = tuple(str(n) for n, _ in pairs)
    bad = [f"{n}({s!r})" for n, s in pairs if isinstance(s, bool) or not isinstance(s, int)]
    bad += [f"{n}({s})" for n, s in pairs if isinstance(s, int) and s < 1]
    if bad:
        raise MeshError(f"mesh axis sizes must be positive integers: {', '.join(bad)}")
    if len(set(names)) != len(names):
        raise MeshError(f"mesh {pairs}: axis names must be distinct")
    dp = tuple(n for n in names if n in ("dp", "ep") or n.startswith(("dp_", "ep_")))
    cp = tuple(n for n in names if n == "cp" or n.startswith("cp_"))
    return MeshInfo(names, tuple(int(s) for _, s in pairs), dp, cp)


def mesh_axes(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """(axis names, axis sizes, global rank list) of a DeviceMesh, a MeshInfo or a mapping."""
    if hasattr(mesh, "mesh_dim_names"):
        if mesh.mesh_dim_names is None:
            raise MeshError("a mesh used with names needs mesh_dim_names")
        ranks = tuple(int(r) for r in mesh.mesh.flatten())
        return tuple(mesh.mesh_dim_names), tuple(mesh.mesh.shape), ranks
    info = mesh_info(mesh)
    return info.names, info.sizes, tuple(range(info.num_devices))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launched() -> bool:
    """Whether a launcher (torchrun, or anything setting its variables) started several ranks."""
    return all(v in os.environ for v in _LAUNCHER) and int(os.environ["WORLD_SIZE"]) > 1


def check_world(mesh: MeshInfo, source: str = "", timeout_s: float | None = None) -> int:
    """This rank, after checking that ``mesh`` covers the world exactly. Under torchrun with no
    process group yet, joins the one it describes first (``timeout_s``: see
    :func:`ensure_process_group`). The error names every factor, where the world size came
    from and, with ``source``, where the mesh came from."""
    if (dist.is_available() and dist.is_initialized()) or _launched():
        ensure_process_group(timeout_s)
    world = world_size()
    if mesh.num_devices != world:
        where = f" (the mesh of {source})" if source else ""
        if dist.is_available() and dist.is_initialized():
            origin = "the process group's"
        else:
            origin = (
                "no process group is initialised and no launcher set WORLD_SIZE: start the script "
                f"with torchrun --nproc-per-node {mesh.num_devices}, or call "
                "torch.distributed.init_process_group first"
            )
        raise MeshError(
            f"{mesh.describe()} = {mesh.num_devices} != world size {world} ({origin}){where}"
        )
    return dist.get_rank() if world > 1 else 0


def ensure_process_group(timeout_s: float | None = None) -> None:
    """Join the job torchrun (or any launcher setting RANK/WORLD_SIZE) describes, and leave it
    when the script exits (``comm.leave``). ``timeout_s`` bounds every wait in a collective
    (the watchdog, docs/failures.md: the ranks that never arrived are named); None leaves
    torch's own process-group timeout (600 s, no names)."""
    if dist.is_initialized():
        if timeout_s is not None:
            watch.start(timeout_s)
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
        nccl_environment()  # read when the group is made
    dist.init_process_group(backend, timeout=group_timeout(timeout_s))
    # autoshard joined it, so autoshard leaves it when the script ends
    atexit.register(comm.leave)
    if timeout_s is not None:
        watch.start(timeout_s)


def group_timeout(timeout_s: float | None) -> timedelta:
    """The process group's own timeout: torch's 600 s, or :data:`watch.BACKSTOP_S` after the
    watchdog's ``timeout_s``. Under NCCL it bounds what runs on the device (NCCL's watchdog
    aborts a collective past it); the watchdog, first, names the rank that never arrived."""
    return timedelta(seconds=600.0 if timeout_s is None else timeout_s + watch.BACKSTOP_S)


#: where torch's flight recorder writes each rank's last collectives (the rank appended)
TRACE_PREFIX = os.path.join(tempfile.gettempdir(), "autoshard-nccl-trace-rank-")
#: what NCCL's watchdog is told where autoshard makes the process group: a collective past the
#: group's timeout aborts the communicator and ends the process (not a hang), and the flight
#: recorder keeps each rank's last collectives and writes them out then (both names torch
#: has read for these)
NCCL_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": TRACE_PREFIX,
    "TORCH_FR_DUMP_TEMP_FILE": TRACE_PREFIX,
}


def nccl_environment(environ: Any = None) -> dict[str, str]:
    """Set :data:`NCCL_ENVIRONMENT` in ``environ`` (default ``os.environ``) where it has no
    value of its own (a user's setting wins); returns what was set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in NCCL_ENVIRONMENT.items() if k not in environ}
    environ.update(added)
    return added


def init_mesh(axes: Mapping[str, int] | Any, *, timeout_s: float | None = None) -> DeviceMesh:
    """A DeviceMesh with named axes (major first) over all ranks, from an initialised process
    group or the torchrun environment; a MeshError names every factor if the sizes do not
    multiply to the world size. ``timeout_s``: the bound on every wait in autoshard's
    collectives, after which the ranks that never arrived are named (docs/failures.md)."""
    info = mesh_info(axes)
    ensure_process_group(timeout_s)
    check_world(info)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ranks = torch.arange(dist.get_world_size()).reshape(info.sizes)
    return DeviceMesh(device_type, ranks, mesh_dim_names=info.names)
