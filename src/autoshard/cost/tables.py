"""Pricing a model's embedding tables three ways (docs/parallelism/parameter-server.md):
on parameter servers, split by rows across every rank, or replicated (data parallel).

A step's rows are priced by the expected number of distinct rows it touches. The access
distribution assumed is the DLRM reference's: a lookup draws row ``floor(R * u**skew)`` with
``u`` uniform on [0, 1) (skew 3: a power law, row r drawn with probability
``((r+1)/R)**(1/3) - (r/R)**(1/3)``), every lookup independent. ``n`` lookups then touch
``sum_r 1 - (1 - p_r)**n`` distinct rows. The dense part is priced the same in every way
and left out; only the tables' movement and optimizer step are compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.collectives import collective_time

__all__ = ["TablePrice", "TableShape", "describe", "expected_unique_rows", "price_tables"]

#: bytes of memory traffic of Adagrad's step per element of a row: the row, its sum of
#: squares and its gradient read, the row and the sum written
_UPDATE_PASSES = 5
_EXACT = 1 << 16  # rows summed one by one


def expected_unique_rows(num_rows: int, lookups: float, skew: float = 3.0) -> float:
    """Distinct rows ``lookups`` independent draws touch on average (module docstring). The
    first rows are summed one by one; past them, where a row's chance changes slowly, rows
    are summed in runs of about 1/4096 of their index, each at the run's mean chance."""
    if num_rows < 1 or lookups < 0:
        raise ValueError(f"num_rows({num_rows}) must be >= 1 and lookups({lookups}) >= 0")
    bounds = list(range(min(num_rows, _EXACT) + 1))
    while bounds[-1] < num_rows:
        bounds.append(min(num_rows, bounds[-1] + max(1, bounds[-1] // 4096)))
    edges = torch.tensor(bounds, dtype=torch.float64)
    width = edges[1:] - edges[:-1]
    cdf = (edges / num_rows) ** (1 / skew)
    p = ((cdf[1:] - cdf[:-1]) / width).clamp(max=1.0)  # each row's chance in its run
    return float((width * -torch.expm1(lookups * torch.log1p(-p))).sum())


@dataclass(frozen=True)
class TableShape:
    """``num_tables`` tables of ``num_rows`` rows of ``dim`` elements of ``element_bytes``,
    ``bag`` lookups a sample in each, a global batch of ``batch`` samples."""

    num_tables: int
    num_rows: int
    dim: int
    bag: int
    batch: int
    element_bytes: int = 4

    @property
    def row_bytes(self) -> int:
        return self.dim * self.element_bytes


@dataclass(frozen=True)
class TablePrice:
    """One way's step for the tables: bytes a rank sends, seconds moving rows and updating."""

    way: str
    bytes_per_rank: float
    move_s: float
    update_s: float

    @property
    def step_s(self) -> float:
        return self.move_s + self.update_s


def _update_s(rows: float, shape: TableShape, cluster: ClusterSpec) -> float:
    return rows * shape.row_bytes * _UPDATE_PASSES / cluster.memory_bandwidth


def _servers(shape: TableShape, servers: int, ranks: int, cluster: ClusterSpec) -> TablePrice:
    """Each worker pulls its batch's distinct rows and pushes their gradients, one server
    after the other; a server answers every worker for its share of them, one after the
    other, and applies the rows all workers sent (the busier end prices the move)."""
    workers = ranks - servers
    mine = shape.num_tables * expected_unique_rows(
        shape.num_rows, shape.batch / workers * shape.bag
    )
    per_pair = 2 * mine * shape.row_bytes / servers  # pulled and pushed, with one server
    pair = collective_time("send_recv", per_pair, 2, cluster.devices_per_node, cluster)
    applied = shape.num_tables * expected_unique_rows(shape.num_rows, shape.batch * shape.bag)
    return TablePrice(
        f"{servers} servers + {workers} workers",
        max(workers, servers) * per_pair,
        max(workers, servers) * pair,
        _update_s(applied / servers, shape, cluster),
    )


def _by_rows(shape: TableShape, ranks: int, cluster: ClusterSpec) -> TablePrice:
    """Every rank holds 1/ranks of each table's rows: its batch's distinct rows come from
    their owners and their gradients go back (two all-to-alls), each owner updating its own."""
    mine = shape.num_tables * expected_unique_rows(shape.num_rows, shape.batch / ranks * shape.bag)
    nbytes = mine * shape.row_bytes
    per_node = cluster.devices_per_node
    move = 2 * collective_time("all_to_all", nbytes, ranks, per_node, cluster)
    applied = shape.num_tables * expected_unique_rows(shape.num_rows, shape.batch * shape.bag)
    sent = 2 * nbytes * (ranks - 1) / ranks
    return TablePrice(
        f"split by rows over {ranks}", sent, move, _update_s(applied / ranks, shape, cluster)
    )


def _replicated(shape: TableShape, ranks: int, cluster: ClusterSpec) -> TablePrice:
    """Every rank holds every table and all-reduces its whole gradient, then updates it all."""
    nbytes = shape.num_tables * shape.num_rows * shape.row_bytes
    move = collective_time("all_reduce", nbytes, ranks, cluster.devices_per_node, cluster)
    rows = shape.num_tables * shape.num_rows
    return TablePrice(
        f"replicated on {ranks}",
        2 * nbytes * (ranks - 1) / ranks,
        move,
        _update_s(rows, shape, cluster),
    )


def price_tables(
    shape: TableShape, ranks: int, cluster: ClusterSpec, servers: int | None = None
) -> list[TablePrice]:
    """The ways to hold the tables on ``ranks`` devices, fastest first: ``servers`` servers
    (default half the ranks) and the rest workers, split by rows over every rank, replicated
    on every rank. The dense part's compute is not priced: with servers it runs on the
    workers alone, in the other ways on every rank."""
    servers = ranks // 2 if servers is None else servers
    if ranks < 2 or not 1 <= servers < ranks:
        raise ValueError(
            f"servers({servers}) must leave a worker of {ranks} devices (2 or more devices)"
        )
    ways = [
        _servers(shape, servers, ranks, cluster),
        _by_rows(shape, ranks, cluster),
        _replicated(shape, ranks, cluster),
    ]
    return sorted(ways, key=lambda p: p.step_s)


def describe(
    shape: TableShape, ranks: int, cluster: ClusterSpec, servers: int | None = None
) -> list[str]:
    """``price_tables``' ways as the lines ``autoshard plan --model dlrm`` prints."""
    ways = price_tables(shape, ranks, cluster, servers)
    touched = expected_unique_rows(shape.num_rows, shape.batch * shape.bag)
    lines = [
        f"tables: {shape.num_tables} x {shape.num_rows:,} rows x dim {shape.dim} "
        f"({shape.element_bytes} B elements), {shape.bag} lookups a sample in each, global "
        f"batch {shape.batch}, on {ranks} devices of {cluster.name}",
        f"a step touches {touched:,.0f} distinct rows of each table (expected; lookups drawn "
        "as row floor(rows * u**3), u uniform: a power law)",
        "| way | bytes/rank | move ms | update ms | step ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in ways:
        lines.append(
            f"| {p.way} | {p.bytes_per_rank:,.0f} | {p.move_s * 1e3:.3f} | "
            f"{p.update_s * 1e3:.3f} | {p.step_s * 1e3:.3f} |"
        )
    lines.append(
        f"fastest for the tables: {ways[0].way} (the dense part's compute is not priced: with "
        "servers it runs on the workers alone)"
    )
    return lines
