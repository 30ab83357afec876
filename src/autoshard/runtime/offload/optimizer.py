"""Optimizer offload (docs/parallelism/offload.md): a fraction of each trainable tensor the
optimizer steps (a ZeRO shard, or the whole local tensor at ZeRO 0) has its master weights, its
optimizer state and its update on the host.

Each such tensor is cut, flat, into a head of ``kept`` elements and a tail of the rest. The
tails' master copies and gradients lie side by side in one flat host buffer each per dtype
(pinned where CUDA runs); the head's gradient and state stay on the device. When a gradient is
final (a ZeRO unit's reduce-scatter or a bucket's all-reduce has landed in ``.grad``) it is routed
at once: the tail copied to the host without blocking, the head copied on the device, ``.grad``
dropped, so the user's optimizer, built over ``pm.parameters()`` as always, finds no gradient
there and keeps no state for it. After the user's ``optimizer.step()`` the same optimizer class,
with that optimizer's settings of the moment (a scheduler's learning rate too), steps the tails
on the host and the heads on the device. On the host it steps chunks: runs of tails side by side
in the flat buffers, each one tensor to the optimizer, so one call of torch's fused CPU kernel
(where it takes the dtype) updates a whole chunk rather than one call a tensor; each chunk's
updated tails go back to the device while the next chunk updates. A chunk has one set of
optimizer state, a step count too, so a chunk whose tails do not all have a gradient in a step
is cut for good into runs that have and runs that have not (each keeping its part of the state),
as torch steps only the tensors with a gradient.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from autoshard.cost.offload import CHUNK_BYTES as OFFLOAD_CHUNK_BYTES
from autoshard.runtime.offload.chunks import (
    _Chunk,
    _cut,
    _elementwise,
    _Group,
    _joined,
    _Piece,
    _split_into,
)
from autoshard.runtime.offload.elementwise import check_elementwise

#: host master bytes stepped in one go before that chunk's copy back starts (as priced)
CHUNK_BYTES = OFFLOAD_CHUNK_BYTES
#: a group's settings the host and device optimizers keep their own of: how the kernels run
_OWN_SETTINGS = {"params", "foreach", "fused", "capturable", "differentiable"}
#: the offloads alive in this process, which loss scaling asks for an optimizer's gradients
_LIVE: weakref.WeakSet = weakref.WeakSet()


class OptimizerOffload:
    """The host tier of a rank's optimizer: ``fraction`` of each tensor of ``params``."""

    #: whether a host optimizer over the tails' masters steps them (not where files hold them)
    host_optimizer = True

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        fraction: float | Mapping[str, float],
        device: torch.device,
    ) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        kept = {
            fqn: p.numel() - math.floor(_share(fraction, fqn) * p.numel() + 0.5)
            for fqn, p in params.items()
        }
        #: dtype -> the flat host masters and gradients of the tails of that dtype
        self._flat: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pieces: dict[int, _Piece] = self._place(params, kept)
        self._groups: dict[int, list[_Group]] = {}  # id(user optimizer) -> its groups
        #: id(user optimizer) -> id(piece) -> the index of the group that steps it
        self._members: dict[int, dict[int, int]] = {}
        #: the pieces with a gradient this step, by id, in the order their last one came
        self._ready: dict[int, _Piece] = {}
        #: seconds in the host's update calls (the kernels over the chunks) and in the copies
        #: back to the device (on CUDA the time to issue them: they run on a side stream), since
        #: the module was made
        self.seconds = {"host_update": 0.0, "copy_back": 0.0}
        ref = weakref.ref(self)

        def before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            offload = ref()
            if offload is not None and offload.owns(optimizer):
                check_elementwise(optimizer)  # before anything is stepped
                offload.collect()  # or the user's optimizer would step them too

        def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            offload = ref()
            if offload is not None and offload.owns(optimizer):
                offload.step(optimizer)

        _LIVE.add(self)
        for handle in (
            register_optimizer_step_pre_hook(before_step),
            register_optimizer_step_post_hook(after_step),
        ):
            weakref.finalize(self, handle.remove)

    def _place(self, params: dict[str, torch.Tensor], kept: dict[str, int]) -> dict[int, _Piece]:
        """Each tensor cut at ``kept[fqn]``: its tail's master copy and gradient, views of
        one flat host buffer each per dtype, in the order given."""
        pieces, sizes = {}, {}
        for p in params.values():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        for dtype, size in sizes.items():
            size -= sum(kept[fqn] for fqn, p in params.items() if p.dtype == dtype)
            # pinned, so that copies to and from CUDA do not block
            self._flat[dtype] = (
                # host: the tails' master weights
                torch.empty(size, dtype=dtype, device="cpu", pin_memory=self._cuda),
                # host: the tails' gradients
                torch.zeros(size, dtype=dtype, device="cpu", pin_memory=self._cuda),
            )
        offsets = dict.fromkeys(sizes, 0)
        for fqn, p in params.items():
            flat, start, tail = p.detach().reshape(-1), offsets[p.dtype], p.numel() - kept[fqn]
            master, grad = (t[start : start + tail] for t in self._flat[p.dtype])
            master.copy_(flat[kept[fqn] :])
            piece = _Piece(fqn, p, kept[fqn], master, grad, flat[: kept[fqn]], tail, start)
            pieces[id(p)] = piece
            offsets[p.dtype] += tail
        return pieces

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any tensor of this offload."""
        return any(id(p) in self.pieces for g in optimizer.param_groups for p in g["params"])

    # -- gradients --------------------------------------------------------------------------------

    def route(self, params: Iterable[torch.Tensor]) -> None:
        """Move the final gradients of ``params`` (those offloaded) out of ``.grad``: each
        tail to the host without blocking, each head copied on the device."""
        for p in params:
            piece = self.pieces.get(id(p))
            if piece is None or p.grad is None:
                continue
            flat = p.grad.detach().reshape(-1)
            if piece.has_grad:  # a second backward before the step: add to what came
                self._add_to_host(piece, flat[piece.kept :])
            else:
                self._copy_to_host(piece, flat[piece.kept :])
            if piece.kept:
                # a copy: a view would keep the whole bucket or reduce-scatter output alive
                head = flat[: piece.kept]
                piece.head.grad = (
                    head.clone() if piece.head.grad is None else piece.head.grad + head
                )
            piece.has_grad = True
            self._ready.pop(id(piece), None)  # a second gradient: it came last
            self._ready[id(piece)] = piece
            p.grad = None

    def route_when_accumulated(self, params: Iterable[torch.Tensor]) -> None:
        """Route each of ``params`` (those offloaded) as soon as a backward has accumulated
        its gradient: no bucket or unit sums it, so it is final then, and it leaves for the
        host while backward goes on rather than at the step."""
        ref = weakref.ref(self)

        def accumulated(p: torch.Tensor) -> None:
            offload = ref()
            if offload is not None:
                offload.route([p])

        for p in params:
            if id(p) in self.pieces:
                p.register_post_accumulate_grad_hook(accumulated)

    def _add_to_host(self, piece: _Piece, tail: torch.Tensor) -> None:
        self._wait_copy(piece)
        piece.buffer.add_(tail.to("cpu"))

    def _copy_to_host(self, piece: _Piece, tail: torch.Tensor) -> None:
        if not self._cuda:
            piece.buffer.copy_(tail)
            return
        # on a side stream after the sum that made the gradient; the device tensor is kept
        # alive for that stream until the copy is done
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            piece.buffer.copy_(tail, non_blocking=True)
            tail.record_stream(self._stream)
            piece.copied = torch.cuda.Event()
            piece.copied.record(self._stream)

    def _wait_copy(self, piece: _Piece) -> None:
        if piece.copied is not None:
            piece.copied.synchronize()
            piece.copied = None

    def collect(self) -> None:
        """Route what is left in ``.grad`` (a gradient no sum nor hook routed: one set by
        hand)."""
        self.route(piece.param for piece in self.pieces.values())

    def grads(self) -> list[tuple[str, torch.Tensor]]:
        """This step's gradients of the offloaded tensors, by name: heads on the device,
        tails on the host (their copies waited for); what clipping reads and scales."""
        self.collect()
        out = []
        for piece in self.pieces.values():
            if not piece.has_grad:
                continue
            self._wait_copy(piece)
            if piece.kept:
                out.append((piece.fqn, piece.head.grad))
            if piece.tail:
                out.append((piece.fqn, piece.buffer))
        return out

    def unscale(self, optimizer: torch.optim.Optimizer, factor: float) -> list[torch.Tensor]:
        """Multiply this step's gradients of ``optimizer``'s offloaded tensors by ``factor``
        (loss scaling's ``1 / scale``): the device heads and the host tails alike. Returns a
        flag per part, true where it holds an inf or a nan (before the multiplication)."""
        mine = self._mine(optimizer)
        flags = []
        with torch.no_grad():
            for fqn, grad in self.grads():
                if fqn in mine:
                    flags.append(~torch.isfinite(grad).all())
                    grad.mul_(factor)
        return flags

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step's gradients of ``optimizer``'s offloaded tensors unused (loss scaling
        skipped its step): the next backward writes the host's buffers afresh, as a step and
        ``zero_grad`` would have left them."""
        self.collect()
        mine = self._mine(optimizer)
        for piece in self.pieces.values():
            if piece.fqn in mine:
                self._wait_copy(piece)
                piece.has_grad, piece.head.grad = False, None
                self._ready.pop(id(piece), None)

    def _mine(self, optimizer: torch.optim.Optimizer) -> set[str]:
        return {
            self.pieces[id(p)].fqn
            for g in optimizer.param_groups
            for p in g["params"]
            if id(p) in self.pieces
        }

    # -- the update -------------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step every piece with a gradient under ``optimizer``'s settings of now: the tails on
        the host chunk by chunk, in the order their gradients came, each chunk sent back to
        the device while the next updates; then the heads on the device. The work in Python
        is a few operations a piece with a gradient and a kernel call a chunk: the update's
        bookkeeping is made once, at the first step."""
        groups = self._groups_of(optimizer)  # the hook before the step collected the gradients
        if self._cuda:  # the copies back write tensors kernels queued before may still read
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        members = self._members[id(optimizer)]
        ready: list[list[_Piece]] = [[] for _ in groups]
        for key, piece in self._ready.items():  # in the order their gradients came
            if key in members:
                ready[members[key]].append(piece)
        for group, settings, pieces in zip(groups, optimizer.param_groups, ready, strict=True):
            if not pieces:
                continue
            own = {k: v for k, v in settings.items() if k not in _OWN_SETTINGS}
            self._step_tails(group, own, [p for p in pieces if p.tail])
            if group.device is not None:
                group.device.param_groups[0].update(own)
                _step(group.device)
            for piece in pieces:
                piece.has_grad = False
                if piece.kept:
                    piece.head.grad = None
                del self._ready[id(piece)]
        if self._cuda:  # the next forward reads the tails sent back
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _step_tails(self, group: _Group, own: dict[str, Any], ready: list[_Piece]) -> None:
        """Step the tails of ``ready`` (their gradients here) under the settings ``own``:
        chunk by chunk, in the order their last gradient came."""
        if group.host is None:
            return
        group.host.param_groups[0].update(own)
        if len(ready) < len(group.chunks):  # some tails have no gradient: their chunks cut
            _cut(group, {id(p) for p in ready})
        last: dict[int, _Chunk] = {}  # each chunk once, where its last gradient came
        for piece in ready:
            chunk = group.chunks[id(piece)]
            last.pop(id(chunk), None)
            last[id(chunk)] = chunk
        for chunk in last.values():
            self._step_chunk(group.host, chunk)

    def _step_chunk(self, host: torch.optim.Optimizer, chunk: _Chunk) -> None:
        if self._cuda:
            for piece in chunk.pieces:
                self._wait_copy(piece)
        if chunk.returned is not None:  # the last copy back still reads the masters
            chunk.returned.synchronize()
            chunk.returned = None
        chunk.master.grad = chunk.grad
        began = time.perf_counter()
        _step(host)  # one kernel call: the other chunks have no gradient
        updated = time.perf_counter()
        chunk.master.grad = None
        if not self._cuda:
            # where the device is the CPU the copy takes the cores the next chunk's update
            # runs on: on a thread of its own beside that update, in chunks of 1 to 32 MiB,
            # the bench's host step took 1.07x to 1.47x as long as this on two loaded cores
            torch._foreach_copy_(*chunk.back)
        else:
            with torch.cuda.stream(self._stream):
                torch._foreach_copy_(*chunk.back, non_blocking=True)
                chunk.returned = torch.cuda.Event()
                chunk.returned.record(self._stream)
        self.seconds["host_update"] += updated - began
        self.seconds["copy_back"] += time.perf_counter() - updated

    def _groups_of(self, optimizer: torch.optim.Optimizer) -> list[_Group]:
        """The host and device optimizers beside each group of ``optimizer``, made at its
        first step: the same class, the host one fused where torch has that kernel."""
        if id(optimizer) in self._groups:
            return self._groups[id(optimizer)]
        check_elementwise(optimizer)
        groups, cls = [], type(optimizer)
        for settings in optimizer.param_groups:
            pieces = [self.pieces[id(p)] for p in settings["params"] if id(p) in self.pieces]
            chunks = self._chunks([p for p in pieces if p.tail]) if self.host_optimizer else {}
            masters = list({id(c): c.master for c in chunks.values()}.values())
            heads = [p.head for p in pieces if p.kept]
            groups.append(
                _Group(
                    pieces,
                    _make(cls, masters, settings, host=True) if masters else None,
                    _make(cls, heads, settings, host=False) if heads else None,
                    chunks,
                )
            )
        self._groups[id(optimizer)] = groups
        self._members[id(optimizer)] = {
            id(piece): k for k, group in enumerate(groups) for piece in group.pieces
        }
        return groups

    def _chunks(self, pieces: list[_Piece]) -> dict[int, _Chunk]:
        """``pieces``' tails in chunks, by ``id`` of the piece: runs side by side in their flat
        buffers of at most about ``CHUNK_BYTES`` each."""
        out: dict[int, _Chunk] = {}
        run: list[_Piece] = []
        for piece in sorted(pieces, key=lambda p: (str(p.param.dtype), p.start)):
            last = run[-1] if run else None
            joins = last is not None and last.param.dtype == piece.param.dtype
            size = sum(p.tail * p.param.element_size() for p in run)
            if not joins or last.start + last.tail != piece.start or size >= CHUNK_BYTES:
                out |= self._chunk(run)
                run = []
            run.append(piece)
        return out | self._chunk(run)

    def _chunk(self, run: list[_Piece]) -> dict[int, _Chunk]:
        if not run:
            return {}
        start, stop = run[0].start, run[-1].start + run[-1].tail
        master, grad = (t[start:stop] for t in self._flat[run[0].param.dtype])
        chunk = _Chunk(run, master, grad)
        return {id(p): chunk for p in run}

    def ready(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the host and device state of ``optimizer``'s offloaded tensors exist (a step
        with zero gradients at a learning rate of 0), so a checkpoint has tensors to load into."""
        for group, settings in zip(self._groups_of(optimizer), optimizer.param_groups, strict=True):
            own = {k: v for k, v in settings.items() if k not in _OWN_SETTINGS}
            own["lr"] = 0.0
            masters = list({id(c): c.master for c in group.chunks.values()}.values())
            heads = [piece.head for piece in group.pieces]
            for opt, tensors in ((group.host, masters), (group.device, heads)):
                missing = [
                    t for t in tensors if t.numel() and opt is not None and t not in opt.state
                ]
                if not missing:
                    continue
                opt.param_groups[0].update(own)
                for t in missing:  # only these: a step would move the others' moments
                    t.grad = torch.zeros_like(t)
                opt.step()
                for t in missing:
                    t.grad = None

    # -- state ------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Take the host masters again from the device (after the weights were loaded)."""
        with torch.no_grad():
            for piece in self.pieces.values():
                piece.host.copy_(piece.param.detach().reshape(-1)[piece.kept :])

    def state_of(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """The optimizer state of each offloaded tensor ``optimizer`` steps, by ``id`` of the
        tensor, as it would be without offload: a tensor of the parameter's shape (the head's
        state then the tail's, on the host) per elementwise entry, the rest (a step count) the
        host's. Fresh tensors: ``load_state`` puts what is read into them back."""
        out: dict[int, dict[str, Any]] = {}
        for group in self._groups_of(optimizer):
            for piece in group.pieces:
                head = group.device.state.get(piece.head, {}) if group.device else {}
                out[id(piece.param)] = _joined(piece, head, self._tail_state(group, piece))
        return {k: v for k, v in out.items() if v}

    def load_state(self, optimizer: torch.optim.Optimizer, state: dict[int, dict]) -> None:
        """Put ``state`` (``state_of``'s tensors, loaded into) into the host and device state."""
        with torch.no_grad():
            for group in self._groups_of(optimizer):
                for piece in group.pieces:
                    entries = state.get(id(piece.param), {})
                    head = group.device.state.get(piece.head, {}) if group.device else {}
                    tail = self._tail_state(group, piece)
                    for key, value in entries.items():
                        _split_into(piece, key, value, head, tail)
                    self._tail_loaded(piece, tail)

    def _tail_state(self, group: _Group, piece: _Piece) -> dict[str, Any]:
        """The optimizer state of ``piece``'s tail (tensors a load may copy into: views of its
        chunk's elementwise state, and the chunk's own step count)."""
        chunk = group.chunks.get(id(piece))
        if group.host is None or chunk is None:
            return {}
        start = piece.start - chunk.pieces[0].start
        return {
            k: v[start : start + piece.tail] if _elementwise(v, chunk.master) else v
            for k, v in group.host.state.get(chunk.master, {}).items()
        }

    def _tail_loaded(self, piece: _Piece, tail: dict[str, Any]) -> None:
        """``_tail_state``'s tensors of ``piece`` hold what a checkpoint loaded (kept)."""

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the host holds: master weights, gradients, optimizer state."""
        states = [g.host.state for gs in self._groups.values() for g in gs if g.host]
        return {
            "parameters": [p.host for p in self.pieces.values()],
            "gradients": [p.buffer for p in self.pieces.values()],
            "optimizer": [v for s in states for st in s.values() for v in st.values()],
        }

    def device_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the offload keeps on the device: the heads' gradients and optimizer state."""
        states = [g.device.state for gs in self._groups.values() for g in gs if g.device]
        grads = [p.head.grad for p in self.pieces.values() if p.head.grad is not None]
        return {
            "gradients": grads,
            "optimizer": [v for s in states for st in s.values() for v in st.values()],
        }


def offloads_of(optimizer: torch.optim.Optimizer) -> list[OptimizerOffload]:
    """The live offloads that step some tensor of ``optimizer`` (loss scaling's)."""
    return [offload for offload in list(_LIVE) if offload.owns(optimizer)]


def _share(fraction: float | Mapping[str, float], fqn: str) -> float:
    """The fraction of ``fqn`` offloaded: one for all, or each tensor's own."""
    return fraction[fqn] if isinstance(fraction, Mapping) else fraction


def _step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the wrapper torch puts around every optimizer's step (a
    profiler range and every global step hook, each offload's own among them): the host and
    device optimizers here are the offload's, stepped inside the user's step, whose hooks have
    run; the wrapper alone took about as long as the rest of a one-chunk call in Python."""
    step = type(optimizer).step
    getattr(step, "__wrapped__", step)(optimizer)


def _make(
    cls: type, tensors: list[torch.Tensor], settings: dict[str, Any], host: bool
) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over ``tensors``: on the host with torch's fused kernel where
    it has one for them, else its foreach one; on the device as the user's runs."""
    lr = {"lr": settings["lr"]} if "lr" in settings else {}
    if host:
        kernels: tuple[dict[str, Any], ...] = ({"fused": True}, {"foreach": True})
    else:
        kernels = ({k: settings[k] for k in ("foreach", "fused") if settings.get(k) is not None},)
    for kernel in kernels:
        try:
            return cls(tensors, **lr, **kernel)
        except (TypeError, ValueError, RuntimeError):
            continue
    return cls(tensors, **lr)


__all__ = ["CHUNK_BYTES", "OptimizerOffload", "offloads_of"]
