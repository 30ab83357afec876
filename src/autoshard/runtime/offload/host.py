"""The host tier of a rank's parameters (docs/parallelism/offload.md): ZeRO 3's shards under
``offload={"parameters": True}`` and the tables of ``offload={"embeddings": glob}`` are
parameters made on the host, pinned where CUDA runs, so the optimizer steps them there.

What crosses between them and the device is copied without blocking: from pinned memory to
the device on a side stream that first waits for the current one (a gather's copies and the
gather itself, so the compute queued meanwhile does not wait for them), and from the device
into pinned memory on the current stream, after the kernels that made the value. Each copy
has an event; ``settle`` waits for them all, before the host reads or writes its side again
(the end of a backward, and the step of an optimizer over these parameters).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


class HostTier:
    """The parameters a rank keeps on the host, and the copies to and from them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._events: list[Any] = []
        #: the host parameters by name
        self.params: dict[str, nn.Parameter] = {}
        self._ids: set[int] = set()
        #: id of a parameter kept in files (NVMe; it holds no memory) -> what reads it into
        #: a flat tensor given
        self.files: dict[int, Callable[[torch.Tensor], None]] = {}
        #: what reads such parameters ahead of their gather (NVMe's I/O thread), or None
        self.ahead: Callable[[list[torch.Tensor]], None] | None = None
        ref = weakref.ref(self)

        def before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            tier = ref()
            if tier is not None and tier.owns(optimizer):
                tier.settle()  # the step reads the gradients and writes what copies read

        handle = register_optimizer_step_pre_hook(before_step)
        weakref.finalize(self, handle.remove)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # host: the host tier, pinned so that copies to and from CUDA do not block
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.cuda)

    def place(self, fqn: str, value: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """A host parameter holding ``value`` (left unset where it is on meta)."""
        host = self.empty(value.shape, value.dtype)
        if not value.is_meta:
            host.copy_(value.detach())
        param = nn.Parameter(host, requires_grad=requires_grad)
        self.params[fqn] = param
        self._ids.add(id(param))
        return param

    def read(self, param: torch.Tensor, into: torch.Tensor) -> None:
        """``param``'s values into the flat tensor ``into`` (the device's): copied without
        blocking, or read from its files."""
        reader = self.files.get(id(param))
        if reader is None:
            into.copy_(param.detach().reshape(-1), non_blocking=True)
        else:
            reader(into)

    def read_ahead(self, params: list[torch.Tensor]) -> None:
        """Start reading those of ``params`` kept in files, whose gather comes after the
        next one's (a no-op where none is)."""
        if self.ahead is not None and any(id(p) in self.files for p in params):
            self.ahead(params)

    def holds(self, t: torch.Tensor) -> bool:
        return id(t) in self._ids

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """A host copy of the device tensor ``value``, ready after ``settle``."""
        out = self.empty(value.shape, value.dtype)
        out.copy_(value, non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events.append(event)
        return out

    @contextmanager
    def side(self, *outputs: torch.Tensor) -> Iterator[None]:
        """Copies from the host (and a collective over what they fill) on the side stream,
        after what the current stream has queued; ``outputs``, made on the current stream,
        are kept for the side stream until its work is done."""
        if not self.cuda:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield
        for t in outputs:
            t.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        self._events.append(event)

    def settle(self) -> None:
        """Wait for every copy to or from the host issued so far."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params.values() if p.grad is not None]


__all__ = ["HostTier"]
