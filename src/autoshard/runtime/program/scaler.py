"""Dynamic loss scaling for float16 compute, one decision for every rank.

float16 gradients underflow below 6e-8, so the loss is multiplied by a large scale before
backward and the gradients divided by it before the optimizer reads them; a step whose
gradients overflowed (inf or nan) is skipped and the scale halved, and after
``growth_interval`` clean steps it is doubled (torch.amp.GradScaler's scheme). Here the
overflow check spans every rank: a shard that overflowed on one rank skips the step on all,
so replicas never diverge.

scaler = autoshard.GradScaler()
scaler.scale(pm(*batch)).backward()
scaler.unscale_(opt)                     # optional: before clipping
autoshard.clip_grad_norm_(pm, 1.0)
scaler.step(opt)                         # skipped on every rank if any gradient overflowed
scaler.update()

Under optimizer offload the gradients of the offloaded parts are not in ``.grad`` (the host's
tails, the device's heads): they are checked and divided where they are, and a skipped step
drops them as the step would have consumed them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autoshard import comm
from autoshard.devices import rank_device
from autoshard.runtime.offload import offloads_of


class GradScaler:
    """Loss scaling whose skip decision every rank takes together (see the module's text)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0):
            raise ValueError(
                f"GradScaler: growth_factor({growth_factor}) must exceed 1, backoff_factor"
                f"({backoff_factor}) lie in (0, 1) and growth_interval({growth_interval}) be "
                f"positive"
            )
        self.enabled = enabled
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._clean_steps = 0
        self._unscaled: dict[int, bool] = {}  # id(optimizer) -> whether it overflowed

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (backward it instead of ``loss``)."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, once per step, and
        decide with every rank whether any of them overflowed."""
        if not self.enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since update()")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        # the flag every rank sums: on the rank's device, also where no gradient is
        device = params[0].device if params else rank_device()
        overflow = torch.zeros(1, dtype=torch.float32, device=device)
        with torch.no_grad():
            for grad in grads:  # no host sync per tensor: one flag, read once
                grad.mul_(1.0 / self._scale)
                overflow += (~torch.isfinite(grad)).any()
            # the offloaded parts' gradients are out of ``.grad``: heads on the device, tails
            # on the host or in files
            for offload in offloads_of(optimizer):
                for flag in offload.unscale(optimizer, 1.0 / self._scale):
                    overflow += flag.to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            overflow = comm.all_reduce_max(overflow, list(range(dist.get_world_size())))
        self._unscaled[id(optimizer)] = bool(overflow.item() > 0)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless a gradient overflowed on any rank (then nothing)."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._unscaled[id(optimizer)]:
            for offload in offloads_of(optimizer):  # whose gradients the step would consume
                offload.skip(optimizer)
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflowing step, grow after ``growth_interval`` clean ones."""
        if not self.enabled:
            return
        if any(self._unscaled.values()):
            self._scale *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._scale *= self.growth_factor
                self._clean_steps = 0
        self._unscaled = {}

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self._scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])


__all__ = ["GradScaler"]
