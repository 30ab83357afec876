"""Parameter servers: 2 servers + 2 workers train as one device when synchronous; with a
staleness bound they stay within it and converge as the synchronous run does."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import pytest
import torch
from torch import nn

from autoshard.models import DLRM, DLRMConfig, build, reference_config
from autoshard.runtime.ps import PSConfig, find_tables, row_ranges, table_optimizer, train
from autoshard.runtime.ps import server as server_module
from autoshard.testing import RankFailure, run_ranks

SERVERS, WORKERS = 2, 2
SMALL = DLRMConfig(
    num_tables=3, num_rows=50, embedding_dim=4, bag_size=3, dense_features=5, hidden=8
)
LONG = DLRMConfig(num_tables=3, num_rows=500, embedding_dim=8, bag_size=4, hidden=32)
LONG_STEPS = 200
HELD_OUT = 8192


class _RowsUnknown(DLRM):
    """The DLRM without ``table_rows``: its rows are pulled as its forward meets them."""

    table_rows = None


def _model(config: DLRMConfig, dtype: torch.dtype, ahead: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return (DLRM if ahead else _RowsUnknown)(config).to(dtype)


def _global_batch(config: DLRMConfig, dtype: torch.dtype, size: int, step: int) -> tuple:
    dense, rows, clicks = config.example_batch(size, torch.Generator().manual_seed(100 + step))
    return dense.to(dtype), rows, clicks.to(dtype)


def _worker_batch(
    config: DLRMConfig, dtype: torch.dtype, per_worker: int, worker: int, step: int
) -> tuple:
    batch = _global_batch(config, dtype, per_worker * WORKERS, step)
    return tuple(t[worker * per_worker : (worker + 1) * per_worker] for t in batch)


def _case(case: dict[str, Any]) -> dict[str, Any]:
    dtype, config = case["dtype"], case["model"]
    return train(
        functools.partial(_model, config, dtype, case.get("ahead", True)),
        functools.partial(_worker_batch, config, dtype, case["per_worker"]),
        case["steps"],
        case["ps"],
        save_to=case.get("save_to"),
        resume_from=case.get("resume_from"),
    )


def _cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_default_dtype(torch.float32)
    return [_case(case) for case in cases]


def _one_device(case: dict[str, Any]) -> tuple[list[float], nn.Module]:
    """The same training on one device: torch.optim's sparse-aware optimizer on the tables,
    AdamW on the rest, the workers' batches together."""
    config, dtype, ps = case["model"], case["dtype"], case["ps"]
    model = _model(config, dtype)
    tables = [t.weight for t in find_tables(model).values()]
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    optimizers = [
        table_optimizer(ps.table_optimizer, tables, ps.table_lr),
        torch.optim.AdamW(dense, lr=ps.dense_lr),
    ]
    losses = []
    for step in range(case["steps"]):
        loss = model(*_global_batch(config, dtype, case["per_worker"] * WORKERS, step))
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, model


def _row_bytes(case: dict[str, Any], worker: int) -> list[int]:
    """Per step, the unique rows worker ``worker``'s batch touches times a row's bytes."""
    config, dtype = case["model"], case["dtype"]
    row = config.embedding_dim * torch.empty((), dtype=dtype).element_size()
    out = []
    for step in range(case["steps"]):
        _, rows, _ = _worker_batch(config, dtype, case["per_worker"], worker, step)
        out.append(sum(len(rows[:, t].unique()) for t in range(config.num_tables)) * row)
    return out


SYNC = [
    {"model": SMALL, "dtype": torch.float64, "per_worker": 4, "steps": 5, "ps": PSConfig(2)},
    {
        "model": SMALL,
        "dtype": torch.float64,
        "per_worker": 4,
        "steps": 5,
        "ps": PSConfig(2, table_optimizer="sgd", table_lr=0.5, dense_lr=1e-2),
    },
]
UNNAMED = {
    "model": SMALL,
    "dtype": torch.float64,
    "per_worker": 4,
    "steps": 6,
    "ps": PSConfig(2, staleness=1),
    "ahead": False,
}
LONG_RUNS = [
    {"model": LONG, "dtype": torch.float32, "per_worker": 32, "steps": LONG_STEPS, "ps": ps}
    for ps in (PSConfig(2, dense_lr=1e-2), PSConfig(2, staleness=2, dense_lr=1e-2))
]


