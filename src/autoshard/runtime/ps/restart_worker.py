"""A worker of a job whose workers may be killed and come back (``PSConfig(restarts=n)``).

The worker's rank runs it in a process of its own and starts that process again when a signal
kills it, up to ``restarts`` times. Each process is a new generation of the worker: it counts
itself in the store, joins every server (a pair group made under the generation's prefix),
and resumes at the first step it has not committed, pulling the dense part and the rows it
needs from the servers; it holds nothing else. Each step's pushes go to one server after the
other, each server saying it holds them, and then the step is committed by one write in the
store (see ``restart_server``)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from torch import nn

from autoshard import watch
from autoshard.runtime.ps.job import Job, PSConfig, PSError, join_store, tcp_store
from autoshard.runtime.ps.pull import Pull, request
from autoshard.runtime.ps.restart_server import committed_steps, dense_parameters
from autoshard.runtime.ps.worker import RemoteTable, find_tables, row_grads

__all__ = ["RestartWorker", "supervise"]


class RestartWorker:
    """One process (generation) of a worker: the model without its tables and dense state,
    both pulled from the servers each step."""

    def __init__(self, job: Job, model: nn.Module) -> None:
        tables = find_tables(model)
        self.job, self.index = job, job.workers.index(job.rank)
        self.dense = list(dense_parameters(model, tables).values())
        self.remote = {path: RemoteTable(path, table, self) for path, table in tables.items()}
        for path, remote in self.remote.items():
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, remote)
        self.model = model.to(job.device)
        job.generation = int(job.store.add(job.key("generation", job.rank), 1))
        for s in job.servers:
            job.post(s, f"join {job.rank} 0")
            job.pair(s, job.generation)
        self.ranges = {path: self._ranges(path) for path in tables}
        self.first = self.step_number = committed_steps(job, job.rank)
        self.pulled_bytes: list[int] = []
        self.pulling = 0

    def _ranges(self, path: str) -> list[tuple[int, int]]:
        job, ranges = self.job, []
        for s in job.servers:
            text = job.get(job.key("rows", path, s), f"the rows of {path!r} it holds", [s])
            lo, hi = text.split()
            ranges.append((int(lo), int(hi)))
        return ranges

    def pull(self, path: str, unique: torch.Tensor) -> Pull:
        remote = self.remote[path]
        pull = request(
            self.job, path, self.step_number, unique, self.ranges[path], remote.dim, remote.dtype
        )
        self.pulling += pull.nbytes
        return pull

    def loss_of(self, step: int) -> float:
        """Step ``step``'s loss over every worker, once the servers have applied it."""
        job = self.job
        keys = [job.key("applied", s, w, step) for s in job.servers for w in job.workers]
        watch.doing(f"waiting for the servers to apply step {step}")
        owners = [s for s in job.servers for _ in job.workers]
        job.wait(keys, f"step {step} applied", job.servers, owners)
        return float(job.store.get(job.key("loss", step)).decode())

    def step(self, batch: tuple[Any, ...]) -> None:
        """Step ``step_number``: pull the dense part and the rows, compute, push, commit."""
        job, server = self.job, self.job.servers[0]
        watch.step(self.step_number)
        job.post(server, f"dense {job.rank} {self.step_number}")
        flat = torch.cat([p.detach().reshape(-1) for p in self.dense])
        with job.talking_to(server, f"dense pull of step {self.step_number}"):
            job.cast(flat, server, server)
        torch.nn.utils.vector_to_parameters(flat, self.dense)
        for p in self.dense:
            p.grad = None
        loss = self.model(*(x.to(job.device) if isinstance(x, torch.Tensor) else x for x in batch))
        (loss / len(job.workers)).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.dense]
        # the loss goes with the gradient, divided alike: their sums are the whole batch's
        share = loss.detach().reshape(1) / len(job.workers)
        self._push(row_grads(self), torch.cat([g.reshape(-1) for g in grads] + [share]))
        job.store.add(job.key("committed", job.rank), 1)  # the step's one commit
        for s in job.servers:
            job.post(s, f"commit {job.rank} {self.step_number}")
        self.step_number += 1

    def _push(self, grads: dict[int, list[torch.Tensor]], dense: torch.Tensor) -> None:
        """To one server after the other, each answering that it holds them before the next:
        a server never waits in a pair for a worker that waits on another server."""
        job, step = self.job, self.step_number
        for s in job.servers:
            job.post(s, f"push {job.rank} {step}")
            with job.talking_to(s, f"push of step {step}"):
                for grad in grads[s] + ([dense] if s == job.servers[0] else []):
                    job.cast(grad, job.rank, s)
                job.cast(torch.empty(1, device=job.device), s, s)

    def finish(self) -> None:
        for s in self.job.servers:
            self.job.post(s, f"done {self.job.rank} {self.step_number}")


