"""Gradient clipping across shards, and one decision on non-finite gradients for every rank.

``autoshard.clip_grad_norm_(pm, max_norm)`` is ``torch.nn.utils.clip_grad_norm_`` of the single-
device model: the norm is over every parameter's whole gradient, each counted once however it
is split or replicated (a tied weight is one parameter), and every rank gets the same norm and
scales by the same factor. A non-finite gradient on any rank makes the norm non-finite on every
rank, so all skip the step together (``torch.isfinite(norm)``), or, with
``error_if_nonfinite=True``, all raise naming the rank and the parameter.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autoshard import comm


class NonFiniteGradientError(ValueError):
    """A gradient holds inf or nan; names the ranks and parameters."""


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def clip_grad_norm_(
    pm: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale every gradient of ``pm`` so that their global ``norm_type`` norm is at most
    ``max_norm``; returns the global norm (before clipping), the same on every rank."""
    # first the optimizer offload's (device heads and host tails, each a part of its tensor):
    # taking them moves what is still in .grad there
    grads = pm.offloaded_grads() if hasattr(pm, "offloaded_grads") else []
    grads += [(fqn, t.grad) for fqn, t in pm.local_tensors().items() if t.grad is not None]
    # parts in files (NVMe), each already reduced: its sum of powers, or its largest value
    streamed = pm.offloaded_norms(norm_type) if hasattr(pm, "offloaded_norms") else []
    # a rank without gradients still joins every collective below, or the others would wait
    device = pm.device
    if error_if_nonfinite:
        _raise_if_nonfinite(grads + streamed, pm.rank)
    if math.isinf(norm_type):
        maxima = [g.detach().abs().max().to(device, torch.float64) for _, g in grads + streamed]
        maxima.append(torch.zeros((), dtype=torch.float64, device=device))
        total = torch.stack(maxima).max().reshape(1)  # on the device: no host sync
        if _world() > 1:
            total = comm.all_reduce_max(total, list(range(_world())))
        norm = total[0]
    else:
        # Each part's share: its sum of powers over the number of ranks holding that same part.
        local = torch.zeros((), dtype=torch.float64, device=device)
        for fqn, g in grads:
            copies = pm.holders(fqn)
            local += g.detach().to(torch.float64).abs().pow(norm_type).sum().to(device) / copies
        for fqn, part in streamed:
            local += part.to(device) / pm.holders(fqn)
        total = local.reshape(1)
        if _world() > 1:
            comm.all_reduce_(total, list(range(_world())))
        norm = total[0] ** (1.0 / norm_type)
    # a non-finite norm scales by 1 (every rank skips the step alike), decided on the device
    # rather than by reading the norm back to the host
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    scale = torch.where(torch.isfinite(norm), scale, torch.ones_like(scale))
    for _, g in grads:
        g.detach().mul_(scale.to(g.device, g.dtype))
    if streamed:
        pm.scale_offloaded(scale)
    # the gradients' dtype, a rank without any the parameters': the same norm everywhere
    tensors = [g for _, g in grads] or list(pm.local_tensors().values())
    return norm.to(tensors[0].dtype if tensors else torch.float32)


def _raise_if_nonfinite(grads: list[tuple[str, torch.Tensor]], rank: int) -> None:
    mine = [f"rank {rank}: {fqn}" for fqn, g in grads if not torch.isfinite(g).all()]
    everyone: list = [mine]
    if _world() > 1:
        everyone = comm.all_gather_object(mine)
    found = [line for lines in everyone for line in lines]
    if found:
        raise NonFiniteGradientError(
            f"non-finite gradient on {', '.join(found[:4])}"
            + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        )


__all__ = ["NonFiniteGradientError", "clip_grad_norm_"]
