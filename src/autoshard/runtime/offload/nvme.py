"""NVMe offload (docs/parallelism/offload.md): the optimizer's host part (each tail's master
weights, gradient and optimizer state, ``optimizer.py``) kept in files under a directory rather than
in host memory, and streamed through a bounded host buffer.

Each rank writes its files into a directory of its own under the path given, one file per
tail and kind (``master``, ``grad``, and each elementwise entry of the optimizer's state:
AdamW's ``exp_avg`` and ``exp_avg_sq``), read and written in place with ``os.preadv`` and
``os.pwrite`` on preallocated host tensors; the directory goes when the module does. A
gradient is written to its file as it is routed. The step walks the tails in windows of at
most ``window`` elements over two slots of host tensors: a background thread reads the window
after next into one slot (read-ahead) and writes the last window's results from it
(write-behind) while the optimizer steps the window in the other; one thread does all file
I/O in the order it is asked, so a slot is read into only after its last results are written.
The host memory held is the two slots: ``host_budget_mb``.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoshard.options import HOST_BUDGET_MB
from autoshard.runtime.offload.host import HostTier
from autoshard.runtime.offload.optimizer import (
    _OWN_SETTINGS,
    OptimizerOffload,
    _Group,
    _make,
    _Piece,
    _share,
)
from autoshard.runtime.offload.readahead import ReadAhead

#: the tensors of a window a slot holds: master weights, gradient and two moments (Adam's)
KINDS_PER_SLOT = 4
SLOTS = 2


def check_nvme(path: Any) -> Path:
    """``path`` as a directory this rank can write files into, or a ValueError naming why not
    (True, as a plan records NVMe, names no directory: the run gives it)."""
    if isinstance(path, bool):
        raise ValueError(
            f"offload['nvme']={path!r}: the plan keeps state on NVMe; give the directory "
            "to keep it in, offload={..., 'nvme': path}"
        )
    root = Path(path)
    shown = f"offload['nvme']={str(path)!r}"
    if not root.exists():
        raise ValueError(f"{shown}: no such directory; make it first")
    if not root.is_dir():
        raise ValueError(f"{shown}: not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"{shown}: this process cannot write there")
    return root


class NvmeOffload(OptimizerOffload):
    """An optimizer offload whose tails live in files under ``path``, stepped through
    ``budget`` bytes of host memory."""

    host_optimizer = False

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        fraction: float | Mapping[str, float],
        device: torch.device,
        path: Any,
        budget: int,
        rank: int,
    ) -> None:
        root = check_nvme(path)
        self.budget = budget
        self.directory = Path(tempfile.mkdtemp(prefix=f"rank{rank}-", dir=root))
        self._fds: dict[tuple[str, str], int] = {}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="autoshard-nvme")
        self._slots: dict[torch.dtype, list[dict[str, torch.Tensor]]] = {}
        self._scalars: dict[str, dict[str, Any]] = {}  # a tail's non-elementwise state
        self._keys: list[str] = []  # the elementwise state entries, in their first order
        self._cls: type | None = None
        self._scale: torch.Tensor | None = None  # clipping's, applied to the gradients at the step
        #: ids of ZeRO 3's host shards kept in their files alone (``keep_in_files``)
        self.in_files: set[int] = set()
        self._host: HostTier | None = None
        self._staged: dict[int, torch.Tensor] = {}  # shards in files a checkpoint holds
        self._ahead: ReadAhead | None = None  # with shards in files: their reads ahead
        self._parts = SLOTS  # the budget's parts: the step's slots (and the read-ahead's)
        self._counting = threading.Lock()  # the I/O thread and this one both count
        #: bytes read and written and the seconds spent in those calls (the I/O thread's and
        #: the gradients' writes), since the module was made
        self.io = {"read_bytes": 0, "read_s": 0.0, "write_bytes": 0, "write_s": 0.0}
        #: of those read, the bytes of shards in files a gather took from their read-ahead
        self.io["ahead_bytes"] = 0
        weakref.finalize(self, _remove, self._fds, self._io, str(self.directory))
        need = sum(
            math.floor(_share(fraction, fqn) * p.numel() + 0.5) * p.element_size()
            for fqn, p in params.items()
        )
        free = shutil.disk_usage(root).free
        if KINDS_PER_SLOT * need > free:
            raise ValueError(
                f"offload['nvme']={str(path)!r}: the optimizer's state needs about "
                f"{KINDS_PER_SLOT * need} bytes there, {free} are free"
            )
        super().__init__(params, fraction, device)

    def window(self, dtype: torch.dtype) -> int:
        """Elements of one window of tensors of ``dtype``."""
        size = dtype.itemsize
        return max(1, self.budget // (self._parts * KINDS_PER_SLOT * size))

    # -- files ------------------------------------------------------------------------------------

    def _fd(self, piece: _Piece, kind: str) -> int:
        key = (piece.fqn, kind)
        if key not in self._fds:
            name = self.directory / f"{len(self._fds)}.{kind}"
            self._fds[key] = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
        return self._fds[key]

    def _read(self, piece: _Piece, kind: str, start: int, into: torch.Tensor) -> None:
        view = memoryview(into.view(torch.uint8).numpy())
        began = time.perf_counter()
        got = os.preadv(self._fd(piece, kind), [view], start * into.element_size())
        if got != len(view):
            raise OSError(f"{self.directory}: {piece.fqn} {kind} is short ({got} bytes read)")
        with self._counting:
            self.io["read_bytes"] += got
            self.io["read_s"] += time.perf_counter() - began

    def _write(self, piece: _Piece, kind: str, start: int, data: torch.Tensor) -> None:
        view = memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())
        offset, fd = start * data.element_size(), self._fd(piece, kind)
        began, size = time.perf_counter(), len(view)
        while view:  # a write may take fewer bytes than given
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done
        with self._counting:
            self.io["write_bytes"] += size
            self.io["write_s"] += time.perf_counter() - began

    def _put(self, piece: _Piece, kind: str, tail: torch.Tensor, add: bool = False) -> None:
        """Write ``tail`` (the piece's whole tail, on any device) to its file, through one
        window of host memory at a time; ``add``: to what the file holds."""
        step = self.window(tail.dtype)
        for start in range(0, tail.numel(), step):
            part = tail[start : start + step].to("cpu")
            if add:
                held = torch.empty_like(part)
                self._read(piece, kind, start, held)
                part = held.add_(part)
            self._write(piece, kind, start, part.contiguous())

    def _get(self, piece: _Piece, kind: str) -> torch.Tensor:
        # host: a checkpoint's copy of one tail's entry, read whole
        out = torch.empty(piece.tail, dtype=piece.param.dtype, device="cpu")
        self._read(piece, kind, 0, out)
        return out

    # -- the offload's tiers, in files ------------------------------------------------------------

    def _place(self, params: dict[str, torch.Tensor], kept: dict[str, int]) -> dict[int, _Piece]:
        pieces = {}
        for fqn, p in params.items():
            flat = p.detach().reshape(-1)
            empty = flat.new_empty(0, device="cpu")
            piece = _Piece(
                fqn, p, kept[fqn], empty, empty, flat[: kept[fqn]], p.numel() - kept[fqn]
            )
            self._put(piece, "master", flat[kept[fqn] :])
            pieces[id(p)] = piece
        return pieces

    def _copy_to_host(self, piece: _Piece, tail: torch.Tensor) -> None:
        if self._host is not None:  # a host shard's sum is copied there without blocking
            self._host.settle()
        self._put(piece, "grad", tail)

    # -- parameters in files ----------------------------------------------------------------------

    def keep_in_files(self, host: HostTier, shards: Iterable[torch.Tensor]) -> None:
        """ZeRO 3's host ``shards`` (pieces offloaded whole, their masters already in their
        files) kept there alone: their memory freed, each gather reading them from the files
        a window at a time through the bounded host buffer, each step writing them back."""
        self._host = host
        # a third part of the budget, beside the step's two slots: the unit read ahead
        self._parts = SLOTS + 1
        self._ahead = ReadAhead(
            self._io, self._read, lambda dtype: KINDS_PER_SLOT * self.window(dtype), self._cuda
        )
        host.ahead = self._read_ahead
        for shard in shards:
            piece = self.pieces[id(shard)]
            assert piece.kept == 0, piece.fqn
            # host: the shard's shape without its memory, where the host tier kept it
            empty = torch.empty(shard.shape, dtype=shard.dtype, device="cpu")
            empty.untyped_storage().resize_(0)
            shard.data = empty
            piece.head = shard.detach().reshape(-1)[:0]  # not a view of the memory freed
            self.in_files.add(id(shard))
            host.files[id(shard)] = lambda into, piece=piece: self._fetch(piece, into)

    def in_memory(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` where its memory holds its values; one kept in files read whole into a
        host tensor that a checkpoint saves from or loads into (held until ``refresh``
        writes it back, or ``release``)."""
        if id(shard) not in self.in_files:
            return shard
        # host: the shard's values while a checkpoint reads or writes them, one tensor each
        value = self._get(self.pieces[id(shard)], "master").view(shard.shape)
        self._staged[id(shard)] = value
        return value

    def release(self) -> None:
        """Let go of what ``in_memory`` read (a save is done with it)."""
        self._staged = {}

    def _read_ahead(self, shards: list[torch.Tensor]) -> None:
        """Read ``shards`` (a unit's, gathered after the next) on the I/O thread now."""
        self._ahead.ask([self.pieces[id(s)] for s in shards if id(s) in self.in_files])

    def _fetch(self, piece: _Piece, into: torch.Tensor) -> None:
        """``piece``'s parameter from its master file into the flat tensor ``into``: what
        was read ahead copied, the rest read here through one window of a slot (no step is
        under way while forward and backward gather)."""
        done = self._ahead.take(piece, into) if self._ahead is not None else 0
        with self._counting:
            self.io["ahead_bytes"] += done * piece.param.element_size()
        window = self.window(piece.param.dtype)
        slot = self._slot(piece.param.dtype, 0, ["master"])["master"]
        for start in range(done, piece.tail, window):
            n = min(window, piece.tail - start)
            self._read(piece, "master", start, slot[:n])
            into[start : start + n].copy_(slot[:n])  # blocking: the slot is read again next

    def _add_to_host(self, piece: _Piece, tail: torch.Tensor) -> None:
        if self._scale is not None:
            raise ValueError(
                "offload['nvme']: a backward after clip_grad_norm_ and before the step; "
                "the clipping's scale waits in memory for the gradients in the files"
            )
        self._put(piece, "grad", tail, add=True)

    def grads(self) -> list[tuple[str, torch.Tensor]]:
        """The heads' gradients (on the device); the tails' are in files: ``tail_norms``."""
        self.collect()
        return [(p.fqn, p.head.grad) for p in self.pieces.values() if p.has_grad and p.kept]

    def tail_norms(self, norm_type: float) -> list[tuple[str, torch.Tensor]]:
        """Each tail's gradient's sum of ``|g| ** norm_type`` (its largest ``|g|`` for inf), by
        name, read from its file a window at a time (into a slot: no step is under way), with
        any scale clipping left pending."""
        out = []
        for piece in self.pieces.values():
            if not (piece.has_grad and piece.tail):
                continue
            window, total = self.window(piece.param.dtype), []
            into = self._slot(piece.param.dtype, 0, ["grad"])["grad"]
            for start in range(0, piece.tail, window):
                g = into[: min(window, piece.tail - start)]
                self._read(piece, "grad", start, g)
                g = g.to(torch.float64).abs() * (1.0 if self._scale is None else self._scale)
                total.append(g.max() if math.isinf(norm_type) else g.pow(norm_type).sum())
            out.append(
                (piece.fqn, torch.stack(total).max() if math.isinf(norm_type) else sum(total))
            )
        return out

    def scale_tails(self, scale: torch.Tensor) -> None:
        """Scale the tails' gradients by ``scale`` at the step (as each window is read), not
        in their files now."""
        scale = scale.detach().to("cpu", torch.float64)
        self._scale = scale if self._scale is None else self._scale * scale

    def unscale(self, optimizer: torch.optim.Optimizer, factor: float) -> list[torch.Tensor]:
        """The heads as in host memory; the tails' flags from their files (each read a window
        at a time), their ``factor`` left pending with clipping's scale."""
        mine = self._mine(optimizer)
        others = sorted(p.fqn for p in self.pieces.values() if p.tail and p.fqn not in mine)
        if others:  # the pending scale is one for every tail in files
            raise ValueError(
                f"offload['nvme'] under loss scaling: {others[0]} is in files but stepped by "
                "another optimizer than the one unscaled; give one optimizer all the "
                "offloaded parameters"
            )
        flags = super().unscale(optimizer, factor)
        flags += [~torch.isfinite(m) for fqn, m in self.tail_norms(math.inf) if fqn in mine]
        # host: the pending scale the step multiplies each window read by
        self.scale_tails(torch.tensor(factor, dtype=torch.float64, device="cpu"))
        return flags

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        super().skip(optimizer)
        self._scale = None

    def refresh(self) -> None:
        if self._ahead is not None:  # the files change under it
            self._ahead.drop()
        with torch.no_grad():
            for piece in self.pieces.values():
                if id(piece.param) not in self.in_files:
                    self._put(piece, "master", piece.param.detach().reshape(-1)[piece.kept :])
                elif id(piece.param) in self._staged:  # the file is the parameter: loaded
                    self._put(piece, "master", self._staged[id(piece.param)].reshape(-1))
                    torch.autograd.graph.increment_version(piece.param)  # gathered again
        self.release()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self._cls = type(optimizer)
        if self._ahead is not None:  # the step writes the masters read ahead
            self._ahead.drop()
        super().step(optimizer)
        self._scale = None

    # -- the streamed step ------------------------------------------------------------------------

    def _slot(self, dtype: torch.dtype, index: int, kinds: list[str]) -> dict[str, torch.Tensor]:
        slots = self._slots.setdefault(dtype, [{} for _ in range(SLOTS)])
        slot = slots[index % SLOTS]
        for kind in kinds:
            if kind not in slot:  # host: one window of the stream, pinned for CUDA's copies
                slot[kind] = torch.empty(
                    self.window(dtype), dtype=dtype, device="cpu", pin_memory=self._cuda
                )
        return slot

    def _load(self, window: tuple[_Piece, int, int], index: int) -> Future:
        piece, start, n = window
        kinds = ["master", "grad"] + (self._keys if piece.fqn in self._scalars else [])
        slot = self._slot(piece.param.dtype, index, kinds)
        return self._io.submit(
            lambda: [self._read(piece, k, start, slot[k][:n]) for k in kinds] and None
        )

    def _step_tails(self, group: _Group, own: dict[str, Any], ready: list[_Piece]) -> None:
        windows = [
            (piece, start, min(self.window(piece.param.dtype), piece.tail - start))
            for piece in ready
            for start in range(0, piece.tail, self.window(piece.param.dtype))
        ]
        loads = {k: self._load(w, k) for k, w in enumerate(windows[:SLOTS])}
        writes, scalars = [], {}
        for k, window in enumerate(windows):
            loads.pop(k).result()
            scalars[window[0].fqn], kinds = self._step_window(window, k, own)
            piece, start, n = window
            slot = self._slot(piece.param.dtype, k, kinds)
            writes.append(
                self._io.submit(
                    lambda p=piece, s=start, n=n, slot=slot, kinds=kinds: [
                        self._write(p, kind, s, slot[kind][:n]) for kind in kinds
                    ]
                )
            )
            if k + SLOTS < len(windows):  # after the write just asked: the same slot
                loads[k + SLOTS] = self._load(windows[k + SLOTS], k + SLOTS)
        for w in writes:
            w.result()
        self._scalars |= scalars

    def _step_window(
        self, window: tuple[_Piece, int, int], index: int, own: dict[str, Any]
    ) -> tuple[dict[str, Any], list[str]]:
        """Step one window in its slot: its new non-elementwise state, and the kinds to write."""
        piece, start, n = window
        slot = self._slot(piece.param.dtype, index, ["master", "grad"])
        p = slot["master"][:n]
        p.grad = slot["grad"][:n]
        if self._scale is not None:  # clipping's
            p.grad.mul_(self._scale.to(p.dtype))
        opt = _make(self._cls, [p], own, host=True)
        opt.param_groups[0].update({k: v for k, v in own.items() if k not in _OWN_SETTINGS})
        if piece.fqn in self._scalars:
            state = {k: slot[k][:n] for k in self._keys}
            state |= {
                k: v.clone() if torch.is_tensor(v) else v
                for k, v in self._scalars[piece.fqn].items()
            }
            opt.state[p] = state
        opt.step()
        state = opt.state[p]
        elementwise = [k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape]
        for k in elementwise:
            if k not in self._keys:
                self._keys.append(k)
            self._slot(piece.param.dtype, index, [k])[k][:n].copy_(state[k])
        if id(piece.param) in self.in_files:  # its file is the parameter: gathered again
            torch.autograd.graph.increment_version(piece.param)
        else:
            with torch.no_grad():
                flat = piece.param.detach().reshape(-1)
                flat[piece.kept + start : piece.kept + start + n].copy_(p)
        p.grad = None
        return {k: v for k, v in state.items() if k not in elementwise}, ["master", *elementwise]

    # -- state ------------------------------------------------------------------------------------

    def _tail_state(self, group: _Group, piece: _Piece) -> dict[str, Any]:
        if not piece.tail or piece.fqn not in self._scalars:
            return {}
        return {k: self._get(piece, k) for k in self._keys} | dict(self._scalars[piece.fqn])

    def _tail_loaded(self, piece: _Piece, tail: dict[str, Any]) -> None:
        for key, value in tail.items():
            if key in self._keys:
                self._put(piece, key, value)
            else:
                self._scalars[piece.fqn][key] = value

    def ready(self, optimizer: torch.optim.Optimizer) -> None:
        super().ready(optimizer)
        self._cls = type(optimizer)
        for group, settings in zip(self._groups_of(optimizer), optimizer.param_groups, strict=True):
            missing = [p for p in group.pieces if p.tail and p.fqn not in self._scalars]
            for piece in missing:  # a step of zero gradients at a learning rate of 0
                zeros = torch.zeros(piece.tail, dtype=piece.param.dtype, device=self.device)
                self._put(piece, "grad", zeros)
            own = {k: v for k, v in settings.items() if k not in _OWN_SETTINGS} | {"lr": 0.0}
            self._step_tails(group, own, missing)

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the host holds: the two slots the files stream through."""
        slots = [t for kinds in self._slots.values() for s in kinds for t in s.values()]
        ahead = self._ahead.tensors() if self._ahead is not None else []
        return {"parameters": [], "gradients": [], "optimizer": slots + ahead}

    def file_bytes(self) -> int:
        """Bytes in this rank's files."""
        return sum(os.fstat(fd).st_size for fd in self._fds.values())


