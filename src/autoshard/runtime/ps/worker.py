"""A worker: the model with each table replaced by :class:`RemoteTable`, which pulls the unique
rows its input names from the servers that hold them, and a step that pushes those rows'
gradients back once, deduplicated, and sums the dense gradients over the workers (data
parallelism, AdamW on every replica).

With a staleness bound of 1 or more and a model that names the rows its forward will give
each table (a method ``table_rows(*batch)`` returning ``{table path: row ids}``), the next
batch's rows are requested before the current step's forward and arrive while it computes;
its pushes then go at the end of its step, after the next step's requests."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoshard import comm, watch
from autoshard.runtime.ps.job import Job
from autoshard.runtime.ps.pull import Pull, request

__all__ = ["RemoteTable", "Worker", "find_tables", "row_grads"]


def find_tables(model: nn.Module) -> dict[str, nn.Module]:
    """The model's tables servers hold: every ``nn.EmbeddingBag`` or ``nn.Embedding`` made
    with ``sparse=True``, by module path."""
    tables = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, nn.EmbeddingBag | nn.Embedding) and module.sparse
    }
    if not tables:
        raise ValueError(
            f"{type(model).__name__} has no table for servers to hold: make its embeddings "
            "nn.EmbeddingBag or nn.Embedding with sparse=True"
        )
    for path, module in tables.items():
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(
                f"table {path!r}: padding_idx and max_norm are not supported on servers "
                f"(padding_idx={module.padding_idx}, max_norm={module.max_norm})"
            )
    return tables


def check_ids(path: str, ids: torch.Tensor, num_rows: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        raise ValueError(
            f"table {path!r}: row ids must be in [0, {num_rows}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


class RemoteTable(nn.Module):
    """Stands where a table was: its forward pulls the unique rows it is given from the
    servers and pools them as the table would; the pulled rows are a leaf whose gradient
    is what the worker pushes."""

    def __init__(self, path: str, table: nn.Module, worker: Worker) -> None:
        super().__init__()
        self.path, self.worker = path, worker
        self.num_rows, self.dim = table.weight.shape
        self.dtype = table.weight.dtype
        self.mode = table.mode if isinstance(table, nn.EmbeddingBag) else None
        self.pulled: tuple[Pull, torch.Tensor] | None = None

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.pulled is not None:
            raise ValueError(f"table {self.path!r} is called twice in one step: pull it once")
        check_ids(self.path, input, self.num_rows)
        unique, local = torch.unique(input, return_inverse=True)
        pull = self.worker.pull(self.path, unique)
        rows = pull.rows(self.worker.job, self.dim, self.dtype).requires_grad_()
        self.pulled = (pull, rows)
        if self.mode is None:
            return F.embedding(local, rows)
        return F.embedding_bag(
            local, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights
        )


class Worker:
    """One worker's model, its dense optimizer, and the rows it exchanges with the servers."""

    def __init__(self, job: Job, model: nn.Module, tables: dict[str, nn.Module]) -> None:
        self.job = job
        self.index = job.workers.index(job.rank)
        self.ranges = {path: self._ranges(path) for path in tables}
        self.remote = {path: RemoteTable(path, table, self) for path, table in tables.items()}
        for path, remote in self.remote.items():
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, remote)
        self.model = model.to(job.device)  # without its tables: those stay on the servers
        self.dense = [p for p in model.parameters() if p.requires_grad]
        self._same_dense()
        self.optimizer = torch.optim.AdamW(self.dense, lr=job.config.dense_lr)
        self.step_number = self.first = 0
        # with a staleness bound of 1 or more, a step's pulls go before the last step's
        # pushes: requested ahead where the model names its rows, else the pushes deferred
        stale = job.config.bound >= 1
        self.rows_of = getattr(model, "table_rows", None) if stale else None
        self.deferred: list | None = [] if stale and self.rows_of is None else None
        self.ready: dict[str, Pull] = {}  # this step's rows, requested ahead
        self.ahead: dict[str, Pull] = {}  # the next step's
        #: (event, step, time.time()): requests made ahead, steps computed
        self.timeline: list[tuple[str, int, float]] = []
        self.pulling = 0  # bytes of rows pulled in the step under way
        self.pulled_bytes: list[int] = []  # per step, counted where the rows cross
        self.pushed_bytes: list[int] = []

    def start(self, step: int) -> None:
        """Begin at ``step`` (a resumed job: the servers hold every step before it)."""
        self.step_number = self.first = step

    def _ranges(self, path: str) -> list[tuple[int, int]]:
        """The rows each server announced it holds."""
        job = self.job
        ranges = []
        for s in job.servers:
            text = job.get(job.key("rows", path, s), f"the rows of {path!r} it holds", [s])
            lo, hi = text.split()
            ranges.append((int(lo), int(hi)))
        return ranges

    def _same_dense(self) -> None:
        """The first worker's dense parameters on every worker: replicas start equal."""
        if self.dense:
            flat = torch.cat([p.detach().reshape(-1) for p in self.dense])
            comm.broadcast_(flat, self.job.workers)
            torch.nn.utils.vector_to_parameters(flat, self.dense)

    def pull(self, path: str, unique: torch.Tensor) -> Pull:
        """The pull of the rows ``unique`` (sorted) of table ``path`` this step: the one
        requested ahead, else one requested now."""
        if self.rows_of is None:
            pull = self._request(path, unique, self.step_number)
        else:
            pull = self.ready.pop(path, None)
            if pull is None or not torch.equal(pull.unique, unique):
                raise ValueError(
                    f"table {path!r} is given other rows in step {self.step_number} than "
                    f"{type(self.model).__name__}.table_rows named for it"
                )
        self.pulling += pull.nbytes
        return pull

    def _request(self, path: str, unique: torch.Tensor, step: int) -> Pull:
        remote = self.remote[path]
        return request(self.job, path, step, unique, self.ranges[path], remote.dim, remote.dtype)

    def _ahead(self, batch: tuple[Any, ...], step: int) -> dict[str, Pull]:
        """Request step ``step``'s rows of every table, as the model names them for
        ``batch``, once the servers hold the versions that step may see."""
        self._wait_for_versions(step)
        named = self.rows_of(*batch)
        unknown = sorted(set(named) - set(self.remote))
        if unknown:
            raise ValueError(
                f"{type(self.model).__name__}.table_rows names {unknown}, not tables on "
                f"servers ({sorted(self.remote)})"
            )
        pulls = {}
        for path, ids in named.items():
            ids = ids.to(self.job.device)
            check_ids(path, ids, self.remote[path].num_rows)
            pulls[path] = self._request(path, torch.unique(ids), step)
        self.timeline.append(("requested", step, time.time()))
        return pulls

    def step(self, batch: tuple[Any, ...], upcoming: tuple[Any, ...] | None = None) -> float:
        """One training step on this worker's batch; returns the loss over every worker's.
        ``upcoming``: the next step's batch, whose rows are requested before this step's
        forward where they can be."""
        job, workers = self.job, self.job.workers
        watch.step(self.step_number)
        if self.rows_of is None:
            self._wait_for_versions(self.step_number)
        else:
            self.ready = self.ahead or self._ahead(batch, self.step_number)
            self.ahead = {}
            if upcoming is not None:  # their broadcasts run while this step computes
                self.ahead = self._ahead(upcoming, self.step_number + 1)
        device = self.job.device
        loss = self.model(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in batch))
        (loss / len(workers)).backward()
        self.timeline.append(("computed", self.step_number, time.time()))
        grads = self._take_grads()
        self._sum_dense()
        if self.deferred is None:
            self._push(self.step_number, grads)
        else:
            # the rows' gradients go one step late: the next step's pulls run without them
            previous, self.deferred = self.deferred, [(self.step_number, grads)]
            for pending in previous:
                self._push(*pending)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = self._mean_loss(loss, batch)
        self.step_number += 1
        job.store.set(job.key("at", job.rank), str(self.step_number))
        return total

    def _mean_loss(self, loss: torch.Tensor, batch: tuple[Any, ...]) -> float:
        """The workers' mean loss, after checking their batches were of one size (the first
        input's first dim): only then is it, and the gradients summed, the whole batch's."""
        first = batch[0] if batch and isinstance(batch[0], torch.Tensor) else None
        size = float(first.shape[0]) if first is not None and first.dim() else 0.0
        values = torch.tensor([size, size * size], dtype=torch.float64, device=loss.device)
        sums = comm.all_reduce(
            torch.cat([values, loss.detach().double().reshape(1)]), self.job.workers
        )
        count = len(self.job.workers)
        if abs(count * float(sums[1]) - float(sums[0]) ** 2) > 0.5:
            raise ValueError(
                f"the workers' batches of step {self.step_number} differ in size (this "
                f"worker's {int(size)}, {int(sums[0])} in all over {count} workers): each "
                "worker's batch of a step must have as many samples"
            )
        return float(sums[2]) / count

    def _wait_for_versions(self, step: int) -> None:
        """Wait until every server has applied every worker's step ``step - k - 1``: the
        pulls of ``step`` then include all but the last k steps (synchronous: k = 0)."""
        oldest = step - self.job.config.bound - 1
        if oldest < self.first:
            return
        job = self.job
        pairs = [(s, w) for s in job.servers for w in job.workers]
        keys = [job.key("applied", s, w, oldest) for s, w in pairs]
        watch.doing(f"waiting for the servers to apply step {oldest}")
        job.wait(keys, f"step {oldest} applied", job.servers, [s for s, _ in pairs])

    def _sum_dense(self) -> None:
        if not self.dense:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.dense]
        flat = comm.all_reduce_(torch.cat([g.reshape(-1) for g in grads]), self.job.workers)
        offset = 0
        for p in self.dense:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def _take_grads(self) -> dict[int, list[torch.Tensor]]:
        """Per server, the gradients of the rows it sent this step, in the order it sent
        them."""
        if self.ready:
            raise ValueError(
                f"{type(self.model).__name__}.table_rows named rows of {sorted(self.ready)} "
                f"in step {self.step_number}, which its forward did not use"
            )
        return row_grads(self)

    def _push(self, step: int, grads: dict[int, list[torch.Tensor]]) -> None:
        """Every server hears of every step, rows or none, so that it can count it."""
        job, pushed = self.job, 0
        for s in job.servers:
            job.post(s, f"push {job.rank} {step}")
            for grad in grads[s]:
                with job.talking_to(s, f"push of step {step}"):
                    job.cast(grad, job.rank, s)
                pushed += grad.numel() * grad.element_size()
        self.pushed_bytes.append(pushed)

    def finish(self) -> None:
        """Push what is left and tell every server this worker is done."""
        for pending in self.deferred or []:
            self._push(*pending)
        for s in self.job.servers:
            self.job.post(s, f"done {self.job.rank} {self.step_number}")


def row_grads(worker: Any) -> dict[int, list[torch.Tensor]]:
    """Per server, the gradients of the rows it sent ``worker`` (a worker of either kind)
    this step, in the order it sent them; the step's pulled bytes recorded."""
    grads: dict[int, list[torch.Tensor]] = {s: [] for s in worker.job.servers}
    for remote in worker.remote.values():
        if remote.pulled is None:
            continue
        pull, rows = remote.pulled
        grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
        for s, a, b in pull.slices:
            grads[s].append(grad[a:b].contiguous())
        remote.pulled = None
    worker.pulled_bytes.append(worker.pulling)
    worker.pulling = 0
    return grads
