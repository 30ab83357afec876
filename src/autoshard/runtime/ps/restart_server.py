"""A server of a job whose workers may be killed and come back (``PSConfig(restarts=n)``).

A worker's push of a step counts only once the worker has committed it: it sends its rows'
gradients to every server, each server says it holds them, and then the worker adds one to
its count of committed steps in the store, one write, so that a step's push is either in the
store's count, and applied by every server, or in no server's table. A server holds the
pushes of a step until every worker has committed the step, then applies their sum (the
synchronous job's one optimizer step). When a worker's process dies, its server sees its
group's connection close (or the new process join first) and drops what it held of steps the
dead process had not committed; the new process resumes at its first uncommitted step, so a
step is redone whole and no update is applied twice.

Server 0 holds the dense part too, one flat vector under AdamW, so a worker keeps nothing of
its own: each step it pulls the dense part and pushes its gradient, with its loss, to server 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard import watch
from autoshard.runtime.ps.job import Job, WorkerLost
from autoshard.runtime.ps.server import Server

__all__ = ["RestartServer", "committed_steps", "dense_parameters"]


def dense_parameters(model: nn.Module, tables: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
    """The model's trainable parameters that are not tables, by name, in the model's order:
    the order the dense part's flat vector keeps."""
    held = {id(t.weight) for t in tables.values()}
    return {
        name: p for name, p in model.named_parameters() if p.requires_grad and id(p) not in held
    }


def committed_steps(job: Job, worker: int) -> int:
    """How many steps ``worker`` has committed (its pushes held by every server)."""
    return int(job.store.add(job.key("committed", worker), 0))


class RestartServer(Server):
    """A :class:`Server` whose workers may restart: pushes held until committed, requests of
    a dead worker's process passed over, each new process's pair group made as it joins."""

    def __init__(
        self, job: Job, tables: dict[str, torch.Tensor], dense: dict[str, nn.Parameter]
    ) -> None:
        super().__init__(job, tables)
        self.generation = dict.fromkeys(job.workers, 0)  # each worker's live process
        self.lost: set[int] = set()  # workers whose live process has died
        self.held: dict[int, dict[int, dict]] = {}  # step -> worker -> its push
        self.committed: set[tuple[int, int]] = set()
        self.rejoined: list[tuple[int, int, int]] = []  # (worker, generation, committed)
        self.losses: list[float] = []
        self.dense_names = {name: p.shape for name, p in dense.items()} if self.owns_dense else {}
        if self.owns_dense:
            flat = torch.cat([p.detach().reshape(-1) for p in dense.values()]).to(job.device)
            self.dense = nn.Parameter(flat)
            self.dense_optimizer = torch.optim.AdamW([self.dense], lr=job.config.dense_lr)

    @property
    def owns_dense(self) -> bool:
        return self.job.rank == self.job.servers[0]

    def handle(self, generation: int, kind: str, worker: int, step: int, rest: list[str]) -> None:
        if kind == "join":
            self._join(worker, generation)
            return
        if generation != self.generation[worker] or worker in self.lost:
            return  # a request of a process that has died: its successor redoes the step
        try:
            if kind == "dense":
                with self.job.talking_to(worker, f"dense pull of step {step}"):
                    self.job.cast(self.dense.detach().clone(), self.job.rank, worker)
            elif kind == "push":
                self._hold(worker, step)
            elif kind == "commit":
                self.committed.add((worker, step))
                self._apply_ready()
            else:
                super().handle(generation, kind, worker, step, rest)
        except WorkerLost:
            self._lose(worker)

    def _join(self, worker: int, generation: int) -> None:
        """A new process of ``worker``: what the old one left uncommitted is dropped, what it
        committed (its last commit perhaps unannounced) is applied when it can be."""
        watch.doing(f"worker rank {worker}'s process {generation} joining")
        self._lose(worker)
        self.job.pair(worker, generation)
        self.generation[worker] = generation
        self.lost.discard(worker)
        self.rejoined.append((worker, generation, committed_steps(self.job, worker)))

    def _lose(self, worker: int) -> None:
        """``worker``'s process is gone: keep its pushes of the steps it committed (the
        store's count is final, the process being dead), drop the rest."""
        self.lost.add(worker)
        self.pulled[worker].clear()
        done = committed_steps(self.job, worker)
        for step, pushes in self.held.items():
            if worker in pushes and step >= done:
                del pushes[worker]
            elif worker in pushes:
                self.committed.add((worker, step))
        self._apply_ready()

    def _hold(self, worker: int, step: int) -> None:
        push = {"rows": self._receive(worker, step)}
        job = self.job
        with job.talking_to(worker, f"push of step {step}"):
            if self.owns_dense:
                numel = self.dense.numel() + 1  # the gradient and the worker's loss
                dtype = self.dense.dtype
                push["dense"] = job.cast(
                    torch.empty(numel, dtype=dtype, device=job.device), worker, worker
                )
            # that it holds them: the worker commits the step only after every server said so
            job.cast(torch.ones(1, device=job.device), job.rank, worker)
        self.held.setdefault(step, {})[worker] = push

    def _apply_ready(self) -> None:
        """Apply each next step every worker has committed, in order."""
        workers = self.job.workers
        while True:
            step = min(self.applied.values())
            pushes = self.held.get(step, {})
            if not all(w in pushes and (w, step) in self.committed for w in workers):
                return
            del self.held[step]
            self._apply([pushes[w]["rows"] for w in workers])
            if self.owns_dense:
                self._apply_dense(step, [pushes[w]["dense"] for w in workers])
            self._applied(workers, step)

    def _apply_dense(self, step: int, pushes: list[torch.Tensor]) -> None:
        total = torch.stack(pushes).sum(0)
        self.dense.grad = total[:-1].clone()
        self.dense_optimizer.step()
        self.dense.grad = None
        self.losses.append(float(total[-1]))
        # before the step's applied keys, which workers wait for before they read it
        self.job.store.set(self.job.key("loss", step), repr(self.losses[-1]))

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["rejoined"] = list(self.rejoined)
        if self.owns_dense:
            out["losses"] = list(self.losses)
            out["dense"], offset = {}, 0
            flat = self.dense.detach()
            for name, shape in self.dense_names.items():
                numel = shape.numel()
                out["dense"][name] = flat[offset : offset + numel].view(shape).clone()
                offset += numel
        return out
