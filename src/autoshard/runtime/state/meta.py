"""Models too big for one device: built on the meta device, each rank makes real only its own
shards and fills them from ``init`` (docs/meta.md).

    with autoshard.meta_init():          # parameters on meta, buffers real
        model = Llama(config)
    pm = autoshard.parallelize(model, (x, y), mesh, zero=3, init="ckpt/step_1000")

``init`` is one of:

- an autoshard checkpoint directory (``autoshard.save``): read through DCP, each rank only the
  boxes its shards cover;
- a transformers checkpoint directory (``*.safetensors``, sharded or not) or one safetensors
  file: each rank reads only the slices of each tensor its shards cover;
- ``"reset"`` or a function of a module: the model's own initialisation, run module by module.
  Each module that owns parameters (in ``named_modules()`` order, a tied parameter by its first
  owner) is made real on the CPU at full size, initialised by its ``reset_parameters()`` (the
  constructor's defaults) and then the function, if given, with the RNG seeded from
  ``(seed, the module's name)``, cut into this rank's shards and dropped. The values depend
  on neither the split nor the order of other modules, so every split yields what
  :func:`materialize` gives on one device.

A rank's memory while setting up is its shards plus, at most, one module at full size (reset),
one saved box (a DCP checkpoint), or one slice being read (safetensors).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoshard.runtime.state.checkpoint import (
    MANIFEST,
    CheckpointError,
    Chunks,
    _aliases,
    _model_state,
    load_weights,
)

#: what ``init=`` accepts besides a path: a module's own ``reset_parameters``
RESET = "reset"


@contextmanager
def meta_init() -> Iterator[None]:
    """Build models with every parameter on the meta device (no memory) and buffers real, so a
    buffer the constructor computes (rotary tables, position ids) keeps its values:
    ``with autoshard.meta_init(): model = MyModel(...)``."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def on_meta(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters and buffers on the meta device."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state |= dict(model.named_buffers(remove_duplicate=False))
    return [name for name, t in state.items() if t.device.type == "meta"]


def check_init(model: nn.Module, init: Any) -> None:
    """A clear error before any work when ``init`` cannot make ``model`` real."""
    meta = on_meta(model)
    if not meta:
        if init is not None:
            raise ValueError("init= is for a model built on the meta device; this one is real")
        return
    if init is None:
        raise ValueError(
            f"{meta[0]} is on the meta device: give init= an autoshard checkpoint, a "
            f"transformers checkpoint directory or safetensors file, {RESET!r}, or a function "
            "that initialises one module (docs/meta.md)"
        )
    persistent = set(model.state_dict(keep_vars=True))
    lost = [name for name, b in model.named_buffers() if b.is_meta and name not in persistent]
    if lost:
        raise ValueError(
            f"buffer {lost[0]} is on the meta device and not part of any checkpoint (it is not "
            "persistent): build the model under autoshard.meta_init(), which keeps buffers real"
        )
    if callable(init) or init == RESET:
        buffers = [name for name, b in model.named_buffers() if b.is_meta]
        if buffers:
            raise ValueError(
                f"buffer {buffers[0]} is on the meta device and init={init!r} sets parameters "
                "only: build the model under autoshard.meta_init(), which keeps buffers real"
            )
    elif not Path(init).exists():
        raise FileNotFoundError(f"init={str(init)!r}: no such checkpoint file or directory")


def fill(
    module: nn.Module, model: nn.Module, init: Any, seed: int = 0, meta: list[str] | None = None
) -> None:
    """Set ``module``'s tensors (this rank's shards of ``model``, the meta model it was made
    from, or ``model`` itself) from ``init``; a collective of every rank for a DCP checkpoint.
    ``meta``: the names that were on the meta device (default: those of ``model`` now)."""
    if callable(init) or init == RESET:
        _run_init(module, model, init, seed)
        return
    path = Path(init)
    if (path / MANIFEST).is_file():
        load_weights(path, module)
    elif path.is_file() or any(path.glob("*.safetensors")):
        _read_safetensors(module, path, set(on_meta(model) if meta is None else meta))
    else:
        raise CheckpointError(
            f"{path} is neither an autoshard checkpoint (no {MANIFEST}) nor holds safetensors files"
        )


