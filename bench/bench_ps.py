"""Parameter servers against data parallelism on the DLRM reference, in the same run.

Four CPU ranks of one thread (gloo) train the DLRM reference model (3 tables of ROWS rows,
dim 16, bags of 4, global batch BATCH, float32) two ways, a block of BLOCK steps of each a
round, the order rotating every round: ``autoshard.ps.train`` with 2 servers and 2
workers (Adagrad on the tables' touched rows, AdamW on the dense part, synchronous); the
tables split by rows over the 4 ranks by autoshard's own layouts (``parallelize`` with the
tables' strategy given, the rest propagated: each rank holds a quarter of every table's rows
and pools the ids it holds into a partial sum; Adagrad on its rows, AdamW on the rest); and
data parallelism over the 4 ranks with every table replicated (torch's
``DistributedDataParallel``, the tables' gradients dense and all-reduced whole, Adagrad on
the tables, AdamW on the rest). A way's step time is the slowest rank's mean over its block's
steps after the first (the parameter-server job's start, a new job each block, is left
out). The ratio is the median over rounds of the two ways' ratio in each round, with a
bootstrap interval (``bench.timing.paired_ratio``).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from bench.timing import paired_ratio

NAME = "ps"

ROWS, BATCH, BLOCK, ROUNDS, WARMUP = 100_000, 256, 6, 9, 1
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


class _RowsSplit:
    """Every table split by rows over the 4 ranks (autoshard's layouts), the rest propagated
    from them by the plan search."""

    def __init__(self, rows: int) -> None:
        import autoshard

        self.rows, self.autoshard = rows, autoshard
        self.pm = autoshard.parallelize(
            _model(rows),
            _batch(rows, 0),
            {"dp": 4},
            strategies={"tables.*": {"space": (None, None, "dp")}},
            search="propagate",
        )
        named = list(self.pm.named_parameters())
        self.optimizers = [
            torch.optim.Adagrad([p for n, p in named if n.startswith("tables")], lr=0.1),
            torch.optim.AdamW([p for n, p in named if not n.startswith("tables")], lr=1e-3),
        ]

    def block(self, first: int) -> float:
        ends = []
        for step in range(BLOCK):
            batch = self.autoshard.shard_inputs(_batch(self.rows, first + step), self.pm)
            self.pm(*batch).backward()
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad()
            ends.append(time.perf_counter())
        return _slowest((ends[-1] - ends[0]) / (BLOCK - 1))


def _rank(rows: int, rounds: int) -> dict:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dp, split = _DataParallel(rows), _RowsSplit(rows)
    ways = {
        "ps": lambda first: _ps_block(rows, first),
        "rows": split.block,
        "dp": dp.block,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for i in range(WARMUP + rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
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
        **{f"{way}_ms": statistics.median(times[way]) * 1e3 for way in times},
        **{f"{way}_samples_per_s": BATCH / statistics.median(times[way]) for way in times},
        "paired": paired_ratio(times["ps"], times["dp"]),
        "rows_paired": paired_ratio(times["rows"], times["dp"]),
        "ps_rows_paired": paired_ratio(times["ps"], times["rows"]),
        "dp_table_bytes": 3 * rows * row_bytes,
    }


def summary(result: dict) -> str:
    p, r, pr = result["paired"], result["rows_paired"], result["ps_rows_paired"]
    return "\n".join(
        [
            f"DLRM reference (3 tables of {result['rows']:,} rows, dim 16, global batch {BATCH}, "
            "float32) on 4 CPU ranks of 1 thread (gloo): 2 parameter servers + 2 workers "
            "(`autoshard.ps.train`, synchronous), the tables split by rows over the 4 ranks "
            "by autoshard's layouts (`parallelize` with `tables.*` split by rows, the rest "
            "propagated; a quarter of every table a rank) and data parallelism over the 4 "
            "ranks with the tables replicated (DDP, each table's whole gradient all-reduced: "
            f"{result['dp_table_bytes'] / 2**20:.1f} MiB of tables), a block of {BLOCK} steps "
            "of each a round, the order rotating every round; "
            f"{result['rounds']} rounds. Ratios: the median over rounds of one way's step / "
            "another's, with its 95% interval; below 1 the first is faster.",
            "",
            "| way | ms/step | samples/s |",
            "|---|---:|---:|",
            f"| 2 servers + 2 workers | {result['ps_ms']:.1f} | {result['ps_samples_per_s']:.0f} |",
            f"| split by rows over 4 ranks | {result['rows_ms']:.1f} | "
            f"{result['rows_samples_per_s']:.0f} |",
            f"| data parallel, 4 ranks | {result['dp_ms']:.1f} | "
            f"{result['dp_samples_per_s']:.0f} |",
            "",
            f"ps/dp ratio {p['median']:.3f} (95% interval {p['low']:.3f}-{p['high']:.3f})",
            f"rows/dp ratio {r['median']:.3f} (95% interval {r['low']:.3f}-{r['high']:.3f})",
            f"ps/rows ratio {pr['median']:.3f} (95% interval {pr['low']:.3f}-{pr['high']:.3f})",
        ]
    )