def optimizer_offload(
    offload: Any,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    rank: int = 0,
    host: HostTier | None = None,
    shards: dict[str, torch.Tensor] | None = None,
) -> OptimizerOffload | None:
    """The offload ``Options.offload`` asks for over the trainable parameters of ``tensors``
    (what the optimizer steps, by name: ZeRO shards or local tensors), in host memory or,
    with ``nvme``, in files there; with ``nvme`` and ``parameters`` also ZeRO 3's ``shards``
    held by ``host``, whole, kept in the files alone. None where it offloads nothing (no
    fraction nor shard, or no such tensor on this rank)."""
    offload = offload or {}
    fraction = offload.get("optimizer", 0.0)
    # an empty shard (a rank past a tensor's last rows) stays the user's optimizer's: its
    # state, however empty, is what a checkpoint of that rank holds
    params = {fqn: t for fqn, t in tensors.items() if _stepped(t)} if fraction else {}
    in_files = offload.get("nvme") and offload.get("parameters") and host is not None
    whole = (
        {fqn: t for fqn, t in (shards or {}).items() if _stepped(t) and host.holds(t)}
        if in_files
        else {}
    )
    if not params and not whole:
        return None
    if not offload.get("nvme"):
        return OptimizerOffload(params, float(fraction), device)
    budget = int((offload.get("host_budget_mb") or HOST_BUDGET_MB) * 2**20)
    shares = dict.fromkeys(params, float(fraction)) | dict.fromkeys(whole, 1.0)
    out = NvmeOffload(params | whole, shares, device, offload["nvme"], budget, rank)
    if whole:
        out.keep_in_files(host, whole.values())
    return out


def _stepped(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad and t.numel() > 0


def _remove(fds: dict, io: ThreadPoolExecutor, directory: str) -> None:
    io.shutdown(wait=True)
    for fd in fds.values():
        os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)


__all__ = ["KINDS_PER_SLOT", "NvmeOffload", "check_nvme", "optimizer_offload"]
