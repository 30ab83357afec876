"""The module's face to its state beyond the device (docs/parallelism/offload.md): the bytes a
rank holds by tier, the bytes and seconds the offloads moved, and the offloaded gradients and
optimizer state that clipping and checkpoints read as if nothing were offloaded."""

from __future__ import annotations

from typing import Any

import torch

from autoshard.runtime.program.tiers import state_bytes


class OffloadedState:
    """Read by ``ParallelModule`` and its pipeline: ``_offload`` (the optimizer offload or
    None), ``_host`` (the host tier or None), ``_tables`` (embedding offload or None) and
    ``_zero`` are set by the module's constructor."""

    _offload: Any
    _host: Any
    _tables: Any
    _zero: Any
    local_tensors: Any  # the module's own: its parameters and buffers by name

    def state_bytes(
        self, optimizer: torch.optim.Optimizer | None = None, tier: str = "device"
    ) -> dict[str, int]:
        """Bytes this rank holds now in ``tier`` ("device" or "host": the optimizer offload's
        part and the host tier's parameters), by storage (a buffer shared by views counted
        once): ``parameters`` (the optimizer's, ZeRO's gathered copies, buffers; on the host the
        master weights and the host's parameters), ``gradients`` (``.grad`` and gradient
        buffers kept between backwards), ``optimizer`` (``optimizer``'s state and the offload's)."""
        local = list(self.local_tensors().values())
        return state_bytes(local, self._zero.held(), self._offload, self._host, optimizer, tier)

    def _on_host(self, t: torch.Tensor) -> bool:
        return self._host is not None and self._host.holds(t)

    def offload_traffic(self) -> dict[str, int]:
        """Bytes of embedding rows the last training step moved to the device (the unique
        rows each lookup read) and to the host (the summed gradients of their union)."""
        return dict(self._tables.traffic) if self._tables else {"to_device": 0, "to_host": 0}

    def nvme_io(self) -> dict[str, float]:
        """Bytes read and written to the NVMe files and seconds taken since the module was made;
        ``ahead_bytes``: of those read, ZeRO 3's shards a gather found read ahead."""
        io = getattr(self._offload, "io", None)
        none = {"read_bytes": 0, "read_s": 0.0, "write_bytes": 0, "write_s": 0.0, "ahead_bytes": 0}
        return dict(io or none)

    def offload_seconds(self) -> dict[str, float]:
        """Seconds the optimizer offload's host update and copies back took since the module
        was made (docs/parallelism/offload.md)."""
        seconds = getattr(self._offload, "seconds", None)
        return dict(seconds or {"host_update": 0.0, "copy_back": 0.0})

    def offloaded_norms(self, norm_type: float) -> list[tuple[str, torch.Tensor]]:
        """Sums of ``|g| ** norm_type`` (largest ``|g|`` for inf) of gradients in NVMe's files."""
        norms = getattr(self._offload, "tail_norms", None)
        return norms(norm_type) if norms else []

    def scale_offloaded(self, scale: torch.Tensor) -> None:
        if hasattr(self._offload, "scale_tails"):
            self._offload.scale_tails(scale)

    def offloaded_grads(self) -> list[tuple[str, torch.Tensor]]:
        """This step's offloaded gradients by name (device heads, host tails; clipping's)."""
        return self._offload.grads() if self._offload else []

    def offloaded_optimizer_state(
        self, optimizer: torch.optim.Optimizer, ready: bool = False
    ) -> dict[int, dict]:
        """The offloaded tensors' optimizer state by ``id`` of the tensor ``optimizer`` steps, as
        without offload (checkpoints'); ``ready``: made first where no step has made it."""
        if self._offload is None or not self._offload.owns(optimizer):
            return {}
        if ready:
            self._offload.ready(optimizer)
        return self._offload.state_of(optimizer)

    def load_offloaded_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[int, dict]
    ) -> None:
        if self._offload is not None and state:
            self._offload.load_state(optimizer, state)

    def in_memory(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or for a ZeRO 3 shard kept in NVMe's files a host tensor of its values
        (what checkpoints save from and load into; ``loaded`` writes it back)."""
        return self._offload.in_memory(t) if hasattr(self._offload, "in_memory") else t

    def checkpoint_saved(self) -> None:
        """A save is done with what ``in_memory`` read."""
        if hasattr(self._offload, "release"):
            self._offload.release()

    def loaded(self) -> None:
        """The weights were loaded in place: the host's master copies follow them."""
        if self._offload is not None:
            self._offload.refresh()


__all__ = ["OffloadedState"]