def materialize(model: nn.Module, init: Any, *, seed: int = 0) -> nn.Module:
    """``model``'s meta tensors made real on the CPU and set from ``init``, in place: the
    single-device model every split under ``parallelize(..., init=init, seed=seed)`` equals."""
    check_init(model, init)
    meta = on_meta(model)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device="cpu")
    fill(model, model, init, seed, meta)
    return model


# -- the model's own initialisation ----------------------------------------------------------------


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _run_init(module: nn.Module, model: nn.Module, init: Any, seed: int) -> None:
    """Initialise ``model`` module by module at full size on the CPU, each into ``module``'s
    boxes of its tensors (docs/meta.md says why the values do not depend on the split)."""
    targets = _targets(module)
    names = _names(module)
    done: set[int] = set()
    for prefix, owner in model.named_modules():
        own = {n: p for n, p in owner._parameters.items() if p is not None and id(p) not in done}
        if not own:
            continue
        done |= {id(p) for p in own.values()}
        real = {
            n: nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
            for n, p in own.items()
        }
        saved = dict(owner._parameters)
        owner._parameters.update(real)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(_seed_of(seed, prefix))
                _initialise(owner, prefix, init)
            state = {n: t for n, t in owner.state_dict(keep_vars=True).items() if "." not in n}
        finally:
            owner._parameters.update(saved)
        for name, value in state.items():
            fqn = f"{prefix}.{name}" if prefix else name
            chunks = targets.get(names.get(fqn, ""))
            if chunks is not None:
                _copy_boxes(chunks, lambda box, v=value: v[box])


def _initialise(owner: nn.Module, prefix: str, init: Any) -> None:
    """The module's constructor defaults (``reset_parameters``), then ``init`` if a function."""
    reset = getattr(owner, "reset_parameters", None)
    if reset is None and not callable(init):
        raise ValueError(
            f"module {prefix or '(the model)'} ({type(owner).__name__}) owns parameters and has "
            "no reset_parameters(): give init= a function that initialises one module"
        )
    if reset is not None:
        reset()
    if callable(init):
        init(owner)


# -- reading boxes ---------------------------------------------------------------------------------


def _targets(module: nn.Module) -> dict[str, Chunks]:
    """``module``'s tensors as the boxes of their global tensors, by ``model.<name>``."""
    return {k: v for k, v in _model_state(module).items() if isinstance(v, Chunks)}


def _copy_boxes(chunks: Chunks, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> None:
    with torch.no_grad():
        for start, size, view in chunks.boxes:
            box = tuple(slice(s, s + n) for s, n in zip(start, size, strict=True))
            view.copy_(read(box))


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = next(iter(path.glob("*.safetensors.index.json")), None)
    if index is not None:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def _read_safetensors(module: nn.Module, path: Path, meta: set[str]) -> None:
    """Each of ``module``'s boxes read as a slice of its tensor in the safetensors files;
    every tensor in ``meta`` (by any of its names) must be there."""
    from safetensors import safe_open

    targets = _targets(module)
    names = _names(module)
    found: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(os.fspath(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is no mapping)
                target = names.get(key)
                if target is None or target in found:
                    continue
                found.add(target)
                chunks = targets[target]
                if not chunks.shape:
                    _copy_boxes(chunks, lambda box, k=key, f=f: f.get_tensor(k))
                    continue
                part = f.get_slice(key)
                if tuple(part.get_shape()) != chunks.shape:
                    raise CheckpointError(
                        f"{file}: {key} is {tuple(part.get_shape())}, the model's {chunks.shape}"
                    )
                _copy_boxes(chunks, lambda box, part=part: part[box])
    missing = sorted({names[n] for n in meta if n in names} - found)
    if missing:
        raise CheckpointError(f"{path}: no tensor {missing[0][len('model.') :]!r} (or a tied name)")


def _names(module: nn.Module) -> dict[str, str]:
    """Every name a safetensors file may give a tensor (tied names too) -> its target key."""
    out = {}
    for name, saved in _aliases(module).items():
        out[name] = f"model.{saved}"
    for key in _targets(module):
        out[key[len("model.") :]] = key
    return out


__all__ = ["RESET", "check_init", "fill", "materialize", "meta_init", "on_meta"]