SAVED = {"model": SMALL, "dtype": torch.float64, "per_worker": 4, "steps": 3, "ps": PSConfig(2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[list[dict[str, Any]]]:
    """Every case on 2 servers + 2 workers, in one spawn: per case, the ranks' results."""
    SAVED["save_to"] = str(tmp_path_factory.mktemp("ps") / "job")
    cases = [*SYNC, *LONG_RUNS, UNNAMED, SAVED]
    per_rank = run_ranks(_cases, SERVERS + WORKERS, cases, timeout=600)
    return [[rank[i] for rank in per_rank] for i in range(len(cases))]


def _check_against_one_device(case: dict[str, Any], results: list[dict[str, Any]]) -> None:
    losses, model = _one_device(case)
    servers = [r for r in results if r["role"] == "server"]
    workers = [r for r in results if r["role"] == "worker"]
    assert len(servers) == SERVERS and len(workers) == WORKERS
    for worker in workers:
        torch.testing.assert_close(worker["losses"], losses)
        dense = {k: v for k, v in model.state_dict().items() if not k.startswith("tables.")}
        assert worker["state"].keys() == dense.keys()
        for name, value in dense.items():
            torch.testing.assert_close(worker["state"][name], value, msg=name)
    for path, table in find_tables(model).items():
        held = [s["ranges"][path] for s in servers]
        assert held == row_ranges(table.weight.shape[0], SERVERS)
        for server, (lo, hi) in zip(servers, held, strict=True):
            torch.testing.assert_close(server["shards"][path], table.weight.detach()[lo:hi])


@pytest.mark.parametrize("which", range(len(SYNC)), ids=["adagrad", "sgd"])
def test_synchronous_training_equals_one_device(runs, which: int) -> None:
    results = runs[which]
    case = SYNC[which]
    _check_against_one_device(case, results)
    for server in (r for r in results if r["role"] == "server"):
        assert server["max_staleness"] == 0
        assert server["applied"] == dict.fromkeys(range(SERVERS, SERVERS + WORKERS), case["steps"])


@pytest.mark.parametrize("which", range(len(SYNC)), ids=["adagrad", "sgd"])
def test_bytes_pulled_and_pushed_are_the_unique_touched_rows(runs, which: int) -> None:
    results, case = runs[which], SYNC[which]
    total = 0
    for worker in (r for r in results if r["role"] == "worker"):
        expected = _row_bytes(case, worker["index"])
        assert worker["pulled_bytes"] == expected
        assert worker["pushed_bytes"] == expected
        total += sum(expected)
    row = SMALL.embedding_dim * 8
    servers = [r for r in results if r["role"] == "server"]
    assert sum(s["rows_out"] for s in servers) * row == total
    assert sum(s["rows_in"] for s in servers) * row == total


def _trained(results: list[dict[str, Any]], config: DLRMConfig) -> nn.Module:
    """The model a run ended with: a worker's dense part, the servers' rows."""
    model = _model(config, torch.float32)
    state = dict(next(r for r in results if r["role"] == "worker")["state"])
    servers = [r for r in results if r["role"] == "server"]
    for path in find_tables(model):
        state[f"{path}.weight"] = torch.cat([s["shards"][path] for s in servers])
    model.load_state_dict(state)
    return model


def test_bounded_staleness_stays_within_its_bound_and_converges(runs) -> None:
    sync, stale = runs[len(SYNC)], runs[len(SYNC) + 1]
    bound = LONG_RUNS[1]["ps"].staleness
    for server in (r for r in stale if r["role"] == "server"):
        # pushes go a step late, so some pull misses a step: the bound is met, not idle
        assert 1 <= server["max_staleness"] <= bound
        assert server["applied"] == dict.fromkeys(range(SERVERS, SERVERS + WORKERS), LONG_STEPS)
    # the loss at step 200: both trained models on one held-out batch of HELD_OUT samples.
    # One batch of 64 is too few to compare by: the synchronous model's loss over 50 such
    # batches has a standard deviation of a third of its mean
    held_out = LONG.example_batch(HELD_OUT, torch.Generator().manual_seed(10_000))
    with torch.no_grad():
        sync_end = float(_trained(sync, LONG)(*held_out))
        stale_end = float(_trained(stale, LONG)(*held_out))
    first = next(r for r in sync if r["role"] == "worker")["losses"][0]
    # learned something, so that being near the synchronous run means something
    assert sync_end < 0.5 * first, (first, sync_end)
    assert abs(stale_end - sync_end) <= 0.05 * sync_end, (stale_end, sync_end)


def test_the_next_batch_s_rows_are_requested_before_the_step_computes(runs) -> None:
    """Staleness 2 on the DLRM, which names its rows ahead: every step's rows were requested
    before the step before it computed, and the servers sent them while it did."""
    stale = runs[len(SYNC) + 1]
    sent: dict[tuple[int, int], float] = {}  # (worker rank, step): when its last rows left
    for server in (r for r in stale if r["role"] == "server"):
        for rank, step, when in server["timeline"]:
            sent[rank, step] = max(sent.get((rank, step), 0.0), when)
    early = 0
    for worker in (r for r in stale if r["role"] == "worker"):
        rank = SERVERS + worker["index"]
        order = [(event, step) for event, step, _ in worker["timeline"]]
        times = {(event, step): when for event, step, when in worker["timeline"]}
        assert order[:2] == [("requested", 0), ("requested", 1)]
        for step in range(LONG_STEPS - 1):
            i = order.index(("computed", step))
            # step + 1's request is made in step, before its forward
            assert order[i - 1] == ("requested", step + 1), order[i - 3 : i + 1]
            early += sent[rank, step + 1] < times["computed", step]
    # rows that left a server before the step before theirs had computed came while it did
    assert early > 0, sent


def test_a_two_server_checkpoint_trains_on_three_servers(runs) -> None:
    """3 steps on 2 servers saved, loaded by 3 servers and 2 workers (each server reading
    the rows it now holds), trained to step 6: one device's 6 steps, losses and every
    parameter."""
    resumed = {**SAVED, "steps": 6, "ps": PSConfig(3), "resume_from": SAVED["save_to"]}
    del resumed["save_to"]
    per_rank = run_ranks(_cases, 3 + WORKERS, [resumed], timeout=300)
    results = [rank[0] for rank in per_rank]
    losses, model = _one_device(resumed)
    saved_losses = next(r for r in runs[-1] if r["role"] == "worker")["losses"]
    torch.testing.assert_close(saved_losses, losses[:3])
    servers = [r for r in results if r["role"] == "server"]
    assert [s["ranges"]["tables.0"] for s in servers] == row_ranges(SMALL.num_rows, 3)
    for worker in (r for r in results if r["role"] == "worker"):
        torch.testing.assert_close(worker["losses"], losses[3:])
    for path, table in find_tables(model).items():
        rows = torch.cat([s["shards"][path] for s in servers])
        torch.testing.assert_close(rows, table.weight.detach())
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("tables.")}
    for name, value in dense.items():
        torch.testing.assert_close(results[-1]["state"][name], value, msg=name)


def test_rows_a_model_does_not_name_go_as_its_forward_meets_them(runs) -> None:
    """Staleness 1 on a model without ``table_rows``: pulled in its forward, pushed a step
    late, the bound met and every step applied."""
    for server in (r for r in runs[-2] if r["role"] == "server"):
        assert server["max_staleness"] == 1
        assert server["applied"] == dict.fromkeys(range(SERVERS, SERVERS + WORKERS), 6)
    for worker in (r for r in runs[-2] if r["role"] == "worker"):
        assert worker["timeline"] == [
            ("computed", s, t) for s, (_, _, t) in enumerate(worker["timeline"])
        ]
        assert worker["pulled_bytes"] == _row_bytes(UNNAMED, worker["index"])


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="servers must be at least 1"):
        PSConfig(0)
    with pytest.raises(ValueError, match="staleness"):
        PSConfig(2, staleness=-1)
    with pytest.raises(ValueError, match="table_optimizer 'adam'"):
        PSConfig(2, table_optimizer="adam")
    with pytest.raises(ValueError, match="no table for servers"):
        find_tables(nn.Sequential(nn.Linear(2, 2), nn.Embedding(4, 2)))


