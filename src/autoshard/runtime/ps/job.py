"""A parameter-server job's roles, its settings, and its bookkeeping in the job's store.

Ranks ``0 .. servers-1`` are servers, the rest workers. What a scheduler would do is done in
the process group's store: each server announces the rows it holds, each request a worker makes
of a server is a numbered entry of that server's queue, each step a server has applied is a key
a worker can wait for, and a role that fails writes what failed, so that the others stop with
its name instead of waiting.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autoshard import comm
from autoshard.devices import rank_device

__all__ = [
    "TABLE_OPTIMIZERS",
    "Job",
    "PSConfig",
    "PSError",
    "WorkerLost",
    "join_store",
    "row_ranges",
    "tcp_store",
]

#: the optimizers servers apply to the rows they hold (``torch.optim``'s, sparse-aware)
TABLE_OPTIMIZERS = ("adagrad", "sgd")
#: a wait in the store looks again after this pause, doubled each time up to the last
_FIRST_PAUSE_S = 0.0005
_LAST_PAUSE_S = 0.02

_RESTARTABLE = "autoshard/ps/"  # the TCP store's keys of jobs whose workers restart
_runs = 0  # jobs started in this process group: each gets its own keys


class PSError(RuntimeError):
    """A role of the job failed or stopped answering; the message names it."""


class WorkerLost(PSError):
    """A worker's process stopped answering a server in a job whose workers may restart."""


_joined: dist.Store | None = None  # the store a process outside torch's world joined


def job_store(restarts: int) -> dist.Store:
    """The job's store: torch's world's, or with restarts its TCP store itself, which a
    worker's process outside the world can join (:func:`join_store`)."""
    if _joined is not None:
        return _joined
    default = dist.distributed_c10d._get_default_store()
    if not restarts:
        return default
    return dist.PrefixStore(_RESTARTABLE, tcp_store())


def tcp_store() -> dist.TCPStore:
    base = dist.distributed_c10d._get_default_store()._underlying_non_prefix_store
    if not isinstance(base, dist.TCPStore):
        raise ValueError(
            f"workers that restart need the job's store to be a TCPStore, got {type(base).__name__}"
        )
    return base


def join_store(host: str, port: int, timeout_s: float) -> None:
    """Join the job's TCP store from a worker's process outside torch's world."""
    global _joined
    base = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    _joined = dist.PrefixStore(_RESTARTABLE, base)


@dataclass(frozen=True)
class PSConfig:
    """A parameter-server job: ``servers`` ranks hold the tables, the others are workers.
    ``staleness`` None is synchronous (every worker's step sees the same table version: one
    device's training); an integer k lets a worker run at most k steps ahead of the oldest
    update its rows include, the servers applying each worker's rows as they come.
    ``restarts`` above 0 lets a worker whose process is killed come back up to that many times
    (synchronous only): its process runs under its rank's, which starts it again, and the
    dense part lives on server 0 too, so a worker holds no state of its own."""

    servers: int
    staleness: int | None = None
    table_optimizer: str = "adagrad"
    table_lr: float = 0.1
    dense_lr: float = 1e-3
    timeout_s: float = 60.0
    restarts: int = 0

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers must be at least 1, got {self.servers}")
        if self.staleness is not None and self.staleness < 0:
            raise ValueError(
                f"staleness must be None or a count of steps >= 0, got {self.staleness}"
            )
        if self.table_optimizer not in TABLE_OPTIMIZERS:
            raise ValueError(
                f"table_optimizer {self.table_optimizer!r}: expected one of {TABLE_OPTIMIZERS}"
            )
        if self.restarts < 0:
            raise ValueError(f"restarts must be a count >= 0, got {self.restarts}")
        if self.restarts and self.staleness is not None:
            raise ValueError(
                f"restarts={self.restarts} needs a synchronous job (staleness=None), got "
                f"staleness={self.staleness}"
            )
        if not self.timeout_s or self.timeout_s <= 0:
            raise ValueError(
                f"timeout_s must be a positive number of seconds, got {self.timeout_s}"
            )

    @property
    def bound(self) -> int:
        """The staleness a pull may see: 0 when synchronous."""
        return 0 if self.staleness is None else self.staleness


