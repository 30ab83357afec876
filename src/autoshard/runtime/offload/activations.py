"""Activation offload (docs/parallelism/offload.md): the tensors autograd saves for backward inside
the blocks a module glob names wait on the host, not the device, between a block's forward and its
backward.

The lowering runs each such block as its own submodule (as recompute does), wrapped in
:class:`OffloadedBlock`, whose forward runs under autograd's saved-tensor hooks. The pack hook
copies each saved tensor to a host tensor (pinned, ``non_blocking`` on a side stream under
CUDA, the device tensor recorded on that stream so its memory is not reused before the copy
ends) and keeps only that; a tensor saved twice (one input of three projections) is copied
once. Parameters and buffers stay where they are: they live on the device anyway.

In backward the first unpack of a block copies all of its tensors back (on the side stream,
an event after them that the compute stream waits for before reading one) and starts the
copies of the block that ran forward before it, so those are in flight while this block's
backward computes. A tensor's device copy is dropped once its every saved use has been read;
a backward that keeps its graph (``retain_graph``) fetches it again when read again.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn


class _Entry:
    """One saved tensor: its host copy, and its device copy while backward reads it."""

    __slots__ = ("device", "host", "left", "uses")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.device: torch.Tensor | None = None
        self.uses = self.left = 0


class _Store:
    """What one forward of one block saved; ``previous`` is the store of the block that ran
    forward before it in the same run of the program (the next one backward reaches)."""

    def __init__(self, offload: ActivationOffload, previous: _Store | None) -> None:
        self.offload = offload
        self.previous = weakref.ref(previous) if previous is not None else None
        self.entries: dict[tuple, _Entry] = {}
        # the device tensors saved, kept until the block's forward ends: a key's storage
        # address must not be reused by another tensor while keys are compared
        self.held: list[torch.Tensor] = []
        self.event: Any = None

    def pack(self, t: torch.Tensor) -> Any:
        if not self.offload.moves(t):
            return t
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(self.offload.to_host(t))
            self.held.append(t)
        entry.uses += 1
        entry.left = entry.uses
        return (self, entry)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        _, entry = packed
        if entry.device is None:
            self.fetch()
            previous = self.previous() if self.previous is not None else None
            if previous is not None and previous.fetch():
                self.offload.prefetches += 1  # in flight while this block's backward computes
        self.offload.wait(self.event)
        t = entry.device
        entry.left -= 1
        if entry.left == 0:  # every use read: autograd holds it now, for as long as it needs
            entry.device, entry.left = None, entry.uses
        return t

    def fetch(self) -> bool:
        """Copy back the tensors of this block not on the device now; whether there were."""
        missing = [e for e in self.entries.values() if e.device is None]
        if missing:
            self.event = self.offload.to_device(missing)
        return bool(missing)

    def close(self) -> None:
        self.held = []


class ActivationOffload:
    """The host tier of the activations the blocks matching ``glob`` save for backward on a
    rank computing on ``device``; ``resident`` gives the tensors that stay (parameters and
    buffers)."""

    def __init__(
        self, glob: str, device: torch.device, resident: Callable[[], Iterable[torch.Tensor]]
    ) -> None:
        self.glob = glob
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._resident = resident
        self._kept: set[int] = set()
        self._positions = itertools.count()
        self._last: tuple[int, int, Any] | None = None  # program, position, store
        #: bytes copied to the host and back to the device since the module was made
        self.to_host_bytes = 0
        self.to_device_bytes = 0
        #: blocks whose tensors started back while the block after them ran its backward
        self.prefetches = 0
        #: the block paths wrapped, in the order of their programs
        self.blocks: list[str] = []

    def wrap(self, program: int) -> tuple[str, Callable[[str, nn.Module], nn.Module]]:
        """What the lowering of ``program`` (a number of the caller's) wraps its blocks with."""

        def make(block: str, module: nn.Module) -> nn.Module:
            self.blocks.append(block)
            return OffloadedBlock(module, block, self, program, next(self._positions))

        return self.glob, make

    def open(self, program: int, position: int) -> _Store:
        """A store for a block's forward: the next of the run the block before it began, or
        a new run (another program, or the program run again from an earlier block)."""
        last = self._last
        previous = None
        if last is not None and last[0] == program and last[1] < position:
            previous = last[2]()
        if previous is None:  # a new run: the resident tensors of now
            self._kept = {t.untyped_storage().data_ptr() for t in self._resident()}
        store = _Store(self, previous)
        self._last = (program, position, weakref.ref(store))
        return store

    def moves(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor goes to the host: on this device, not a parameter or
        buffer (nor a view of one), not empty."""
        return (
            t.device == self.device
            and not isinstance(t, nn.Parameter)
            and t.numel() > 0
            and t.untyped_storage().data_ptr() not in self._kept
        )

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        # host: the saved tensor's copy, pinned so the copy from CUDA does not block
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._cuda)
        self.to_host_bytes += host.numel() * host.element_size()
        if not self._cuda:
            host.copy_(t)
            return host
        # after the op that made it; its memory kept for the side stream until the copy ends
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self._stream)
        return host

    def to_device(self, entries: list[_Entry]) -> Any:
        """Start the copies of ``entries`` back to the device; the event after them (None
        where the copies are done on return)."""
        for e in entries:
            e.device = torch.empty(e.host.shape, dtype=e.host.dtype, device=self.device)
            self.to_device_bytes += e.host.numel() * e.host.element_size()
        if not self._cuda:
            for e in entries:
                e.device.copy_(e.host)
            return None
        # the new tensors' memory may have been read by kernels queued on the compute stream
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for e in entries:
                e.device.copy_(e.host, non_blocking=True)
                e.device.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class OffloadedBlock(nn.Module):
    """Runs ``block`` with the tensors it saves for backward on the host."""

    def __init__(
        self, block: nn.Module, path: str, offload: ActivationOffload, program: int, position: int
    ) -> None:
        super().__init__()
        self.block, self.path = block, path
        # not a submodule: one offload serves every block of the rank's programs
        object.__setattr__(self, "offload", offload)
        self.program, self.position = program, position

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(*args)
        store = self.offload.open(self.program, self.position)
        with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
            out = self.block(*args)
        store.close()
        return out

    def extra_repr(self) -> str:
        return f"path={self.path}, saved tensors on the host"


def activation_offload(
    offload: Any, device: torch.device, resident: Callable[[], Iterable[torch.Tensor]]
) -> ActivationOffload | None:
    """The offload ``Options.offload`` asks for (its ``activations`` glob), or None."""
    glob = (offload or {}).get("activations")
    return ActivationOffload(glob, device, resident) if glob else None


__all__ = ["ActivationOffload", "OffloadedBlock", "activation_offload"]
