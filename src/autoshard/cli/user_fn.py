"""The user's function, one shape for ``autoshard plan --model-fn`` and ``autoshard train``.

It returns ``(model, data)`` or ``(model, data, loss_fn)``, or a dict with ``model``,
``dataset`` or ``batch``, and optionally ``loss_fn`` and ``optimizer``; ``data`` is a map-style
dataset or one global batch (a tuple of tensors, or a dict of them that the model takes as
keywords: a transformers batch of ``input_ids``, ``labels``, ``attention_mask``). ``plan``
plans for the batch, or for ``--batch`` samples of the dataset, shaped by ``--batch`` and
``--seq`` where they are given.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree

#: samples of a dataset that ``plan`` plans for without ``--batch`` (``train``'s default)
DEFAULT_BATCH = 8


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


def plan_inputs(target: str, batch: int | None, seq: int | None) -> tuple[Any, Any, Any]:
    """The model, the example batch and the loss function ``plan --model-fn`` plans:
    ``batch`` sets dim 0 of every input (the samples of a dataset), ``seq`` dim 1 of every
    input of two or more dims (the sequence of token batches)."""
    from autoshard.cli.train import _parts, user_function

    try:
        parts = _parts(user_function(target), target)
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


__all__ = ["DEFAULT_BATCH", "collated", "plan_inputs", "resized"]