def _failing_batch(worker: int, step: int) -> tuple:
    if worker == 1 and step == 2:
        raise ValueError("no batch 2")
    return _worker_batch(SMALL, torch.float64, 2, worker, step)


def _failing(timeout_s: float) -> None:
    train(
        functools.partial(_model, SMALL, torch.float64),
        _failing_batch,
        4,
        PSConfig(2, timeout_s=timeout_s),
    )


def test_a_worker_that_fails_stops_the_others_with_its_name() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_failing, SERVERS + WORKERS, 3.0, timeout=120)
    text = str(failure.value)
    assert "no batch 2" in text
    # the servers wait for it in the store; the other worker may be there too, or in a
    # collective with it, which the watchdog ends (docs/failures.md)
    for rank in range(SERVERS):
        assert f"server {rank} (rank {rank}) stopped: worker 1 (rank 3): ValueError" in text


def test_the_dlrm_reference_is_sized_by_rows_tables_and_dim() -> None:
    config = reference_config("dlrm", rows=300, tables=2, dim=6, hidden=16)
    assert (config.num_rows, config.num_tables, config.embedding_dim) == (300, 2, 6)
    model = build(config)
    assert [t.weight.shape for t in model.tables] == [(300, 6), (300, 6)]
    dense, rows, clicks = config.example_batch(8, torch.Generator().manual_seed(0))
    assert rows.shape == (8, 2, config.bag_size) and int(rows.max()) < 300
    model(dense, rows, clicks).backward()
    assert all(t.weight.grad.is_sparse for t in model.tables)
    assert model(dense, rows).shape == (8,)
    with pytest.raises(ValueError, match=r"rows must be \[batch, num_tables\(2\), bag\]"):
        model(dense, rows[:, :1])
    with pytest.raises(ValueError, match=r"num_rows\(0\)"):
        reference_config("dlrm", rows=0)
    with pytest.raises(ValueError, match="pooling 'max'"):
        DLRMConfig(pooling="max")


