"""A second process for a search: work that does not depend on what the search learns on its
way, run on another core while this process goes on. The pipeline search gives it each later
pipeline degree's first stage search (docs/parallelism/pipeline.md), the optimal search the
moves of the meshes after the first (``search.ahead``). Each outcome comes back by pipe and
is used as if found here: the same function on the same graphs, so the plan is the one found
without a helper (the tests check it).

The helper is a fork of this process (Linux, a core left for it: ``helper_cores``); it may
solve integer programs, so HiGHS runs single-threaded everywhere (``program.solve_program``):
a fork holds none of the parent's threads. Where the helper fails, is stuck past the
patience below or is not there, this process does the job itself; the helper is stopped
when its search ends."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from queue import SimpleQueue
from typing import Any

#: seconds waited for the helper's next result at least, and in stage searches of this
#: process's own at most: a helper past that is taken for stuck, and the job is run here
PATIENCE_S = 30.0
PATIENCE_SEARCHES = 20


#: helpers running now (made by this process), and whether this process is one
_LIVE = [0]
_IN_HELPER = [False]


def helper_cores() -> int:
    """The cores another helper may take: the usable ones less this process's and its
    running helpers'; 0 where there is no fork (not Linux), no core left, in a helper, in a
    rank of a process group, or where the environment sets ``AUTOSHARD_PLAN_HELPERS=0``."""
    if not sys.platform.startswith("linux") or _IN_HELPER[0]:
        return 0
    if os.environ.get("AUTOSHARD_PLAN_HELPERS", "1") == "0":  # the user's: no forks
        return 0
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return 0  # a rank: its node's cores are its peers', and its threads not the fork's
    return max(len(os.sched_getaffinity(0)) - 1 - _LIVE[0], 0)


class Helper:
    """``run(job)`` for each of ``jobs`` in a forked process, in order, then for each job of
    the latest ``offer``; ``take(job)`` is the outcome: ("ok", value),
    ("error", exception) for an exception ``raised`` lists (the job's own answer), or None
    where this process must run it itself. ``take`` waits for a job of ``jobs``, and for an
    offered one the helper has begun; an offered one it has not begun is run here (and its
    outcome there, if it comes, is dropped). Rather than wait, this process may take the
    last of ``jobs`` the helper has not begun off its list (``steal``) and run it itself."""

    def __init__(
        self,
        jobs: Sequence[Hashable],
        run: Callable[[Hashable], Any],
        raised: tuple[type[BaseException], ...] = (),
    ) -> None:
        import multiprocessing

        self.jobs, self.waited = set(jobs), set(jobs)
        self.given = list(jobs)
        self.begun: set[Hashable] = set()
        self.offered: list[Hashable] = []
        self.got: dict[Hashable, tuple[str, Any]] = {}
        self.delivered = 0
        context = multiprocessing.get_context("fork")
        self.results, sending = context.Pipe(duplex=False)
        receiving, self.offers = context.Pipe(duplex=False)
        self.proc: Any = context.Process(
            target=_serve,
            args=(list(jobs), run, raised, sending, receiving, (self.results, self.offers)),
            daemon=True,
        )
        self.proc.start()
        _LIVE[0] += 1
        sending.close()
        receiving.close()
        self.longest = 0.0  # the longest job this process ran itself (seconds)

    def ran_here(self, seconds: float) -> None:
        """A job this process ran itself took ``seconds`` (what the patience scales with)."""
        self.longest = max(self.longest, seconds)

    def offer(self, jobs: Sequence[Hashable]) -> None:
        """More jobs, after those given, in place of those offered before and not begun."""
        jobs = list(dict.fromkeys(jobs))
        if jobs == self.offered or self.proc is None:
            return
        try:
            self.offers.send(("offer", jobs))
        except OSError:
            self.stop()
            return
        self.jobs.update(jobs)
        self.offered = jobs

    def would_wait(self, job: Hashable) -> bool:
        """Whether ``take(job)`` would wait now: a job of ``jobs`` or one the helper has
        begun, whose outcome has not come."""
        self._receive(0.0)
        waits = job in self.waited or job in self.begun
        return self.proc is not None and job in self.jobs and job not in self.got and waits

    def steal(self) -> Hashable | None:
        """The last job of ``jobs`` the helper has not begun (as far as this process has
        heard), taken off its list to be run here (None: none is left). Where the helper
        begins it before it hears, its outcome is dropped. (Offered jobs are not taken: they
        come after, and this process would run them in place of its own next work.)"""
        self._receive(0.0)
        if self.proc is None:
            return None
        for job in reversed(self.given):
            if job in self.jobs and job not in self.begun and job not in self.got:
                try:
                    self.offers.send(("drop", job))
                except OSError:
                    self.stop()
                    return None
                self.jobs.discard(job)
                self.waited.discard(job)
                return job
        return None

    def take(self, job: Hashable) -> tuple[str, Any] | None:
        if job not in self.jobs:
            return None
        self._receive(0.0)
        patience = max(PATIENCE_S, PATIENCE_SEARCHES * self.longest)
        while job not in self.got and (job in self.waited or job in self.begun):
            if not self._receive(patience):
                break
        self.jobs.discard(job)  # taken, or run here: a later outcome of it is dropped
        outcome = self.got.pop(job, None)
        if outcome is not None and outcome[0] != "failed":
            self.delivered += 1
            return outcome
        return None

    def _receive(self, patience: float) -> bool:
        """What the helper sent: all that is there (``patience`` 0), or the next message,
        waiting up to ``patience`` seconds; False where the helper is gone, stuck (nothing
        within the patience) or garbled, and stopped: what it has not sent is run here."""
        try:
            while self.proc is not None and self.results.poll(patience):
                job, outcome = pickle.loads(self.results.recv_bytes())
                if outcome[0] == "begun":
                    self.begun.add(job)
                elif job in self.jobs:
                    self.got[job] = outcome
                if patience:
                    return True
            if not patience:
                return self.proc is not None
        except Exception:  # EOF, a closed pipe, or a message that does not unpickle here
            pass
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.join()
        self.results.close()
        self.offers.close()
        self.proc = None
        _LIVE[0] -= 1
        self.waited.clear()
        self.begun.clear()

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _serve(
    jobs: list, run: Callable, raised: tuple, results: Any, offers: Any, theirs: tuple = ()
) -> None:
    """The helper's life: each job begun and its outcome sent as it is done, then each job
    offered; it ends when the parent stops it or closes the offers. A Ctrl-C is the parent's
    to act on (it stops the helper). Messages go out from a thread of their own: a pipe holds
    64 KiB, and an outcome larger than that would otherwise hold the helper until the parent
    next reads, which it does only where it needs a job's outcome."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _IN_HELPER[0], _LIVE[0] = True, 0
    for end in theirs:  # the parent's ends: where it dies, the offers end and so does this
        end.close()
    outbox: SimpleQueue[bytes] = SimpleQueue()
    gone = threading.Event()  # the parent: a send failed

    def post() -> None:
        try:
            while True:
                results.send_bytes(outbox.get())
        except OSError:
            gone.set()

    threading.Thread(target=post, daemon=True).start()
    queue, offered = deque(jobs), deque()
    while not gone.is_set():
        try:
            while offers.poll() or not (queue or offered):  # (waits once all is done)
                kind, what = offers.recv()
                if kind == "offer":  # the latest offer replaces those not begun
                    offered = deque(what)
                else:  # dropped: the parent runs it
                    queue = deque(j for j in queue if j != what)
                    offered = deque(j for j in offered if j != what)
        except (EOFError, OSError):
            return
        job = queue.popleft() if queue else offered.popleft()
        outbox.put(pickle.dumps((job, ("begun", None))))
        try:
            outcome: tuple[str, Any] = ("ok", run(job))
        except raised as err:
            outcome = ("error", err)
        except Exception:  # run here instead, where the error shows as it would without
            outcome = ("failed", None)
        try:
            outbox.put(pickle.dumps((job, outcome), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            outbox.put(pickle.dumps((job, ("failed", None))))


__all__ = ["Helper", "helper_cores"]
