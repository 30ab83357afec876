"""Optimizer parallelism: ZeRO stages 1, 2 and 3 over the ranks that sum each parameter's
gradient (docs/zero.md).

A parameter whose gradient sum is one all-reduce over a group of ranks (its data-parallel
replicas) is held by each member as a block of rows: its local tensor (what the plan's layout
gives the rank, split over tensor parallelism or not) cut along dim 0 into ``ceil(rows / n)``
rows per member, the last members holding fewer (or none). The optimizer sees only these
shards. Parameters are grouped into units, one per block of the model (the block of their first
reader), gathered by one all-gather and summed by one reduce-scatter each:

- stage 1: the gathered parameters stay between steps (gathered again, before their first use,
  after the optimizer changed the shards); each unit's gradient buffer stays too, and the
  syncing backward reduce-scatters it into the shards' ``.grad``.
- stage 2: as 1, but a unit's gradient buffer lives only until its reduce-scatter.
- stage 3: parameters are gathered before their first use in every forward (the next unit's
  gather started while this one computes), dropped after their last use (``reshard_after_forward``;
  autograd keeps a note in their place and backward gathers them again, the previous unit's
  gather started ahead) and dropped again after the unit's reduce-scatter.

Under ``no_sync`` every stage adds backward's gradients into the unit's whole gradient buffer and
the next syncing backward reduce-scatters the sum once (as FSDP2 does; DeepSpeed's stage 2
reduce-scatters every micro-batch instead).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autoshard import comm
from autoshard.search import ZeroError


@dataclass(eq=False)
class _Member:
    """One parameter of a unit: its local tensor's shape, cut into ``chunk`` rows per rank."""

    fqn: str
    shard: nn.Parameter
    shape: torch.Size
    rows: int
    row: int  # elements per row
    chunk: int  # rows per rank, the last ranks padded
    offset: int  # where its chunk starts in a rank's block
    mine: tuple[int, int]  # this rank's rows

    def grid(self, flat: torch.Tensor, size: int, block: int) -> torch.Tensor:
        """Its chunks in a ``size`` x ``block`` buffer, as (rank, row, element)."""
        cols = flat.view(size, block)[:, self.offset : self.offset + self.chunk * self.row]
        return cols.view(size, self.chunk, self.row)


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps for a gathered parameter of stage 3: where to find it again."""

    unit: _Unit
    fqn: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Unit:
    """Parameters gathered by one all-gather and summed by one reduce-scatter over ``group``."""

    name: str
    level: int
    group: tuple[int, ...]
    index: int  # this rank's position in the group
    members: list[_Member]
    block: int  # elements per rank
    compute: torch.dtype
    reduce: torch.dtype
    device: torch.device
    used: int = 0  # members the program reads
    full: dict[str, torch.Tensor] | None = None
    version: int | None = None  # the shards' versions when ``full`` was gathered
    gathering: tuple[Any, torch.Tensor] | None = None
    fetched: set[str] = field(default_factory=set)
    staging: torch.Tensor | None = None
    pending: int = 0  # fetches whose gradient has not come yet
    notes: int = 0  # stage 3's notes autograd has not unpacked yet
    deposited: set[str] = field(default_factory=set)
    grads: dict[str, tuple[_Member, torch.Tensor]] = field(default_factory=dict)  # not in staging
    summing: tuple[Any, torch.Tensor] | None = None
    host: Any = None  # the host tier holding the shards (``offload={"parameters": True}``)

    def versions(self) -> int:
        return sum(m.shard._version for m in self.members)

    def stale(self) -> bool:
        return self.full is None or self.version != self.versions()

    def start_gather(self) -> None:
        if self.gathering is not None or not self.stale():
            return
        size = len(self.group)
        out = torch.empty(size * self.block, dtype=self.compute, device=self.device)
        send = out.narrow(0, self.index * self.block, self.block)  # in place: no second buffer
        # host shards: copied in and gathered on the host tier's side stream, so the compute
        # queued meanwhile does not wait for them (the next unit's, while this one computes)
        with self.host.side(out) if self.host is not None else nullcontext():
            for m in self.members:
                n = (m.mine[1] - m.mine[0]) * m.row
                part = send[m.offset : m.offset + n]
                if self.host is not None:  # a shard in files is read from them here
                    self.host.read(m.shard, part)
                else:
                    part.copy_(m.shard.detach().reshape(-1), non_blocking=True)
            self.gathering = (comm.all_gather_async(out, send, self.group), out)
        self.version = self.versions()

    def gathered(self) -> dict[str, torch.Tensor]:
        """The unit's local tensors, gathering (or finishing a started gather) if needed."""
        if self.gathering is None and self.stale():
            self.start_gather()
        if self.gathering is not None:
            work, out = self.gathering
            work.wait()
            self.gathering = None
            self.full = {m.fqn: _unpad(m, out, len(self.group), self.block) for m in self.members}
        assert self.full is not None
        return self.full

    def deposit(self, member: _Member, grad: torch.Tensor) -> None:
        if member.fqn in self.grads:  # a parameter read twice: summed in the reduce dtype
            grad = self.grads[member.fqn][1].to(self.reduce) + grad
        self.grads[member.fqn] = (member, grad)
        self.deposited.add(member.fqn)
        self.pending -= 1

    def flush(self) -> None:
        """Add the gradients received into the buffer the reduce-scatter reads. The buffer is
        made now, when the unit's gradients are all in, not at the first: by then backward has
        freed the unit's gathered parameters and activations."""
        if not self.grads:
            return
        size = len(self.group)
        if self.staging is None:
            self.staging = torch.zeros(size * self.block, dtype=self.reduce, device=self.device)
        with torch.no_grad():
            for member, grad in self.grads.values():
                target = member.grid(self.staging, size, self.block)
                flat = grad.reshape(member.rows, member.row)
                whole, rest = divmod(member.rows, member.chunk)
                target[:whole].add_(flat[: whole * member.chunk].view(whole, member.chunk, -1))
                if rest:
                    target[whole, :rest].add_(flat[whole * member.chunk :])
        self.grads = {}

    def start_sum(self) -> None:
        out = torch.empty(self.block, dtype=self.reduce, device=self.device)
        self.summing = (comm.reduce_scatter_async(out, self.staging, self.group), out)

    def finish_sum(self) -> None:
        """Wait for the reduce-scatter and add each summed shard into its ``.grad``."""
        work, out = self.summing
        work.wait()
        self.summing = None
        with torch.no_grad():
            for m in self.members:
                if m.fqn not in self.deposited:
                    continue
                n = (m.mine[1] - m.mine[0]) * m.row
                part = out[m.offset : m.offset + n].view(m.shard.shape).to(m.shard.dtype)
                if self.host is not None:  # summed on the device, then to the host's shard
                    part = self.host.to_host(part)
                    if m.shard.grad is not None:
                        self.host.settle()  # the sum below reads it on the host
                if m.shard.grad is None:
                    m.shard.grad = part
                else:
                    m.shard.grad.add_(part)
        self.deposited = set()
        if self.level == 1:
            self.staging.zero_()  # stage 1 keeps its gradient buffer
        else:
            self.staging = None