def _run(
    worker: RestartWorker,
    batches: Callable[[int, int], tuple[Any, ...]],
    steps: int,
    report: Connection,
) -> None:
    """Train from the worker's first uncommitted step, reporting each step's loss over every
    worker as the servers apply it (the step before's, read before each step)."""
    report.send(("start", worker.first))
    for step in range(worker.first, steps):
        if step > 0:
            report.send(("loss", step - 1, worker.loss_of(step - 1)))
        watch.doing(f"reading batch {step}")
        worker.step(batches(worker.index, step))
    if steps > 0:
        report.send(("loss", steps - 1, worker.loss_of(steps - 1)))
    worker.finish()
    report.send(("done", worker.pulled_bytes))


def _process_main(
    report: Connection,
    address: tuple[str, int, str, int, int, int],
    config: PSConfig,
    model_fn: Callable[[], nn.Module],
    batches: Callable[[int, int], tuple[Any, ...]],
    steps: int,
) -> None:
    """A worker's process: joins the store, trains, reports; ends without running the
    groups' destructors (a peer's closed group may abort in them)."""
    host, port, prefix, rank, world, threads = address
    torch.set_num_threads(threads)
    job = None
    try:
        join_store(host, port, config.timeout_s)
        job = Job(config, joined=(rank, world, prefix))
        _run(RestartWorker(job, model_fn()), batches, steps, report)
    except BaseException as error:
        if job is not None and not isinstance(error, PSError):
            job.fail(error)
        report.send(("error", f"{error!r}", traceback.format_exc()))
    report.close()
    os._exit(0)


def supervise(
    job: Job,
    model_fn: Callable[[], nn.Module],
    batches: Callable[[int, int], tuple[Any, ...]],
    steps: int,
    on_step: Callable[[int, float], None] | None,
) -> dict[str, Any]:
    """On a worker's rank: run the worker in a process of its own, started again each time
    a signal kills it, up to ``restarts`` times. Returns the worker's result."""
    try:
        pickle.dumps((model_fn, batches))
    except Exception as error:
        raise ValueError(
            "with restarts, a worker runs in a process of its own, so model_fn and batches "
            f"must pickle (module-level functions or functools.partial of them): {error}"
        ) from error
    base, world = tcp_store(), len(job.servers) + len(job.workers)
    address = (base.host, base.port, job.prefix, job.rank, world, torch.get_num_threads())
    context = multiprocessing.get_context("spawn")
    losses: dict[int, float] = {}
    starts: list[int] = []
    for _ in range(job.config.restarts + 1):
        mine, theirs = context.Pipe(duplex=False)
        args = (theirs, address, job.config, model_fn, batches, steps)
        process = context.Process(target=_process_main, args=args, daemon=True)
        process.start()
        theirs.close()
        ended = _follow(mine, process, losses, starts, on_step)
        process.join()
        if ended is not None and ended[0] == "done":
            return {
                "role": "worker",
                "index": job.workers.index(job.rank),
                "losses": [losses[s] for s in sorted(losses)],
                "starts": starts,
                "pulled_bytes": ended[1],
            }
        if ended is not None:
            raise PSError(f"{job.name(job.rank)}: {ended[1]}\n{ended[2]}")
        if process.exitcode is None or process.exitcode >= 0:
            break  # ended by itself without a word: not a kill to come back from
    text = (
        f"{job.name(job.rank)}'s process ended with exit code {process.exitcode} after "
        f"{len(starts)} start(s) ({job.config.restarts} restart(s) allowed, each only after "
        "a signal)"
    )
    job.fail(PSError(text))
    raise PSError(text)


def _follow(
    mine: Connection,
    process: multiprocessing.process.BaseProcess,
    losses: dict[int, float],
    starts: list[int],
    on_step: Callable[[int, float], None] | None,
) -> tuple | None:
    """Read a worker process's reports until its last; None if it ended without one."""
    while True:
        wait([mine, process.sentinel])
        try:
            message = mine.recv()
        except EOFError:
            return None
        if message[0] == "start":
            starts.append(message[1])
            continue
        if message[0] != "loss":
            return message
        if message[1] not in losses and on_step is not None:
            on_step(message[1], message[2])
        losses[message[1]] = message[2]
