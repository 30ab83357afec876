"""Embedding offload (docs/parallelism/offload.md): the tables of the ``nn.Embedding`` modules that
``offload={"embeddings": glob}`` names stay on the host, with their lookup and their sparse
update; only the rows a batch looks up travel to the device, and their gradients back.

The lookup, in the program where the table's ``embedding`` was: the ids come to the host,
their unique rows are read from the table into pinned memory and copied to the device, and
each id takes its row there. Backward sums each unique row's gradient on the device, then
over the data-parallel replicas (their unique ids and rows gathered, the union summed), and
copies the union's rows to the host, where the table's gradient is a sparse tensor of them,
as ``nn.Embedding(sparse=True)`` gives; an optimizer that takes sparse gradients steps it there.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autoshard import comm
from autoshard.devices import host_ints
from autoshard.ops import local
from autoshard.redistribution import replica_sum_groups
from autoshard.runtime.offload.host import HostTier

_LOOKUPS = (torch.ops.aten.embedding.default,)


@dataclass(eq=False)
class _Table:
    fqn: str
    param: nn.Parameter  # the host table
    group: list[int] | None  # the replicas its gradient is summed over


@dataclass(eq=False)
class EmbeddingOffload:
    """The host tables of a rank, and the bytes of rows that crossed in the last step."""

    host: HostTier
    tables: dict[str, _Table] = field(default_factory=dict)
    traffic: dict[str, int] = field(default_factory=lambda: {"to_device": 0, "to_host": 0})

    def reset(self) -> None:
        self.traffic = {"to_device": 0, "to_host": 0}

    def rewrite(self, gm: fx.GraphModule, attr: Any) -> None:
        """Each lookup of a host table in ``gm`` made a ``HostLookup`` of its ids; ``attr``
        gives a table's attribute name in the program."""
        for fqn, table in self.tables.items():
            reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == attr(fqn)]
            for read in reads:
                for value, dtype in [(read, None), *_casts(read)]:
                    for user in list(value.users):
                        if user.op == "call_function" and user.target in _LOOKUPS:
                            lookup = HostLookup(self, table, dtype)
                            _replace(gm, user, lookup, f"host_lookup_{attr(fqn)}_{user.name}")
                    if value is not read and not value.users:
                        gm.graph.erase_node(value)
                if read.users:
                    readers = sorted(str(u.target) for u in read.users)
                    raise ValueError(
                        f"offload['embeddings']: {fqn} is read by {', '.join(readers)} besides "
                        "its lookups (a tied weight?); only a table read by lookups alone "
                        "stays on the host"
                    )
                gm.graph.erase_node(read)
        gm.recompile()


def _casts(read: fx.Node) -> list[tuple[fx.Node, torch.dtype]]:
    """The casts of a table the program reads in the compute dtype (mixed precision)."""
    return [
        (u, u.args[1])
        for u in read.users
        if u.op == "call_function" and u.target is local.cast and u.args[0] is read
    ]


