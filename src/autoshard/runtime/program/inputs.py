"""A rank's part of a value given whole: an input (moved to the rank's device) or a state
dict's tensor."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from autoshard.layout import Layout
from autoshard.redistribution import redistribute, shard_tensor
from autoshard.runtime.program.copies import rank_rows


def local_input(
    x: Any, layout: Layout, rank: int, name: str, cast: bool = False, device: Any = None
) -> Any:
    """This rank's part of an input (given whole or as the part already), on ``device``:
    cut first, so only the part moves; from pinned host memory the copy does not block."""
    if not isinstance(x, torch.Tensor):
        return x
    if cast and x.is_floating_point() and x.dtype != layout.dtype:
        x = x.to(layout.dtype)  # mixed precision: inputs in the compute dtype
    if tuple(x.shape) == layout.shape and tuple(x.shape) != layout.local_shape():
        x = shard_tensor(x, layout, rank)
    if tuple(x.shape) == layout.local_shape():
        return x if device is None else x.to(device, non_blocking=True)
    raise ValueError(
        f"input {name} has shape {tuple(x.shape)}; expected its part {layout.local_shape()} "
        f"of {layout} or the whole {layout.shape}"
    )


def shard_inputs(batch: Any, pm: Any, train: bool | None = None) -> Any:
    """This rank's part of a global batch for ``pm`` (a ``ParallelModule`` or a
    ``PipelineModule``), in the structure given (tensors in input order); a pipeline
    (``whole_batch``) takes the whole batch and cuts it into micro-batches itself."""
    if pm.whole_batch:
        return batch
    mode = pm.training if train is None else train
    plan, captured = pm.plans[mode], pm.captured[mode]
    flat, spec = pytree.tree_flatten(batch)
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if len(tensors) != len(captured.inputs):
        raise ValueError(
            f"batch has {len(tensors)} tensors; the model takes {len(captured.inputs)}"
        )
    names, k = iter(captured.inputs), pm.options.copies
    out = [
        rank_rows(x, plan.inputs[n], k, pm.rank, n)
        if isinstance(x, torch.Tensor) and (n := next(names))
        else x
        for x in flat
    ]
    return pytree.tree_unflatten(out, spec)


def part_of(value: torch.Tensor, layout: Layout, key: str, rank: int) -> torch.Tensor:
    """This rank's part in ``layout`` of a state dict's ``value``: a DTensor (redistributed
    from its placements) or the single-device tensor."""
    from torch.distributed.tensor import DTensor

    if tuple(value.shape) != layout.shape:
        raise ValueError(f"state dict: {key} is {tuple(value.shape)}, the model's {layout.shape}")
    if not isinstance(value, DTensor):
        return shard_tensor(value.to(layout.dtype), layout, rank)
    local = value.to_local().to(layout.dtype)
    src = Layout.from_placements(
        value.placements, value.device_mesh, layout.shape, dtype=layout.dtype
    )
    return redistribute(local, src, layout)


__all__ = ["local_input", "part_of"]
