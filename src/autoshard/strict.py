"""Strict point-to-point mode: gloo made to keep NCCL's order, so that a CPU test hangs where
GPUs would (docs/failures.md).

gloo completes each send and receive on its own: a send leaves as soon as it is posted and a
receive completes whenever its tensor comes. NCCL runs a rank's point-to-point groups one after
the other on one stream, and a send completes only when its receiver runs the group holding
the matching receive. Under :func:`strict_p2p` (or ``AUTOSHARD_STRICT_P2P=1`` in the ranks'
environment) :func:`autoshard.comm.post_p2p` hands its group to this rank's point-to-point
thread, which runs groups in the order posted, as NCCL's stream does: when a group's turn comes
it posts its receives and tells each sender so with a one-byte message on a tag of its own;
each of its sends waits for that word from its receiver before it leaves; the group is done
when all of them are, and only then does the next begin. An order that NCCL would hang on
hangs here too, inside a wait the watchdog bounds and names (``autoshard.watch``).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from autoshard import watch

__all__ = ["StrictGroup", "enabled", "post", "stop", "strict_p2p"]

#: the tag of a receiver's word that the receive is in the group it runs (the data's is 0)
ACK_TAG = 1729

_depth = 0
_engine: _Engine | None = None


def enabled() -> bool:
    """Whether point-to-point groups keep NCCL's order on this rank now."""
    return _depth > 0 or os.environ.get("AUTOSHARD_STRICT_P2P") == "1"


@contextmanager
def strict_p2p() -> Iterator[None]:
    """Inside the block, point-to-point groups keep NCCL's order (the module's docstring); the
    groups posted inside are complete when it ends."""
    global _depth
    _depth += 1
    try:
        yield
        if _engine is not None:
            _engine.drain()
    finally:
        _depth -= 1


class StrictGroup:
    """A group posted to the point-to-point thread; ``wait()`` waits for it and for every
    group posted before it (NCCL's stream completes them in that order)."""

    def __init__(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        what: tuple[str, tuple[int, ...], int],
    ) -> None:
        self.sends, self.recvs, self.what = sends, recvs, what
        self.done = threading.Event()
        self.error: BaseException | None = None

    def __str__(self) -> str:
        parts = [f"send to {p}" for _, p in self.sends]
        parts += [f"receive from {p}" for _, p in self.recvs]
        return "[" + ", ".join(parts) + "]"

    def wait(self) -> None:
        assert _engine is not None
        _engine.wait_through(self)


def post(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    what: tuple[str, tuple[int, ...], int],
) -> StrictGroup:
    """Hand one group of contiguous sends and receives to this rank's point-to-point thread;
    ``what`` names it to the watchdog."""
    global _engine
    if _engine is None:
        _engine = _Engine()
        _engine.start()
    group = StrictGroup(list(sends), list(recvs), what)
    _engine.submit(group)
    return group


def stop() -> None:
    """End the point-to-point thread once its groups are done (the process group is about to
    go)."""
    global _engine
    if _engine is not None:
        _engine.drain()
        _engine.jobs.put(None)
        _engine.join(timeout=5)
        _engine = None


class _Engine(threading.Thread):
    """This rank's point-to-point stream: its groups one after the other, in the order
    posted."""

    def __init__(self) -> None:
        super().__init__(name="autoshard-p2p", daemon=True)
        self.jobs: queue.SimpleQueue[StrictGroup | None] = queue.SimpleQueue()
        self.pending: list[StrictGroup] = []  # posted, not yet waited for by the host
        self.failed: BaseException | None = None

    def submit(self, group: StrictGroup) -> None:
        self.pending.append(group)
        self.jobs.put(group)

    def wait_through(self, group: StrictGroup) -> None:
        """Wait for the groups posted up to ``group``, each under its own name, so the
        watchdog names the one that does not complete."""
        while group in self.pending:
            first = self.pending.pop(0)
            with watch.waiting(first.what):
                first.done.wait()
            if first.error is not None:
                raise first.error

    def drain(self) -> None:
        if self.pending:
            self.wait_through(self.pending[-1])

    def run(self) -> None:
        while (group := self.jobs.get()) is not None:
            watch.p2p(str(group))
            try:
                if self.failed is not None:
                    raise self.failed
                _run(group)
            except BaseException as err:  # the host raises it from wait()
                self.failed = group.error = err
            watch.p2p(None)
            group.done.set()


def _run(group: StrictGroup) -> None:
    word = torch.ones(1, dtype=torch.uint8)
    works = []
    for out, peer in group.recvs:
        works.append(dist.irecv(out, peer))
        works.append(dist.isend(word, peer, tag=ACK_TAG))
    acks = [torch.empty(1, dtype=torch.uint8) for _ in group.sends]
    # every word is asked for before the first is waited for, so none waits to be taken
    asked = [
        dist.irecv(ack, peer, tag=ACK_TAG) for ack, (_, peer) in zip(acks, group.sends, strict=True)
    ]
    for ask, (x, peer) in zip(asked, group.sends, strict=True):
        ask.wait()
        works.append(dist.isend(x, peer))
    for work in works:
        work.wait()
