"""The bytes a rank holds in each tier (``pm.state_bytes``): the device's, and the host's
(the optimizer offload's master weights, gradients and state; the host tier's parameters, their
gradients and the optimizer's state of them; docs/parallelism/offload.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

KINDS = ("parameters", "gradients", "optimizer")


def _size(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of ``tensors`` by storage (a buffer shared by views counted once); a sparse
    tensor's indices and values."""
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        if t.is_sparse:
            total += _size([t._indices(), t._values()], seen)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _state(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> list:
    if optimizer is None:
        return []
    entries = [optimizer.state.get(p, {}) for p in params]
    return [v for st in entries for v in st.values() if isinstance(v, torch.Tensor)]


def state_bytes(
    local: list[torch.Tensor],
    held: dict[str, list[torch.Tensor]],
    offload: Any,
    host: Any,
    optimizer: torch.optim.Optimizer | None,
    tier: str,
) -> dict[str, int]:
    """``tier``'s bytes by kind: ``local`` the rank's parameters and buffers, ``held`` what
    ZeRO keeps besides, ``offload`` the optimizer offload, ``host`` the host tier (or None)."""
    if tier not in ("device", "host"):
        raise ValueError(f"tier={tier!r}: expected 'device' or 'host'")
    seen: set[int] = set()
    hosted = [t for t in local if host is not None and host.holds(t)]
    if tier == "host":
        extra = offload.host_tensors() if offload else {}
        tensors = {
            "parameters": hosted,
            "gradients": [t.grad for t in hosted],
            "optimizer": _state(optimizer, hosted),
        }
        return {k: _size(tensors[k] + extra.get(k, []), seen) for k in KINDS}
    mine = [t for t in local if not any(t is h for h in hosted)]
    extra = offload.device_tensors() if offload else {}
    params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []
    tensors = {
        "parameters": mine + held["parameters"],
        "gradients": [t.grad for t in mine] + held["gradients"],
        "optimizer": _state(optimizer, [p for p in params if not any(p is h for h in hosted)]),
    }
    return {k: _size(tensors[k] + extra.get(k, []), seen) for k in KINDS}


__all__ = ["state_bytes"]
