"""Checkpoints through torch.distributed.checkpoint (DCP), written by every rank as its own
shards and loaded under any plan, mesh, ZeRO stage or world size (docs/checkpoints.md).

    autoshard.save("ckpt/step_100", pm, opt, step=100, loader=loader, extra={...})
    info = autoshard.load(autoshard.latest("ckpt"), pm, opt, loader=loader)

Every tensor is saved as the chunks of its global tensor this rank holds: each is a box of
global offsets and sizes (a layout's local part is one box, or several for a factored dim such
as fused QKV split by heads; a ZeRO shard is a block of rows of it), so nothing is gathered
onto one rank and DCP reads back, for each box a loading rank needs, the overlapping parts of
the saved ones. Replicas write once (DCP keeps one writer per box).

A save writes into ``<path>.incomplete`` and, once every rank is done and the manifest
(``autoshard.json``) is written, renames it to ``<path>``: a save that is interrupted never
becomes a checkpoint. The manifest records every file with its size and CRC-32 (each rank
sums the files it wrote, as they are on disk); :func:`latest` takes the newest checkpoint
whose files are all there at their sizes, and :func:`load` checks the sums before it reads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard import comm
from autoshard.runtime.state.chunks import Chunks, chunks_of
from autoshard.runtime.state.manifest import (
    FORMAT,
    INCOMPLETE,
    MANIFEST,
    CheckpointDamaged,
    CheckpointError,
    _distributed,
    _rank,
    file_record,
    latest,
    verified,
)

# -- what is saved ---------------------------------------------------------------------------------


def _parts(module: nn.Module) -> dict[str, tuple[torch.Tensor, tuple, tuple[int, ...], Any]]:
    """Each tensor of the model's state by name: (this rank's tensor, its global indices per
    dim, the global shape, its rows of dim 0 under ZeRO or None)."""
    if hasattr(module, "checkpoint_parts"):
        return module.checkpoint_parts()
    state = module.state_dict(keep_vars=True)
    return {
        name: (t, tuple(slice(0, n) for n in t.shape), tuple(t.shape), None)
        for name, t in state.items()
    }


def _aliases(module: nn.Module) -> dict[str, str]:
    """Every state dict name that is another's tied name -> the name saved."""
    if hasattr(module, "checkpoint_aliases"):
        return module.checkpoint_aliases()
    seen: dict[int, str] = {}
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        key = id(t)
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def _model_state(module: nn.Module, saved: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The model's tensors as chunks, by ``model.<name>``; ``saved``: a checkpoint's tied
    names (name -> the name it was saved under), for a module that names them otherwise."""
    aliases = _aliases(module)
    # a tensor whose values are elsewhere (a shard in NVMe's files): a host tensor of them,
    # which the module writes back when told it was loaded
    held = getattr(module, "in_memory", lambda t: t)
    return {
        f"model.{(saved or {}).get(name, name)}": chunks_of(held(t).detach(), index, shape, rows)
        for name, (t, index, shape, rows) in _parts(module).items()
        if name not in aliases
    }


def _offloaded(
    module: nn.Module, optimizer: torch.optim.Optimizer, loading: bool = False
) -> dict[int, dict]:
    """The state of the tensors whose optimizer state the module keeps elsewhere (the host),
    by ``id`` of the tensor ``optimizer`` steps, as it would be without offload (``loading``:
    made first where no step has made it, to be read into)."""
    if hasattr(module, "offloaded_optimizer_state"):
        return module.offloaded_optimizer_state(optimizer, ready=loading)
    return {}


def _optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, str] | None = None,
    offloaded: Mapping[int, dict] | None = None,
) -> dict[str, Any]:
    """The optimizer's state by ``optim.<name>.<key>`` (tensors shaped like their parameter
    as its chunks) and its parameter groups' settings; ``offloaded``: the state of the tensors
    an offload holds, in place of the optimizer's own (none)."""
    parts = _parts(module)
    offloaded = offloaded if offloaded is not None else _offloaded(module, optimizer)
    saved = saved or {}
    names = {id(t): name for name, (t, _, _, _) in parts.items()}
    out: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        settings["params"] = [
            saved.get(names.get(id(p)), names.get(id(p))) for p in group["params"]
        ]
        if None in settings["params"]:
            raise CheckpointError("the optimizer steps a tensor that is not the model's")
        groups.append(settings)
        for p in group["params"]:
            name = names[id(p)]
            _, index, shape, rows = parts[name]
            state = offloaded.get(id(p)) or optimizer.state.get(p, {})
            for key, value in state.items():
                where = f"optim.{saved.get(name, name)}.{key}"
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim():
                    out[where] = chunks_of(value, index, shape, rows)
                else:
                    out[where] = value
    out["optim.param_groups"] = groups
    return out


