"""The user's function, one shape for ``autoshard plan --model-fn`` and ``autoshard train``.

It returns ``(model, data)`` or ``(model, data, loss_fn)``, or a dict with ``model``,
``dataset`` or ``batch``, and optionally ``loss_fn`` and ``optimizer`` (``train``'s AdamW
keywords); ``data`` is a map-style dataset or one global batch (a tuple of tensors, or a dict of
them that the model takes as keywords: a transformers batch of ``input_ids``, ``labels``,
``attention_mask``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
import torch.utils._pytree as pytree

#: samples of a dataset that ``plan`` plans for without ``--batch`` (``train``'s default)
DEFAULT_BATCH = 8


def user_function(target: str) -> Any:
    """``module:function`` from the current directory or the installed packages, called."""
    import importlib

    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise ValueError(f"{target!r}: expected module:function, e.g. mymodels:make")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"{target!r}: no module {err.name!r} (looked in {os.getcwd()} and the installed "
            "packages)"
        ) from err
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{target!r}: {module_name} has no function {name!r}")
    return getattr(module, name)()


def parts_of(made: Any, target: str) -> dict[str, Any]:
    """What ``target``'s function returned (``made``) as ``model``, ``dataset`` or
    ``batch``, ``loss_fn``, ``optimizer``."""
    if isinstance(made, dict):
        parts = dict(made)
    elif isinstance(made, tuple | list) and len(made) in (2, 3):
        parts = {"model": made[0], "data": made[1], "loss_fn": made[2] if len(made) > 2 else None}
    else:
        raise ValueError(f"{target}: return (model, data[, loss_fn]) or a dict, not {made!r:.80}")
    data = parts.pop("data", None)
    if data is not None:
        keywords = isinstance(data, dict)  # a batch the model takes as keywords
        tensors = data.values() if keywords else data
        batch = isinstance(data, tuple | list | dict) and all(
            isinstance(t, torch.Tensor) for t in tensors
        )
        parts["batch" if batch else "dataset"] = data if keywords or not batch else tuple(data)
    if not isinstance(parts.get("model"), torch.nn.Module):
        raise ValueError(f"{target}: no nn.Module under 'model'")
    if parts.get("dataset") is None and parts.get("batch") is None:
        raise ValueError(f"{target}: give a dataset or an example batch")
    return parts


def train_example(parts: dict[str, Any], batch_size: int) -> tuple | dict[str, Any]:
    """The first global batch ``train`` plans and trains on: the batch given, or the first
    ``batch_size`` samples of the dataset."""
    if parts.get("batch") is not None:
        return parts["batch"]
    if len(parts["dataset"]) < batch_size:
        raise ValueError(
            f"the dataset has {len(parts['dataset'])} samples, fewer than --batch-size"
        )
    return collated(parts["dataset"], batch_size)


def collated(dataset: Any, size: int) -> tuple | dict[str, Any]:
    """``size`` samples of ``dataset``, the first ones again where it has fewer, as one
    batch: a dict where its samples are dicts, else a tuple of tensors."""
    from torch.utils.data import default_collate

    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    batch = default_collate([dataset[i % len(dataset)] for i in range(size)])
    if isinstance(batch, dict):
        return batch
    return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)


def resized(batch: Any, dim: int, size: int) -> Any:
    """``batch`` with dim ``dim`` of every tensor that has it at ``size``: its rows repeated
    and cut, so values stay the data's (token ids, masks)."""

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] == size:
            return x
        times = [1] * x.dim()
        times[dim] = math.ceil(size / x.shape[dim])
        return x.repeat(times).narrow(dim, 0, size)

    return pytree.tree_map(one, batch)


def global_rows(example: Any, microbatches: int | None = None) -> int:
    """The samples of the global batch ``example`` (dim 0 of its first tensor of one dim or
    more), which ``microbatches`` must divide where given."""
    tensors = (t for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor) and t.dim())
    rows = next(tensors).shape[0]
    if microbatches and rows % microbatches:
        raise ValueError(
            f"--microbatches {microbatches} does not divide the batch of {rows} samples"
        )
    return rows


def plan_inputs(target: str, batch: int | None, seq: int | None) -> tuple[Any, Any, Any]:
    """The model, the example batch and the loss function ``plan --model-fn`` plans:
    ``batch`` sets dim 0 of every input (the samples of a dataset), ``seq`` dim 1 of every
    input of two or more dims (the sequence of token batches)."""
    try:
        parts = parts_of(user_function(target), target)
    except ValueError as err:
        raise ValueError(f"--model-fn {err}") from err
    for flag, value in (("--batch", batch), ("--seq", seq)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: expected 1 or more")
    example = parts.get("batch")
    if example is None:
        example = collated(parts["dataset"], batch or DEFAULT_BATCH)
    elif batch is not None:
        example = resized(example, 0, batch)
    if seq is not None:
        example = resized(example, 1, seq)
    return parts["model"], example, parts.get("loss_fn")


__all__ = ["global_rows", "parts_of", "plan_inputs", "train_example", "user_function"]
