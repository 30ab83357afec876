"""A second process for the pipeline search (docs/parallelism/pipeline.md): the stage searches
that depend on nothing the search learns on its way (each later pipeline degree's first: for
speed alone, at its first ZeRO stage), run on another core while this process prices the
degrees before them. Each result comes back by pipe with the cost graphs its search built,
and is used as if searched here: the search is the same function on the same graphs, so the
plan is the one a search without the helper finds (the tests check it).

The helper is a fork of this process made when the search starts (Linux, two usable cores or
more); it solves its own integer programs, so HiGHS runs single-threaded everywhere
(``program.solve_program``): a fork holds none of the parent's threads. Where the helper
fails, is slow past all reason or is not there, the search runs the job here itself; it is
stopped when the search ends."""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

#: seconds waited for the helper's next result at least, and in stage searches of this
#: process's own at most: a helper past that is taken for stuck, and the job is run here
PATIENCE_S = 30.0
PATIENCE_SEARCHES = 20


def helper_cores() -> int:
    """The cores a helper may take: the usable ones less this process's; 0 where there is no
    fork (not Linux) or no second core."""
    if not sys.platform.startswith("linux"):
        return 0
    return max(len(os.sched_getaffinity(0)) - 1, 0)


class Helper:
    """``run(job)`` for each of ``jobs`` in a forked process, in order; ``take(job)`` is the
    outcome: ("ok", value), ("error", exception) for an exception ``raised`` lists (the job's
    own answer), or None where this process must run it itself."""

    def __init__(
        self,
        jobs: Sequence[Hashable],
        run: Callable[[Hashable], Any],
        raised: tuple[type[BaseException], ...] = (),
    ) -> None:
        import multiprocessing

        self.jobs, self.got, self.delivered = list(jobs), {}, 0
        context = multiprocessing.get_context("fork")
        self.conn, sending = context.Pipe(duplex=False)
        self.proc = context.Process(
            target=_serve, args=(self.jobs, run, raised, sending), daemon=True
        )
        self.proc.start()
        sending.close()
        self.longest = 0.0  # the longest job this process ran itself (seconds)

    def ran_here(self, seconds: float) -> None:
        """A job this process ran itself took ``seconds`` (what the patience scales with)."""
        self.longest = max(self.longest, seconds)

    def take(self, job: Hashable) -> tuple[str, Any] | None:
        if job not in self.jobs:
            return None
        patience = max(PATIENCE_S, PATIENCE_SEARCHES * self.longest)
        while job not in self.got and self.proc is not None:
            try:
                if not self.conn.poll(patience):
                    raise TimeoutError
                done, outcome = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError, TimeoutError, pickle.UnpicklingError):
                self.stop()  # gone, stuck or garbled: what it has not sent is run here
                break
            self.got[done] = outcome
        outcome = self.got.pop(job, None)
        if outcome is not None and outcome[0] != "failed":
            self.delivered += 1
            return outcome
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.join()
        self.conn.close()
        self.proc = None

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _serve(jobs: list, run: Callable, raised: tuple, conn: Any) -> None:
    """The helper's life: each job's outcome sent as it is done. A Ctrl-C is the parent's to
    act on (it stops the helper)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for job in jobs:
        try:
            outcome: tuple[str, Any] = ("ok", run(job))
        except raised as err:
            outcome = ("error", err)
        except Exception:  # run here instead, where the error shows as it would without
            outcome = ("failed", None)
        try:
            data = pickle.dumps((job, outcome), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = pickle.dumps((job, ("failed", None)))
        conn.send_bytes(data)
    conn.close()


__all__ = ["Helper", "helper_cores"]
