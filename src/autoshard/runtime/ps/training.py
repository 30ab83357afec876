"""``train``: every rank of the job runs it and takes its role, server or worker."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from autoshard import watch
from autoshard.mesh import ensure_process_group
from autoshard.runtime.ps.checkpoint import TableShards, load_job, save_job
from autoshard.runtime.ps.job import Job, PSConfig, PSError
from autoshard.runtime.ps.restart_server import RestartServer, dense_parameters
from autoshard.runtime.ps.restart_worker import supervise
from autoshard.runtime.ps.server import Server
from autoshard.runtime.ps.worker import Worker, find_tables

__all__ = ["split_batches", "train"]


def train(
    model_fn: Callable[[], nn.Module],
    batches: Callable[[int, int], tuple[Any, ...]],
    steps: int,
    config: PSConfig,
    on_step: Callable[[int, float], None] | None = None,
    *,
    save_to: str | os.PathLike | None = None,
    resume_from: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Train ``model_fn()``'s model to step ``steps`` with its tables on ``config.servers``
    servers; every rank calls it. ``model_fn`` must build the same model on every rank (the
    servers read their rows from it, the workers its dense part); ``batches(worker, step)`` is
    worker ``worker``'s batch of that step (the model returns its mean loss on it; every
    worker's batch of a step has the same size, so their mean is the loss of their union).
    ``on_step(step, loss)`` is called on every worker after each step with the loss over all
    workers. ``resume_from``: a job's checkpoint to start from (its step, rows, dense part and
    optimizers' state; saved by any number of servers); ``save_to``: where the job's
    checkpoint goes once the last step is applied.

    A server returns the rows it holds (``ranges``, ``shards``), its version counters
    (``applied``), the largest staleness a pull saw, the rows it sent and received and when
    it sent each step's rows (``timeline``); a worker returns the losses over all workers of
    the steps it trained, its dense ``state``, the bytes of rows it pulled and pushed each
    step, and when it requested rows and computed each step (``timeline``).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if config.restarts and (save_to is not None or resume_from is not None):
        raise ValueError("a job whose workers restart saves and resumes no checkpoint yet")
    ensure_process_group(config.timeout_s)  # under torchrun, joins its group
    job = Job(config)
    model = model_fn()
    tables = find_tables(model)
    try:
        job.connect()
        if config.restarts and job.is_server:
            weights = {path: table.weight for path, table in tables.items()}
            server = RestartServer(job, weights, dense_parameters(model, tables))
            return {"role": "server", **server.serve()}
        if config.restarts:
            return supervise(job, model_fn, batches, steps, on_step)
        if job.is_server:
            return _serve(job, tables, steps, save_to, resume_from)
        return _work(job, model, tables, batches, steps, on_step, save_to, resume_from)
    except PSError:
        raise  # another role's failure, already in the store
    except BaseException as error:
        job.fail(error)
        raise


def _serve(
    job: Job,
    tables: dict[str, nn.Module],
    steps: int,
    save_to: str | os.PathLike | None,
    resume_from: str | os.PathLike | None,
) -> dict[str, Any]:
    server = Server(job, {path: table.weight for path, table in tables.items()})
    held = TableShards(
        server.shards, server.ranges, {p: t.weight.shape[0] for p, t in tables.items()}
    )
    if resume_from is not None:
        server.start(load_job(resume_from, held, server.optimizer, is_server=True))
    result = server.serve()
    if save_to is not None:
        save_job(save_to, held, server.optimizer, steps, is_server=True)
    return {"role": "server", **result}


def _work(
    job: Job,
    model: nn.Module,
    tables: dict[str, nn.Module],
    batches: Callable[[int, int], tuple[Any, ...]],
    steps: int,
    on_step: Callable[[int, float], None] | None,
    save_to: str | os.PathLike | None,
    resume_from: str | os.PathLike | None,
) -> dict[str, Any]:
    worker = Worker(job, model, tables)
    if resume_from is not None:
        worker.start(load_job(resume_from, worker.model, worker.optimizer, is_server=False))
    first = worker.step_number
    losses, upcoming = [], None
    for step in range(first, steps):
        watch.doing(f"reading batch {step}")
        batch = upcoming if step > first else batches(worker.index, step)
        upcoming = batches(worker.index, step + 1) if step + 1 < steps else None
        losses.append(worker.step(batch, upcoming))
        if on_step is not None:
            on_step(step, losses[-1])
    worker.finish()
    if save_to is not None:
        save_job(save_to, worker.model, worker.optimizer, steps, is_server=False)
    return {
        "role": "worker",
        "index": worker.index,
        "losses": losses,
        "state": {name: value.detach().clone() for name, value in model.state_dict().items()},
        "pulled_bytes": worker.pulled_bytes,
        "pushed_bytes": worker.pushed_bytes,
        "timeline": worker.timeline,
    }


def split_batches(
    data: Any, batch_size: int, num_workers: int
) -> Callable[[int, int], tuple[Any, ...]]:
    """``batches(worker, step)`` for :func:`train` from a map-style dataset (step t's global
    batch: samples ``t * batch_size`` on, from the start again past its end) or from one
    batch (a tuple of tensors, every step's): each worker takes its ``batch_size //
    num_workers`` samples of it, in worker order."""
    if batch_size % num_workers:
        raise ValueError(
            f"a global batch of {batch_size} samples does not split over {num_workers} workers"
        )
    per = batch_size // num_workers
    whole = isinstance(data, tuple | list) and all(isinstance(t, torch.Tensor) for t in data)

    def batches(worker: int, step: int) -> tuple[Any, ...]:
        if whole:
            return tuple(t[worker * per : (worker + 1) * per] for t in data)
        first = step * batch_size + worker * per
        samples = [data[(first + i) % len(data)] for i in range(per)]
        batch = default_collate(samples)
        return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)

    return batches
