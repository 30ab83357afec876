"""Parameter servers whose workers restart: a worker's process killed with SIGKILL at a
seeded random point of a seeded random step comes back, resumes at its first uncommitted
step, and the job ends as one device's training of every step (synchronous), so no update
the servers acknowledged is lost and none is applied twice."""

from __future__ import annotations

import functools
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_ps import SERVERS, SMALL, WORKERS, _model, _one_device, _worker_batch

from autoshard import comm
from autoshard.runtime.ps import PSConfig, find_tables, row_ranges, train
from autoshard.runtime.ps import job as job_module
from autoshard.testing import RankFailure, run_ranks

STEPS = 6
PER_WORKER = 4


def _kill_on(call: int) -> None:
    """SIGKILL this process at its ``call``-th exchange from now: a broadcast in a pair's
    group or a request posted to a server (the step's commit announcements among them)."""
    count = [0]

    def counted(original):
        def run(*args, **kwargs):
            count[0] += 1
            if count[0] == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return run

    comm.OwnGroup.broadcast_async_ = counted(comm.OwnGroup.broadcast_async_)
    job_module.Job.post = counted(job_module.Job.post)


def _batches(case: dict[str, Any], worker: int, step: int) -> tuple:
    """The worker's batch; the victim's process kills itself during its kill step, once (a
    marker file says it has)."""
    victim, at_step, at_call = case["kill"]
    marker = Path(case["marker"])
    if worker == victim and step == at_step and not marker.exists():
        marker.write_text(str(os.getpid()))
        _kill_on(at_call)
    return _worker_batch(SMALL, case["dtype"], case["per_worker"], worker, step)


def _case(case: dict[str, Any]) -> dict[str, Any]:
    return train(
        functools.partial(_model, SMALL, case["dtype"]),
        functools.partial(_batches, case),
        case["steps"],
        case["ps"],
    )


def _cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_case(case) for case in cases]


def _kill(seed: int) -> tuple[int, int, int]:
    """(worker, step, exchange of that step) to kill at, drawn from ``seed``, the exchange
    among the step's (:func:`_exchanges`)."""
    draw = random.Random(seed)
    worker, step = draw.randrange(WORKERS), draw.randrange(1, STEPS - 1)
    return worker, step, draw.randrange(1, _exchanges(worker, step)[1] + 1)


def _exchanges(worker: int, step: int) -> tuple[int, int]:
    """The number of the exchange that announces the step's commit (the first after it is
    committed in the store), and the step's count of exchanges, as the worker makes them:
    the dense part's request and broadcast; per table and server a request, and the ids and
    rows if the server holds some; per server a push request, a gradient per table it sent
    rows of, the dense gradient (server 0), its answer; a commit announcement per server."""
    _, rows, _ = _worker_batch(SMALL, torch.float64, PER_WORKER, worker, step)
    ranges = row_ranges(SMALL.num_rows, SERVERS)
    held = [
        [bool(((rows[:, t] >= lo) & (rows[:, t] < hi)).any()) for lo, hi in ranges]
        for t in range(SMALL.num_tables)
    ]
    pulls = sum(1 + 2 * h for table in held for h in table)
    pushes = sum(2 + sum(table[s] for table in held) + (s == 0) for s in range(SERVERS))
    before = 2 + pulls + pushes
    return before + 1, before + SERVERS


