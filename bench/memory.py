"""Peak bytes of tensor storage on CPU, counted the same way whatever library made the tensors.

CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so :class:`LiveBytes`
counts storages: a dispatch mode sees every tensor an operator returns (in forward, backward,
hooks, optimizers and collectives' outputs alike) and adds its storage's bytes the first time it
sees it; a weak reference subtracts them when the storage is freed, and ``resize_`` (FSDP2 frees
gathered parameters that way) is followed. Storages the mode never saw an operator make (the
reference model's, told with ``ignore``) count nothing, so build the measured thing inside it.
DTensor operators are left to DTensor, whose local operators the mode then sees.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...``: ``m.live`` bytes now, ``m.peak`` the most seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._bytes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes counted]
        self._resize: Any = None

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Storages made before the mode (views of them are not new memory)."""
        for t in tensors:
            self._bytes.setdefault(t.untyped_storage(), [0])

    def reset_peak(self) -> None:
        self.peak = self.live

    def _see(self, storage: torch.UntypedStorage) -> None:
        if storage in self._bytes:
            return
        cell = [storage.nbytes()]
        self._bytes[storage] = cell
        weakref.finalize(storage, self._free, cell)
        self._add(cell[0])

    def _free(self, cell: list[int]) -> None:
        self.live -= cell[0]

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def __enter__(self) -> LiveBytes:
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            cell = self._bytes.get(storage)
            if cell is not None:
                self._add(storage.nbytes() - cell[0])
                cell[0] = storage.nbytes()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if DTensor in types:
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and t.device.type == "cpu":
                self._see(t.untyped_storage())
        return out