def row_ranges(num_rows: int, servers: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` of a table each server holds: contiguous blocks, the first
    ``num_rows % servers`` one row longer."""
    base, extra = divmod(num_rows, servers)
    bounds = [0]
    for s in range(servers):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class Job:
    """This rank's view of the job: its role, the others' ranks, and the store's keys."""

    def __init__(self, config: PSConfig, joined: tuple[int, int, str] | None = None) -> None:
        """``joined``: (rank, world size, prefix) of a worker process that is not a member
        of torch's world (a restarted one); it talks only through its own groups."""
        global _runs
        if joined is None and not dist.is_initialized():
            raise ValueError("a parameter-server job needs torch.distributed initialised")
        world = dist.get_world_size() if joined is None else joined[1]
        if world < config.servers + 1:
            raise ValueError(
                f"servers({config.servers}) + at least 1 worker > world_size {world}: "
                "start more ranks or fewer servers"
            )
        _runs += 1
        self.config = config
        self.rank = dist.get_rank() if joined is None else joined[0]
        self.servers = list(range(config.servers))
        self.workers = list(range(config.servers, world))
        self.device = rank_device()  # the shards' and rows' device
        self.store = job_store(config.restarts)
        self.prefix = f"autoshard/ps/{_runs}/" if joined is None else joined[2]
        #: with restarts, each pair's own group (peer rank -> group), else torch's world's
        self.pairs: dict[int, comm.OwnGroup] | None = {} if config.restarts else None
        self.generation = 0  # of this worker process: its requests carry it

    @property
    def is_server(self) -> bool:
        return self.rank in self.servers

    def name(self, rank: int) -> str:
        if rank in self.servers:
            return f"server {rank} (rank {rank})"
        return f"worker {rank - len(self.servers)} (rank {rank})"

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def cast_async(self, x: torch.Tensor, source: int, peer: int) -> Any:
        """Start ``source``'s ``x`` to the other member of the pair of this rank and
        ``peer`` (``source`` one of them)."""
        if self.pairs is not None:
            return self.pairs[peer].broadcast_async_(x, source)
        return comm.broadcast_async_(x, [source, peer if source == self.rank else self.rank])

    def cast(self, x: torch.Tensor, source: int, peer: int) -> torch.Tensor:
        self.cast_async(x, source, peer).wait()
        return x

    def pair(self, peer: int, generation: int) -> None:
        """Make this rank's group with ``peer`` for the worker's process ``generation``."""
        worker, server = (self.rank, peer) if self.rank in self.workers else (peer, self.rank)
        prefix = self.key("pair", worker, server, generation) + "/"
        self.pairs[peer] = comm.OwnGroup(
            self.store, prefix, [worker, server], self.rank, self.config.timeout_s
        )

    def connect(self) -> None:
        """Make the workers' group and every worker-server pair's, on every rank at once:
        a pair's members would otherwise meet its group having made different counts of
        groups before it (``comm.make_groups``)."""
        if self.pairs is not None:
            return  # each worker process makes its own pairs when it joins
        pairs = [(w, s) for w in self.workers for s in self.servers]
        comm.make_groups([self.workers, *pairs])

    def fail(self, error: BaseException) -> None:
        """Tell the other roles that this one failed, and why (the first to fail is named)."""
        self.store.compare_set(self.key("failed"), "", f"{self.name(self.rank)}: {error!r}")

    @contextmanager
    def talking_to(self, peer: int, what: str) -> Iterator[None]:
        """A collective of this rank and ``peer`` alone: one that fails (the peer gone, its
        connection closed) is ``peer``'s failure, named so to every role."""
        try:
            yield
        except PSError:
            raise
        except RuntimeError as error:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            text = f"{self.name(peer)} stopped answering {self.name(self.rank)}'s {what} ({first})"
            if self.pairs is not None and peer in self.workers:
                raise WorkerLost(text) from error  # it may come back: the server goes on
            self.store.compare_set(self.key("failed"), "", text)
            raise PSError(text) from error

    def post(self, server: int, message: str) -> None:
        """Append ``message`` to ``server``'s queue of requests, with this process's
        generation (a server passes over those of a worker's process that has died)."""
        number = self.store.add(self.key("queue", server, "n"), 1)
        self.store.set(self.key("queue", server, number), f"{self.generation} {message}")

    def wait(
        self, keys: list[str], what: str, ranks: list[int], owners: list[int] | None = None
    ) -> None:
        """Wait until every key exists, bounded by the timeout; a failed role or a silent one
        ends the wait with an error naming it (``owners``: the rank that writes each key;
        those of the keys missing are named, else ``ranks``)."""
        deadline = time.monotonic() + self.config.timeout_s
        failed, pause = self.key("failed"), _FIRST_PAUSE_S
        # polled: a blocking wait in the store cannot also watch for a failed role
        while not self.store.check(keys):
            if self.store.check([failed]):
                raise PSError(f"{self.name(self.rank)} stopped: {self.store.get(failed).decode()}")
            if time.monotonic() > deadline:
                if owners is not None:
                    ranks = sorted(
                        {o for k, o in zip(keys, owners, strict=True) if not self.store.check([k])}
                    )
                names = ", ".join(self.name(r) for r in ranks)
                raise PSError(
                    f"{self.name(self.rank)} waited {self.config.timeout_s:g} s for {what} "
                    f"from {names}; none came"
                )
            time.sleep(pause)
            pause = min(2 * pause, _LAST_PAUSE_S)

    def get(self, key: str, what: str, ranks: list[int]) -> str:
        self.wait([key], what, ranks)
        return self.store.get(key).decode()