def _ready_optimizer(
    optimizer: torch.optim.Optimizer, elsewhere: Mapping[int, dict] | None = None
) -> None:
    """Make the optimizer's state exist, so loading has tensors to read into: one step with
    zero gradients and a learning rate of 0 (parameters unchanged), as torch's
    distributed state-dict helpers do; not for the tensors whose state is ``elsewhere``."""
    params = [
        p for g in optimizer.param_groups for p in g["params"] if id(p) not in (elsewhere or {})
    ]
    if all(p in optimizer.state for p in params):
        return
    grads = [p.grad for p in params]
    rates = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    optimizer.step()
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    for g, lr in zip(optimizer.param_groups, rates, strict=True):
        g["lr"] = lr


# -- saving ----------------------------------------------------------------------------------------


def _barrier() -> None:
    if _distributed():
        comm.barrier()


def save(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    loader: Any = None,
    extra: Any = None,
) -> Path:
    """Save the model's state (each rank its shards), the optimizer's, ``loader``'s position,
    every rank's RNG state and ``extra`` (any picklable object) as the checkpoint ``path``; a
    collective of every rank. Returns the path."""
    path = Path(path)
    if path.exists() and not (path / MANIFEST).exists():
        raise CheckpointError(f"{path} exists and is not an autoshard checkpoint")
    staging = path.with_name(path.name + INCOMPLETE)
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
    _barrier()
    state = _model_state(module)
    if optimizer is not None:
        state |= _optimizer_state(module, optimizer)
    run = getattr(module, "run_state", None)
    state["autoshard.run"] = {"step": step, "model_step": run.step if run else None}
    state[f"autoshard.rng.{_rank()}"] = torch.get_rng_state()
    if loader is not None:
        state["autoshard.loader"] = loader.state_dict()
    state["autoshard.extra"] = extra
    import torch.distributed.checkpoint as dcp

    from autoshard.runtime.state.dcp_io import SavePlanner, Writer

    writer = Writer(staging)
    dcp.save(state, storage_writer=writer, planner=SavePlanner(), no_dist=not _distributed())
    if hasattr(module, "checkpoint_saved"):  # what it read to be saved (from NVMe's files)
        module.checkpoint_saved()
    mine = {name: file_record(staging / name) for name in writer.names()}
    files = comm.all_gather_object(mine) if _distributed() else [mine]
    if _rank() == 0:
        listed = {name: record for each in files for name, record in each.items()}
        listed[".metadata"] = file_record(staging / ".metadata")
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": dist.get_world_size() if _distributed() else 1,
            "aliases": _aliases(module),
            "files": dict(sorted(listed.items())),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _commit(staging, path)
    _barrier()
    return path


def _commit(staging: Path, path: Path) -> None:
    """Make ``staging`` the checkpoint ``path`` (a rename; an older one at ``path`` goes)."""
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, path)


# -- loading ---------------------------------------------------------------------------------------