CASES = [
    {
        "model": SMALL,
        "dtype": torch.float64,
        "per_worker": PER_WORKER,
        "steps": STEPS,
        "ps": PSConfig(SERVERS, restarts=1, timeout_s=120),
        "kill": _kill(seed),
    }
    # a kill in a pull; in the push to server 1, server 0 holding the step's push; at the
    # first commit announcement, the step committed in the store and no server told
    for seed in (2, 66, 45)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[list[dict[str, Any]]]:
    for i, case in enumerate(CASES):
        case["marker"] = str(tmp_path_factory.mktemp("restart") / f"killed-{i}")
    per_rank = run_ranks(_cases, SERVERS + WORKERS, CASES, timeout=600)
    return [[rank[i] for rank in per_rank] for i in range(len(CASES))]


@pytest.mark.parametrize("which", range(len(CASES)), ids=["pull", "push", "commit"])
def test_a_killed_worker_rejoins_and_the_job_equals_one_device(runs, which: int) -> None:
    case, results = CASES[which], runs[which]
    victim, at_step, at_call = case["kill"]
    assert Path(case["marker"]).exists()  # the victim's process was killed
    servers = [r for r in results if r["role"] == "server"]
    workers = {r["index"]: r for r in results if r["role"] == "worker"}
    # it came back at the step it was killed in, or at the next once that was committed
    announced, count = _exchanges(victim, at_step)
    assert at_call <= count
    expected = at_step + (at_call >= announced)
    assert workers[victim]["starts"] == [0, expected], (workers[victim]["starts"], announced)
    assert workers[1 - victim]["starts"] == [0]
    for server in servers:
        # each worker's first process joined, then the victim's second
        joined = [(w, 1) for w in range(SERVERS, SERVERS + WORKERS)] + [(SERVERS + victim, 2)]
        assert sorted((w, g) for w, g, _ in server["rejoined"]) == sorted(joined)
        assert server["applied"] == dict.fromkeys(range(SERVERS, SERVERS + WORKERS), STEPS)
    losses, model = _one_device(case)
    torch.testing.assert_close(servers[0]["losses"], losses)
    for worker in workers.values():
        torch.testing.assert_close(worker["losses"], losses)
    dense = {k: v for k, v in model.named_parameters() if not k.startswith("tables.")}
    assert servers[0]["dense"].keys() == dense.keys()
    for name, value in dense.items():
        torch.testing.assert_close(servers[0]["dense"][name], value.detach(), msg=name)
    for path, table in find_tables(model).items():
        held = [s["ranges"][path] for s in servers]
        assert held == row_ranges(table.weight.shape[0], SERVERS)
        for server, (lo, hi) in zip(servers, held, strict=True):
            torch.testing.assert_close(server["shards"][path], table.weight.detach()[lo:hi])


def test_restarts_need_a_synchronous_job_and_no_checkpoint() -> None:
    with pytest.raises(ValueError, match="restarts=1 needs a synchronous job"):
        PSConfig(2, staleness=1, restarts=1)
    with pytest.raises(ValueError, match="restarts must be a count"):
        PSConfig(2, restarts=-1)
    with pytest.raises(ValueError, match="saves and resumes no checkpoint"):
        train(lambda: None, lambda w, s: (), 1, PSConfig(2, restarts=1), save_to="x")


def _always_killed(worker: int, step: int) -> tuple:
    """Worker 1's every process kills itself at step 2."""
    if worker == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _worker_batch(SMALL, torch.float64, PER_WORKER, worker, step)


def _killed_twice() -> dict[str, Any]:
    return train(
        functools.partial(_model, SMALL, torch.float64),
        _always_killed,
        STEPS,
        PSConfig(SERVERS, restarts=1, timeout_s=400),
    )


def test_a_worker_killed_more_times_than_allowed_ends_the_job_with_its_name() -> None:
    """Killed at step 2 in its first process and its second: its rank stops, naming it,
    and the servers stop with that name, long before any timeout."""
    began = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_killed_twice, SERVERS + WORKERS, timeout=600)
    text = str(failure.value)
    name = "worker 1 (rank 3)"
    assert f"{name}'s process ended with exit code -9 after 2 start(s)" in text, text
    for rank in range(SERVERS):
        assert f"server {rank} (rank {rank}) stopped: {name}" in text, text
    # worker 0 stops too, naming it, but through its own process and a pipe: it may come
    # after the half second the launcher waits for the others once a rank has failed
    assert time.monotonic() - began < 300  # the job's timeouts are 400 s