def _unpad(m: _Member, out: torch.Tensor, size: int, block: int) -> torch.Tensor:
    """Member ``m``'s local tensor from a gathered buffer (its own storage, built the same way
    every time, so autograd's notes of stage 3 find their views in a later gather)."""
    full = torch.empty((m.rows, m.row), dtype=out.dtype, device=out.device)
    whole, rest = divmod(m.rows, m.chunk)
    grid = m.grid(out, size, block)
    full[: whole * m.chunk].view(whole, m.chunk, m.row).copy_(grid[:whole])
    if rest:
        full[whole * m.chunk :].copy_(grid[whole, :rest])
    return full.view(m.shape)


class _Fetch(torch.autograd.Function):
    """The gathered parameter in forward; in backward its gradient goes into the unit's
    buffer (the shard gets its sum when the unit's reduce-scatter ends, not from autograd)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, zero: Zero, unit: _Unit, m: _Member) -> Any:
        ctx.zero, ctx.unit, ctx.member = zero, unit, m
        full = unit.gathered()[m.fqn]
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.zero.deposit(ctx.unit, ctx.member, grad)
        return None, None, None, None


class Fetch(nn.Module):
    """What the program calls where it reads a ZeRO parameter: the gathered local tensor."""

    def __init__(self, zero: Zero, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn
        self._zero = [zero]  # not a submodule

    def forward(self) -> torch.Tensor:
        return self._zero[0].fetch(self.fqn)

    def extra_repr(self) -> str:
        zero = self._zero[0]
        unit = zero.unit_of(self.fqn)
        return f"{self.fqn}, ZeRO {unit.level}, unit {unit.name} over ranks {list(unit.group)}"


class Zero:
    """The ZeRO units of one rank: shards, gathers, gradient buffers and their sums."""

    def __init__(
        self, rank: int, reshard_after_forward: bool = True, device: Any = None, host: Any = None
    ) -> None:
        self.rank = rank
        self.device = device
        #: the host tier that holds the shards of stage 3 (``offload={"parameters": True}``)
        self.host = host
        self.reshard_after_forward = reshard_after_forward
        self.syncing = True
        self.units: list[_Unit] = []
        self._unit_of: dict[str, tuple[_Unit, _Member]] = {}
        self._stored: dict[int, tuple[_Unit, str, Any]] = {}  # storage -> gathered tensor
        self._queued = False
        #: called with a unit's shards once their sums are in ``.grad`` (the optimizer offload)
        self.summed: Callable[[list[torch.Tensor]], None] | None = None

    # -- building ---------------------------------------------------------------------------------

    def add_unit(
        self,
        name: str,
        level: int,
        group: Sequence[int],
        tensors: dict[str, torch.Tensor],
        compute: dict[str, torch.dtype],
        reduce: torch.dtype | None,
        used: set[str],
    ) -> dict[str, nn.Parameter]:
        """Shard ``tensors`` (local tensors, by name; all on ``group``) into one unit; returns
        this rank's shard of each, the parameters the optimizer steps."""
        group = tuple(group)
        size, index = len(group), group.index(self.rank)
        members, offset, shards = [], 0, {}
        dtypes = {compute[fqn] for fqn in tensors}
        if len(dtypes) != 1:
            raise ZeroError(f"unit {name} mixes compute dtypes {sorted(map(str, dtypes))}")
        for fqn, t in tensors.items():
            rows, row = (t.shape[0], t[0].numel()) if t.dim() else (1, 1)
            chunk = -(-rows // size)
            start = min(rows, index * chunk)
            stop = min(rows, start + chunk)
            body = t.detach().reshape(rows, row)[start:stop].reshape((stop - start, *t.shape[1:]))
            if level == 3 and self.host is not None:
                shard = self.host.place(fqn, body, t.requires_grad)
            else:
                body = torch.empty_like(body, device=self.device) if body.is_meta else body.clone()
                shard = nn.Parameter(body, requires_grad=t.requires_grad)
            members.append(_Member(fqn, shard, t.shape, rows, row, chunk, offset, (start, stop)))
            shards[fqn] = shard
            offset += chunk * row
        first = next(iter(tensors.values()))
        unit = _Unit(
            name,
            level,
            group,
            index,
            members,
            offset,
            dtypes.pop(),
            reduce or first.dtype,
            self.device if first.is_meta else first.device,
        )
        unit.used = sum(1 for fqn in tensors if fqn in used)
        unit.host = self.host if level == 3 else None
        self.units.append(unit)
        for m in members:
            self._unit_of[m.fqn] = (unit, m)
        return shards

    def unit_of(self, fqn: str) -> _Unit:
        return self._unit_of[fqn][0]

    def __contains__(self, fqn: str) -> bool:
        return fqn in self._unit_of

    def group_size(self, fqn: str) -> int:
        return len(self._unit_of[fqn][0].group) if fqn in self._unit_of else 1

    # -- forward ----------------------------------------------------------------------------------

    def reset(self) -> None:
        """A new forward: forget fetches whose backward never came."""
        for unit in self.units:
            if unit.summing is not None:
                self._finish_sum(unit)
            unit.fetched, unit.pending, unit.notes = set(), 0, 0
        self._queued = False
        self._stored = {k: v for k, v in self._stored.items() if v[2]() is not None}

    def fetch(self, fqn: str) -> torch.Tensor:
        unit, m = self._unit_of[fqn]
        full = unit.gathered()
        position = self.units.index(unit)
        ahead = self.units[position + 1] if position + 1 < len(self.units) else None
        if ahead is not None and not ahead.fetched:
            # the next unit's, while this one computes; not one this forward has used already
            # (the root's last reader would gather the first block again for nothing)
            ahead.start_gather()
            self._read_ahead(position + 2)
        for name, t in full.items():
            # a weak reference to the root of the views: a view's object may die before them
            root = t._base if t._base is not None else t
            self._stored[t.untyped_storage().data_ptr()] = (unit, name, weakref.ref(root))
        if torch.is_grad_enabled() and m.shard.requires_grad:
            value = _Fetch.apply(m.shard, self, unit, m)
            unit.pending += 1
        else:
            value = full[fqn]
        unit.fetched.add(fqn)
        if unit.level == 3 and len(unit.fetched) >= unit.used:
            if self.reshard_after_forward or not torch.is_grad_enabled():
                unit.full = None  # the program's references are the last ones
        return value

    def _read_ahead(self, position: int) -> None:
        """The shards in files of the unit at ``position`` (the one after the next to be
        gathered) read on the NVMe tier's I/O thread while the two before it run."""
        if 0 <= position < len(self.units) and self.units[position].host is not None:
            unit = self.units[position]
            if unit.level == 3 and unit.stale() and unit.gathering is None:
                unit.host.read_ahead([m.shard for m in unit.members])

    def saving(self) -> Any:
        """Autograd's saved-tensor hooks that keep notes, not gathered parameters, for stage 3
        (a no-op context when nothing is resharded after forward)."""
        if not self.reshard_after_forward or all(u.level < 3 for u in self.units):
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        entry = (
            self._stored.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        )
        if entry is None:
            return t
        unit, fqn, ref = entry
        base = ref()
        if unit.level < 3 or base is None:
            return t
        if base.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            return t
        unit.notes += 1
        return _Saved(unit, fqn, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        unit = saved.unit
        full = unit.gathered()[saved.fqn]
        position = self.units.index(unit)
        behind = self.units[position - 1] if position > 0 else None
        if behind is not None and behind.level == 3 and behind.notes > 0:
            behind.start_gather()  # backward's next unit, if backward still reads it
            self._read_ahead(position - 2)
        unit.notes -= 1
        if unit.notes == 0:
            # the last note: the view below is the last use (a root's parameters, read by the
            # output layer and then not by the embedding's backward, need not wait for it)
            unit.full = None
        return full.as_strided(saved.size, saved.stride, saved.offset)

    # -- backward ---------------------------------------------------------------------------------

    def deposit(self, unit: _Unit, m: _Member, grad: torch.Tensor) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        unit.deposit(m, grad)
        if unit.pending == 0 and unit.level == 3:
            unit.full = None  # before the sum's buffers
        if unit.pending == 0:
            unit.flush()
        if unit.pending == 0 and self.syncing:
            for other in self.units:  # at most one sum in flight besides this one's
                if other.summing is not None:
                    self._finish_sum(other)
            unit.start_sum()

    def _finish_sum(self, unit: _Unit) -> None:
        unit.finish_sum()
        if self.summed is not None:
            self.summed([m.shard for m in unit.members])

    def _finish(self) -> None:
        """The end of a backward: sum what is left (members that got no gradient), wait for
        every sum and put it in the shards' ``.grad``."""
        self._queued = False
        for unit in self.units:
            unit.flush()
            if unit.summing is None and unit.deposited and self.syncing:
                unit.start_sum()
        for unit in self.units:
            if unit.summing is not None:
                self._finish_sum(unit)
            if unit.level == 3:
                unit.full = None
        if self.host is not None:  # the shards' gradients are the host's to read from now on
            self.host.settle()

    # -- state ------------------------------------------------------------------------------------

    def unsharded(self, fqn: str) -> torch.Tensor:
        """The local tensor of ``fqn`` in its master dtype; a collective of the unit's group."""
        unit, m = self._unit_of[fqn]
        size = len(unit.group)
        send = torch.zeros(m.chunk * m.row, dtype=m.shard.dtype, device=unit.device)
        if unit.host is not None:
            unit.host.read(m.shard, send[: m.shard.numel()])
        else:
            send[: m.shard.numel()].copy_(m.shard.detach().reshape(-1))
        out = comm.all_gather(send, sorted(unit.group)).reshape(-1)
        probe = _Member(m.fqn, m.shard, m.shape, m.rows, m.row, m.chunk, 0, m.mine)
        return _unpad(probe, out, size, m.chunk * m.row)

    def rows(self, fqn: str) -> tuple[int, int]:
        """This rank's rows of dim 0 of ``fqn``'s local tensor."""
        return self._unit_of[fqn][1].mine

    def rows_of(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``fqn``'s local tensor."""
        m = self._unit_of[fqn][1]
        body = local.reshape(m.rows, m.row)[m.mine[0] : m.mine[1]]
        return body.reshape(m.shard.shape)

    def held(self) -> dict[str, list[torch.Tensor]]:
        """What the units keep between steps besides the shards: gathered parameters
        (stages 1 and 2) and gradient buffers (stage 1, and any stage under no_sync)."""
        full = [t for u in self.units if u.full is not None for t in u.full.values()]
        grads = [u.staging for u in self.units if u.staging is not None]
        return {"parameters": full, "gradients": grads}

    def sum_held(self, shards: Sequence[torch.Tensor]) -> None:
        """Sum now the units holding ``shards`` (what backwards run while paused added into
        their buffers: the weight halves of a split backward), every reduce-scatter started
        before the first is waited for, in the units' order (the same on every rank)."""
        wanted = {id(m.shard) for u, m in self._unit_of.values()} & {id(t) for t in shards}
        units = [u for u in self.units if any(id(m.shard) in wanted for m in u.members)]
        for unit in units:
            unit.flush()
            if unit.summing is None and unit.deposited:
                unit.start_sum()
        for unit in units:
            if unit.summing is not None:
                self._finish_sum(unit)

    @contextmanager
    def paused(self) -> Iterator[None]:
        before = self.syncing
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = before


__all__ = ["Fetch", "Zero"]