def load(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loader: Any = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint ``path`` into ``module`` (a ParallelModule under any plan, mesh,
    ZeRO stage or world size, or a plain ``nn.Module``), ``optimizer`` and ``loader``; a
    collective of every rank. Returns ``{"step": ..., "extra": ...}`` as saved. First every
    file is checked against the manifest (``verify``: its checksum too, each rank summing its
    share of the files); a damaged one is a :class:`CheckpointDamaged` on every rank, before
    anything is read."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    saved = verified(path, verify)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    state = _model_state(module, saved.get("aliases"))
    offloaded: dict[int, dict] = {}
    if optimizer is not None:
        offloaded = _offloaded(module, optimizer, loading=True)
        _ready_optimizer(optimizer, offloaded)
        _drop_unsaved(module, optimizer, keys, saved.get("aliases"))
        state |= _optimizer_state(module, optimizer, saved.get("aliases"), offloaded)
    objects = ["autoshard.run", "autoshard.extra"] + (["autoshard.loader"] if loader else [])
    for key in objects:
        state[key] = None
    rng = f"autoshard.rng.{_rank()}"
    if rng in keys:
        state[rng] = torch.get_rng_state()
    state |= _read(path, state)  # the objects read
    _loaded(module)
    if optimizer is not None:
        _restore_groups(optimizer, state["optim.param_groups"])
        if offloaded:
            module.load_offloaded_optimizer_state(optimizer, offloaded)
    if rng in state:
        torch.set_rng_state(state[rng])
    if loader is not None:
        loader.load_state_dict(state["autoshard.loader"])
    run = getattr(module, "run_state", None)
    if run is not None and state["autoshard.run"]["model_step"] is not None:
        run.step = state["autoshard.run"]["model_step"]
    return {"step": state["autoshard.run"]["step"], "extra": state["autoshard.extra"]}


def _drop_unsaved(
    module: nn.Module, optimizer: torch.optim.Optimizer, keys: Any, saved: Mapping[str, str] | None
) -> None:
    """Forget the state that loading made for each tensor the checkpoint has none of (one
    that never had a gradient when it was saved: torch's optimizers make no state for it),
    so it loads stateless, as ``optimizer.load_state_dict`` leaves it. A tensor with some of
    its state saved keeps all of it, and the missing part is an error naming it; so is the
    state of a tensor an offload steps (its host state is the offload's to make)."""
    if "optim.param_groups" not in keys:
        return  # no optimizer saved at all: the missing state is the error to give
    names = {id(t): name for name, (t, _, _, _) in _parts(module).items()}
    saved = saved or {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            name = saved.get(name, name)
            state = optimizer.state.get(p, {})
            if name is None or any(f"optim.{name}.{key}" in keys for key in state):
                continue
            optimizer.state.pop(p, None)


def _read(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Read ``state``'s tensors in place; returns the objects read."""
    import torch.distributed.checkpoint as dcp

    from autoshard.runtime.state.dcp_io import LoadPlanner

    planner = LoadPlanner()
    try:
        with torch.no_grad():
            dcp.load(state, checkpoint_id=path, planner=planner, no_dist=not _distributed())
    except dcp.api.CheckpointException as err:  # DCP wraps what each rank raised
        for failure, _ in err.failures.values():
            if isinstance(failure, CheckpointError):
                raise CheckpointError(f"{path}: {failure}") from None
        raise
    return planner.state_dict


def load_weights(path: str | os.PathLike, module: nn.Module, *, verify: bool = True) -> None:
    """Load only the model's tensors of the checkpoint ``path`` into ``module`` (no optimizer,
    step, RNG or loader); a collective of every rank, checked first as :func:`load` does."""
    path = Path(path)
    saved = verified(path, verify)
    _read(path, _model_state(module, saved.get("aliases")))
    _loaded(module)


def _loaded(module: nn.Module) -> None:
    """Tell a module whose weights were read in place (its host copies follow them)."""
    if hasattr(module, "loaded"):
        module.loaded()


def _restore_groups(optimizer: torch.optim.Optimizer, groups: Any) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        for key, value in saved.items():
            if key != "params":
                group[key] = value


__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "Chunks",
    "chunks_of",
    "latest",
    "load",
    "load_weights",
    "save",
]
