"""Parameter servers against data parallelism on the DLRM reference, in the same run.

Four CPU ranks of one thread (gloo) train the DLRM reference model (3 tables of ROWS rows,
dim 16, bags of 4, global batch BATCH, float32) two ways, a block of BLOCK steps of each a
round, the order turning around every round: ``autoshard.ps.train`` with 2 servers and 2
workers (Adagrad on the tables' touched rows, AdamW on the dense part, synchronous), and
data parallelism over the 4 ranks with every table replicated (torch's
``DistributedDataParallel``, the tables' gradients dense and all-reduced whole, Adagrad on
the tables, AdamW on the rest). A way's step time is the slowest rank's mean over its block's
steps after the first (the parameter-server job's start, a new job each block, is left
out). The ratio is the median over rounds of the two ways' ratio in each round, with a
bootstrap interval (``bench.timing.paired_ratio``).

Not measured: the tables split by rows over the 4 ranks by autoshard's own layouts, which
``autoshard.plan`` plans but no run on ranks has checked yet.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from bench.timing import paired_ratio

NAME = "ps"

ROWS, BATCH, BLOCK, ROUNDS, WARMUP = 100_000, 256, 6, 8, 1
SERVERS = 2


def _config(rows: int):
    from autoshard.models import reference_config

    return reference_config("dlrm", rows=rows, tables=3, dim=16)


def _model(rows: int, sparse: bool = True):
    from autoshard.models import build

    torch.manual_seed(0)
    model = build(_config(rows))
    for table in model.tables:
        table.sparse = sparse
    return model


def _batch(rows: int, step: int) -> tuple[torch.Tensor, ...]:
    return _config(rows).example_batch(BATCH, torch.Generator().manual_seed(step))


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _ps_block(rows: int, first: int) -> float:
    """A parameter-server job of BLOCK steps; the mean of its steps after the first."""
    import functools

    from autoshard import ps

    workers = 4 - SERVERS
    per = BATCH // workers
    ends: list[float] = []

    def batches(worker: int, step: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[worker * per : (worker + 1) * per] for t in _batch(rows, first + step))

    ps.train(
        functools.partial(_model, rows),
        batches,
        BLOCK,
        ps.PSConfig(SERVERS, dense_lr=1e-3),
        lambda step, loss: ends.append(time.perf_counter()),
    )
    return _slowest((ends[-1] - ends[0]) / (BLOCK - 1) if ends else 0.0)


class _DataParallel:
    """Every table replicated on the 4 ranks, its whole gradient all-reduced each step."""

    def __init__(self, rows: int) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _model(rows, sparse=False)
        tables = [t.weight for t in model.tables]
        dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
        self.rows, self.ddp = rows, DDP(model)
        self.optimizers = [
            torch.optim.Adagrad(tables, lr=0.1),
            torch.optim.AdamW(dense, lr=1e-3),
        ]

    def block(self, first: int) -> float:
        import torch.distributed as dist

        rank, per = dist.get_rank(), BATCH // dist.get_world_size()
        ends = []
        for step in range(BLOCK):
            mine = tuple(t[rank * per : (rank + 1) * per] for t in _batch(self.rows, first + step))
            self.ddp(*mine).backward()
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad()
            ends.append(time.perf_counter())
        return _slowest((ends[-1] - ends[0]) / (BLOCK - 1))


def _rank(rows: int, rounds: int) -> dict:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dp = _DataParallel(rows)
    ways = {"ps": lambda first: _ps_block(rows, first), "dp": dp.block}
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for i in range(WARMUP + rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            seconds = ways[name](i * BLOCK)
            if i >= WARMUP:
                times[name].append(seconds)
    return times


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    rows, rounds = (10_000, 2) if quick else (ROWS, ROUNDS)
    times = run_ranks(_rank, 4, rows, rounds, timeout=1800)[0]
    row_bytes = 16 * 4
    return {
        "rows": rows,
        "rounds": rounds,
        "ps_ms": statistics.median(times["ps"]) * 1e3,
        "dp_ms": statistics.median(times["dp"]) * 1e3,
        "ps_samples_per_s": BATCH / statistics.median(times["ps"]),
        "dp_samples_per_s": BATCH / statistics.median(times["dp"]),
        "paired": paired_ratio(times["ps"], times["dp"]),
        "dp_table_bytes": 3 * rows * row_bytes,
    }


def summary(result: dict) -> str:
    p = result["paired"]
    return "\n".join(
        [
            f"DLRM reference (3 tables of {result['rows']:,} rows, dim 16, global batch {BATCH}, "
            "float32) on 4 CPU ranks of 1 thread (gloo): 2 parameter servers + 2 workers "
            "(`autoshard.ps.train`, synchronous) against data parallelism over the 4 ranks "
            "with the tables replicated (DDP, each table's whole gradient all-reduced: "
            f"{result['dp_table_bytes'] / 2**20:.1f} MiB of tables), a block of {BLOCK} steps "
            f"of each a round, the order turning every round; {result['rounds']} rounds. "
            "Ratio: the median over rounds of the parameter servers' step / data "
            "parallelism's, with its 95% interval; below 1 the servers are faster. Not "
            "measured: the tables split by rows over the 4 ranks by autoshard's layouts "
            "(planned, not yet run on ranks).",
            "",
            "| way | ms/step | samples/s |",
            "|---|---:|---:|",
            f"| 2 servers + 2 workers | {result['ps_ms']:.1f} | {result['ps_samples_per_s']:.0f} |",
            f"| data parallel, 4 ranks | {result['dp_ms']:.1f} | "
            f"{result['dp_samples_per_s']:.0f} |",
            "",
            f"ps/dp ratio {p['median']:.3f} (95% interval {p['low']:.3f}-{p['high']:.3f})",
        ]
    )
