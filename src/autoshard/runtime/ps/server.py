"""A server: the rows of each table it holds, the optimizer it applies to them, and the loop
that answers its queue of requests one at a time, in the order they were posted.

A worker posts a request and then waits in the pair's group for the server, so the server
only ever enters a collective whose other member is there or on its way: the pairs' groups
never wait on each other, whatever order the requests come in (NCCL's rule for groups holds).

Its version counters count, per worker, the steps whose rows it has applied. Synchronous,
it sums the workers' rows of a step and applies them at once when the last has come; with a
staleness bound, it applies each worker's rows as they come. A pull for step t sees every
worker's first ``min(applied)`` steps, so its staleness is ``t - min(applied)``, checked
against the bound on every pull.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from autoshard import watch
from autoshard.runtime.ps.job import Job, PSError, row_ranges

__all__ = ["Server", "table_optimizer"]


def table_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """``torch.optim``'s sparse-aware optimizer ``name`` over ``params``."""
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


class Server:
    """The rows ``[lo, hi)`` of every table this rank holds (``tables``: name -> full
    weight, read once), and the loop that serves the workers."""

    def __init__(self, job: Job, tables: dict[str, torch.Tensor]) -> None:
        self.job = job
        index = job.servers.index(job.rank)
        self.ranges: dict[str, tuple[int, int]] = {}
        self.shards: dict[str, torch.Tensor] = {}
        for name, weight in tables.items():
            lo, hi = row_ranges(weight.shape[0], len(job.servers))[index]
            self.ranges[name] = (lo, hi)
            self.shards[name] = weight.detach()[lo:hi].to(job.device).clone().requires_grad_()
            job.store.set(job.key("rows", name, job.rank), f"{lo} {hi}")
        self.optimizer = table_optimizer(
            job.config.table_optimizer, list(self.shards.values()), job.config.table_lr
        )
        self.applied = dict.fromkeys(job.workers, 0)  # the version counters
        # per worker and step, the rows of each table it was sent, in the order sent
        self.pulled: dict[int, dict[int, dict[str, torch.Tensor]]] = {w: {} for w in job.workers}
        self.waiting: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {}
        self.max_staleness = 0
        self.rows_in = 0  # rows received and sent, counted where they cross
        self.rows_out = 0
        self.timeline: list[tuple[int, int, float]] = []  # (worker, step, when rows were sent)
        self.done: set[int] = set()  # the workers that have said they are done

    def start(self, step: int) -> None:
        """Begin at ``step``: every worker's steps before it applied (a resumed job)."""
        self.applied = dict.fromkeys(self.job.workers, step)

    def serve(self) -> dict[str, Any]:
        """Answer requests until every worker is done; returns the rows held and counts."""
        job, number = self.job, 0
        while len(self.done) < len(job.workers):
            number += 1
            watch.doing(f"waiting for request {number}")
            message = job.get(job.key("queue", job.rank, number), "a request", job.workers)
            generation, kind, worker, step, *rest = message.split()
            self.handle(int(generation), kind, int(worker), int(step), rest)
        return self.result()

    def handle(self, generation: int, kind: str, worker: int, step: int, rest: list[str]) -> None:
        """Answer one request of ``worker``'s process ``generation``."""
        if kind == "pull":
            self._pull(worker, step, rest[0], int(rest[1]))
        elif kind == "push":
            self._push(worker, step)
        else:
            self.done.add(worker)

    def result(self) -> dict[str, Any]:
        return {
            "rank": self.job.rank,
            "ranges": dict(self.ranges),
            "shards": {name: shard.detach().clone() for name, shard in self.shards.items()},
            "applied": dict(self.applied),
            "max_staleness": self.max_staleness,
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "timeline": self.timeline,
        }

    def _pull(self, worker: int, step: int, table: str, count: int) -> None:
        staleness = step - min(self.applied.values())
        if staleness > self.job.config.bound:
            raise PSError(
                f"{self.job.name(self.job.rank)}: {self.job.name(worker)} pulled step {step} "
                f"with staleness {staleness} > bound {self.job.config.bound}"
            )
        self.max_staleness = max(self.max_staleness, staleness)
        if count == 0:
            return
        with self.job.talking_to(worker, f"pull of step {step}"):
            rows = torch.empty(count, dtype=torch.int64, device=self.job.device)
            self.job.cast(rows, worker, worker)
            self.job.cast(self.shards[table].detach()[rows].contiguous(), self.job.rank, worker)
        self.pulled[worker].setdefault(step, {})[table] = rows
        self.timeline.append((worker, step, time.time()))
        self.rows_out += count

    def _receive(self, worker: int, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The gradients of the rows ``worker`` was sent for ``step``, by table."""
        grads = {}
        for table, rows in self.pulled[worker].pop(step, {}).items():
            shard = self.shards[table]
            grad = torch.empty(len(rows), shard.shape[1], dtype=shard.dtype, device=shard.device)
            with self.job.talking_to(worker, f"push of step {step}"):
                grads[table] = (rows, self.job.cast(grad, worker, worker))
            self.rows_in += len(rows)
        return grads

    def _push(self, worker: int, step: int) -> None:
        grads = self._receive(worker, step)
        if self.job.config.staleness is not None:
            self._apply([grads])
            self._applied([worker], step)
            return
        self.waiting.setdefault(step, []).append(grads)
        if len(self.waiting[step]) == len(self.job.workers):
            self._apply(self.waiting.pop(step))
            self._applied(self.job.workers, step)

    def _apply(self, pushes: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """One optimizer step on the sum of ``pushes``' rows, as ``torch.optim`` applies a
        sparse gradient."""
        watch.doing("applying the rows' optimizer step")
        for table, shard in self.shards.items():
            parts = [push[table] for push in pushes if table in push]
            if not parts:
                shard.grad = None
                continue
            rows = torch.cat([r for r, _ in parts])
            values = torch.cat([g for _, g in parts])
            shard.grad = torch.sparse_coo_tensor(
                rows[None], values, shard.shape, check_invariants=False
            )
        self.optimizer.step()
        for shard in self.shards.values():
            shard.grad = None

    def _applied(self, workers: list[int], step: int) -> None:
        for worker in workers:
            self.applied[worker] += 1
            assert self.applied[worker] == step + 1, (self.applied, step)
            self.job.store.set(self.job.key("applied", self.job.rank, worker, step), "1")
