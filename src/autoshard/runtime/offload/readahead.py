"""ZeRO 3's shards kept in NVMe's files (``nvme.py``) read ahead of their gathers: while one
unit computes and the next one's gather is under way, the I/O thread reads the unit after that
into one bounded host buffer, so its gather copies from memory instead of waiting for the
disk. The buffer holds one slot's worth of elements per dtype (the budget's third part, beside
the step's two slots); what of a unit does not fit in it is read at its gather, as before."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from autoshard.runtime.offload.chunks import _Piece


class ReadAhead:
    """The shards read ahead, by ``id`` of the shard: the read's future, its part of the
    buffer and how many of its first elements it holds."""

    def __init__(
        self,
        io: ThreadPoolExecutor,
        read: Callable[[_Piece, str, int, torch.Tensor], None],
        elements: Callable[[torch.dtype], int],
        pinned: bool,
    ) -> None:
        self._io, self._read, self._elements, self._pinned = io, read, elements, pinned
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._pending: dict[int, tuple[Future, torch.Tensor]] = {}
        self._asked: tuple[int, ...] = ()

    def ask(self, pieces: list[_Piece]) -> None:
        """Read ``pieces``' parameters (their first elements, as many as the buffer holds)
        on the I/O thread, after what it was asked before; what was read ahead and not taken
        is let go."""
        asked = tuple(id(p.param) for p in pieces)
        if asked == self._asked:  # every fetch of the unit before asks again
            return
        self.drop()
        self._asked = asked
        used: dict[torch.dtype, int] = {}
        jobs = []
        for piece in pieces:
            dtype = piece.param.dtype
            start = used.get(dtype, 0)
            n = min(piece.tail, self._elements(dtype) - start)
            if n <= 0:
                continue
            jobs.append((piece, self._buffer(dtype)[start : start + n]))
            used[dtype] = start + n
        if not jobs:
            return
        future = self._io.submit(lambda: [self._read(p, "master", 0, v) for p, v in jobs] and None)
        for piece, view in jobs:
            self._pending[id(piece.param)] = (future, view)

    def take(self, piece: _Piece, into: torch.Tensor) -> int:
        """Copy what was read ahead of ``piece`` into the flat tensor ``into`` (waiting for
        the read if it is still going); the elements copied, 0 where none were read ahead."""
        entry = self._pending.pop(id(piece.param), None)
        if entry is None:
            return 0
        future, view = entry
        future.result()
        into[: view.numel()].copy_(view)  # blocking: the buffer is read into again next
        return view.numel()

    def drop(self) -> None:
        """Let go of what was read ahead (the files are about to change, or another unit is
        asked for), after its reads have finished."""
        for future, _ in self._pending.values():
            future.result()
        self._pending, self._asked = {}, ()

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._buffers:
            # host: the read-ahead buffer, pinned for CUDA's copies
            self._buffers[dtype] = torch.empty(
                self._elements(dtype), dtype=dtype, device="cpu", pin_memory=self._pinned
            )
        return self._buffers[dtype]

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())


__all__ = ["ReadAhead"]