def _replace(gm: fx.GraphModule, lookup: fx.Node, module: nn.Module, name: str) -> None:
    """``lookup`` (an ``embedding`` of a host table) made a call of ``module`` on its ids."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(lookup):
        call = gm.graph.call_module(name, (lookup.args[1],))
    lookup.replace_all_uses_with(call)
    gm.graph.erase_node(lookup)


class HostLookup(nn.Module):
    """``embedding(table, ids)`` with the table on the host; its rows in ``dtype`` (the
    compute dtype of mixed precision: only the rows looked up are cast, on the device)."""

    def __init__(
        self, offload: EmbeddingOffload, table: _Table, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self._of = [offload, table]  # not submodules: the table is the program's parameter
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offload, table = self._of
        rows = _Lookup.apply(table.param, ids, offload, table)
        return rows if self.dtype is None else local.cast(rows, self.dtype)

    def extra_repr(self) -> str:
        table = self._of[1]
        return f"{table.fqn} on the host, summed over ranks {table.group}"


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, ids: torch.Tensor, offload: Any, table: Any) -> Any:
        host = offload.host
        # the host looks the rows up: it waits here for the ids (one wait a lookup)
        unique, inverse = torch.unique(ids.to("cpu"), return_inverse=True)
        rows = host.empty((unique.numel(), param.shape[1]), param.dtype)
        torch.index_select(param.detach(), 0, unique, out=rows)
        device = ids.device
        moved = rows.to(device, non_blocking=True)
        offload.traffic["to_device"] += rows.nbytes
        where = inverse.to(device, non_blocking=True)
        ctx.offload, ctx.table, ctx.shape = offload, table, param.shape
        ctx.save_for_backward(unique.to(device, non_blocking=True), where)
        return F.embedding(where, moved)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        unique, where = ctx.saved_tensors
        rows = torch.zeros((unique.numel(), grad.shape[-1]), dtype=grad.dtype, device=grad.device)
        rows.index_add_(0, where.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        if ctx.table.group is not None:
            unique, rows = _summed(unique, rows, ctx.table.group)
        host = ctx.offload.host
        values = host.to_host(rows)
        ctx.offload.traffic["to_host"] += values.nbytes
        indices = unique.to("cpu").reshape(1, -1)
        host.settle()  # autograd may read the gradient on the host as soon as it is returned
        sparse = torch.sparse_coo_tensor(indices, values, ctx.shape, is_coalesced=True)
        return sparse, None, None, None


def _summed(
    unique: torch.Tensor, rows: torch.Tensor, group: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over ``group`` of each rank's rows at its ``unique`` ids: the union's ids and
    rows. Each rank's ids and rows padded to the most any has, gathered, the union summed."""
    count = torch.tensor([unique.numel()], dtype=torch.int64, device=rows.device)
    counts = host_ints([comm.all_gather(count, group)])[0]
    most = max(counts)
    ids = torch.zeros(most, dtype=torch.int64, device=rows.device)
    ids[: unique.numel()] = unique
    padded = torch.zeros((most, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    all_ids = comm.all_gather(ids, group).reshape(len(group), most)
    all_rows = comm.all_gather(padded, group).reshape(len(group), most, rows.shape[1])
    ids = torch.cat([all_ids[i, :c] for i, c in enumerate(counts)])
    rows = torch.cat([all_rows[i, :c] for i, c in enumerate(counts)])
    union, inverse = torch.unique(ids, return_inverse=True)
    out = torch.zeros((union.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return union, out.index_add_(0, inverse, rows)


def embedding_offload(
    model: nn.Module,
    plan: Any,
    tensors: dict[str, torch.Tensor],
    glob: Any,
    host: Any,
    rank: int,
    elsewhere: frozenset[str] = frozenset(),
) -> EmbeddingOffload | None:
    """The tables ``glob`` names made host parameters in ``tensors`` (in place), or None
    where ``glob`` is not given; ``elsewhere``: the parameters other ranks' pipeline stages
    hold and this rank's do not (their tables are the host's of those ranks)."""
    if not glob:
        return None
    offload = EmbeddingOffload(host)
    for path in _matched(model, glob):
        fqn = f"{path}.weight"
        if fqn in elsewhere:
            continue
        p = plan.params.get(fqn)
        if p is None or fqn not in tensors:
            raise ValueError(
                f"offload['embeddings']: the plan holds no parameter named {fqn} (a tied "
                "weight is held once, under another of its names); only a table read by its "
                "lookups alone stays on the host"
            )
        if p.layout.local_shape() != tuple(p.layout.shape):
            raise ValueError(
                f"offload['embeddings']: {fqn} is split across ranks ({p.layout}); an offloaded "
                "table is whole on every rank"
            )
        group = None
        if p.grad_partial is not None:
            groups = replica_sum_groups(p.grad_partial, p.layout.with_dtype(p.grad_partial.dtype))
            if groups is None:
                raise ValueError(
                    f"offload['embeddings']: {fqn}'s gradient is not summed over replicas alone"
                )
            group = next(sorted(g) for g in groups if rank in g)
        t = tensors[fqn]
        tensors[fqn] = host.place(fqn, t, t.requires_grad)
        offload.tables[fqn] = _Table(fqn, tensors[fqn], group)
    return offload


def table_names(model: nn.Module, glob: str) -> list[str]:
    """The weights of the tables ``glob`` names (checked as ``embedding_offload`` does)."""
    return [f"{path}.weight" for path in _matched(model, glob)]


def _matched(model: nn.Module, glob: str) -> list[str]:
    """The module paths of ``model``'s nn.Embedding modules ``glob`` matches, checked."""
    embeddings = {n: m for n, m in model.named_modules() if type(m) is nn.Embedding}
    paths = [n for n in embeddings if fnmatch.fnmatchcase(n, glob)]
    if not paths:
        known = ", ".join(embeddings) or "none"
        raise ValueError(
            f"offload['embeddings']={glob!r}: matches no nn.Embedding of the model "
            f"(its nn.Embedding modules: {known})"
        )
    for path in paths:
        m = embeddings[path]
        if not m.sparse:
            raise ValueError(
                f"offload['embeddings']: {path} is an nn.Embedding without sparse=True; its "
                "update on the host is sparse: build it with sparse=True and step it with an "
                "optimizer that takes sparse gradients (SGD, Adagrad, SparseAdam)"
            )
        if m.padding_idx is not None or m.max_norm is not None or m.scale_grad_by_freq:
            raise ValueError(
                f"offload['embeddings']: {path} has padding_idx, max_norm or "
                "scale_grad_by_freq; an offloaded table takes none of them"
            )
    return paths


__all__ = ["EmbeddingOffload", "HostLookup", "embedding_offload", "table_names"]