def _server_stops(rank: int, step: int) -> None:
    """Server ``rank``'s process ends when it comes to a push of ``step``, as a crash would
    end it (no exception, no word in the store)."""
    serve_push = server_module.Server._push

    def push(self, worker: int, at: int) -> None:
        if self.job.rank == rank and at == step:
            os._exit(3)
        serve_push(self, worker, at)

    server_module.Server._push = push
    train(
        functools.partial(_model, SMALL, torch.float64),
        functools.partial(_worker_batch, SMALL, torch.float64, 2),
        6,
        PSConfig(2, timeout_s=300.0),
    )


def test_a_server_that_stops_is_named_and_the_job_ends() -> None:
    """Server 1's process gone at step 2: the workers' exchanges with it fail, naming it,
    and server 0 stops with that name; no rank waits out its timeout."""
    began = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_server_stops, SERVERS + WORKERS, 1, 2, timeout=120)
    text = str(failure.value)
    assert "rank 1: no result; exited with code 3" in text
    for worker in (0, 1):
        assert (
            f"PSError: server 1 (rank 1) stopped answering worker {worker} (rank {worker + 2})"
            in text
        )
    assert "PSError: server 0 (rank 0) stopped: server 1 (rank 1) stopped answering" in text
    # the spawn's start and the errors, far less than the 300 s any wait would be bounded by
    assert time.monotonic() - began < 100


def _uneven_batch(worker: int, step: int) -> tuple:
    return _worker_batch(SMALL, torch.float64, 2 + worker, 0, step)


def _uneven() -> None:
    train(functools.partial(_model, SMALL, torch.float64), _uneven_batch, 2, PSConfig(2))


def test_workers_batches_of_different_sizes_are_refused() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_uneven, SERVERS + WORKERS, timeout=120)
    text = str(failure.value)
    for rank in (2, 3):
        assert f"rank {rank}: raised" in text
    assert "batches of step 0 differ in size (this worker's 2, 5 in all over 2 workers)" in text


def test_the_tables_are_priced_by_the_rows_a_step_touches(capsys) -> None:
    """The expected distinct rows are the DLRM reference's measured mean; replicating a large
    table costs its whole gradient; ``autoshard plan --model dlrm`` names the fastest way."""
    from autoshard.cli.main import main
    from autoshard.cost import cluster_spec
    from autoshard.cost.tables import TableShape, expected_unique_rows, price_tables

    config = reference_config("dlrm", rows=1000, tables=1)
    counts = [
        len(config.example_batch(64, torch.Generator().manual_seed(s))[1].unique())
        for s in range(400)
    ]
    expected = expected_unique_rows(1000, 64 * config.bag_size)
    assert abs(sum(counts) / len(counts) - expected) < 0.01 * expected, (counts, expected)
    assert expected_unique_rows(10, 10_000) == pytest.approx(10.0)
    shape = TableShape(3, 100_000, 16, 4, 256)
    ways = {p.way: p for p in price_tables(shape, 4, cluster_spec("cpu", 4))}
    assert ways["replicated on 4"].bytes_per_rank == 2 * 3 * 100_000 * 64 * 3 / 4
    touched = 3 * expected_unique_rows(100_000, 128 * 4)  # a worker's half of the batch
    assert ways["2 servers + 2 workers"].bytes_per_rank == pytest.approx(2 * touched * 64)
    assert ways["replicated on 4"].step_s > 10 * ways["2 servers + 2 workers"].step_s
    main(["plan", "--model", "dlrm", "--rows", "100000", "--devices", "4", "--batch", "256"])
    out = capsys.readouterr().out
    fastest = min(ways.values(), key=lambda p: p.step_s).way
    assert f"fastest for the tables: {fastest} (" in out
    assert "| replicated on 4 | 28,800,000 |" in out
    with pytest.raises(ValueError, match=r"servers\(4\) must leave a worker of 4 devices"):
        price_tables(shape, 4, cluster_spec("cpu", 4), servers=4)
