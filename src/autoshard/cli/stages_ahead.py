"""``autoshard plan`` without ``--pp``: the search with pipeline stages begun ahead of the
search without them (docs/parallelism/pipeline.md).

The plan without stages is searched first, and the search with stages runs only where
nothing fits without them. Their capture differs (the export with the batch free takes
longer), and on a model that needs stages the search without them is only spent time: a
fork of the command (``StagesAhead``) begins the search with stages while this process
captures and searches without them. It runs at the lowest priority, so it only takes a core
this process and its helpers leave idle, and it holds everything it would show (its output,
its JSON file) until this process's search ends: where nothing fits without stages, this
process says so and the fork shows the plan with stages, just as this process would have;
where a plan fits, the fork is killed and shows nothing. Where the fork's search raises
(an error is then told as this process tells it), fails, dies, or is starved or stuck while
this process waits for it (it and its helper get less than a quarter of a core for two
seconds: a busy machine leaves the lowest priority next to nothing), this process searches
with stages itself, at its own priority. Only the
command's own process forks (not a call of ``main`` from Python), on Linux with a core to
spare (``search.helper.helper_cores``), and not where ``AUTOSHARD_PLAN_HELPERS=0``."""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable


class StagesAhead:
    """``run()`` (the search with stages and its output; an exit code) in a fork, its output
    held until ``finish()`` lets it out, or dropped by ``stop()``. ``json``: the plan file
    the command writes (None or "-" for none or stdout), written by the fork to ``held``
    and moved into place when it is let out."""

    def __init__(self, run: Callable[[str | None], int], json: str | None) -> None:
        self.json = json
        self.held = None if json in (None, "-") else f"{json}.{os.getpid()}.partial"
        go_read, self.go = os.pipe()
        self.done, done_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the fork: never returns
            os.close(self.go)
            os.close(self.done)
            _serve(run, self.held, go_read, done_write)
        # a process group of its own, which its helper joins: stopped, all of it goes (a
        # helper left behind would hold this command's output open); set on both sides of
        # the fork, so that it is there whichever runs first
        _own_group(self.pid)
        os.close(go_read)
        os.close(done_write)

    def stop(self) -> None:
        """The fork killed and reaped, its output and file dropped."""
        if self.pid is None:
            return
        _kill(self.pid)
        os.waitpid(self.pid, 0)
        os.close(self.go)
        os.close(self.done)
        self.pid = None
        if self.held is not None and os.path.exists(self.held):
            os.remove(self.held)

    def finish(self) -> int | None:
        """The fork's output let out once its search ends, and its exit code; None where it
        failed, died, is starved or stuck (this process then searches with stages itself)."""
        try:
            os.write(self.go, b"g")
            answer = self._answer()
        except OSError:
            answer = b""
        pid, self.pid = self.pid, None
        if not answer:
            _kill(pid)
        os.waitpid(pid, 0)
        os.close(self.go)
        os.close(self.done)
        if not answer:
            if self.held is not None and os.path.exists(self.held):
                os.remove(self.held)
            return None
        if self.held is not None and os.path.exists(self.held):
            os.replace(self.held, self.json)
        return answer[0]

    def _answer(self) -> bytes:
        """The fork's exit code once it has let its output out; empty where it ended without
        one, or where it and its helper were starved: less than ``STARVED_SHARE`` of a core
        through ``STARVED_S`` seconds while this process waits (a busy machine gives its
        lowest priority next to nothing; a fork can inherit a lock no thread releases). This
        process then searches at its own priority rather than wait on it."""
        last, since = _cpu_seconds(self.pid), time.monotonic()
        while not select.select([self.done], [], [], STARVED_S / 4)[0]:
            used, now = _cpu_seconds(self.pid), time.monotonic()
            if used is None or last is None:  # nothing to tell by: wait as for its own
                last, since = used, now
                continue
            if used - last >= STARVED_SHARE * (now - since):  # it ran: a new window
                last, since = used, now
            elif now - since > STARVED_S:
                return b""
        return os.read(self.done, 1)


#: a fork using less than this share of a core for ``STARVED_S`` seconds, while this
#: process only waits for it, is starved (or stuck), and its search is run here
STARVED_SHARE = 0.25
STARVED_S = 2.0


def _cpu_seconds(pid: int) -> float | None:
    """Processor time used by ``pid`` and its children (from /proc; None where unread)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids = [pid, *map(int, f.read().split())]
        ticks = 0
        for p in pids:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _own_group(pid: int) -> None:
    try:
        os.setpgid(pid, pid)
    except OSError:  # already so, or already gone
        pass


def _kill(pid: int) -> None:
    """``pid`` and its process group (its helper) killed."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _serve(run: Callable[[str | None], int], held: str | None, go: int, done: int) -> None:
    """The fork's life: the search with stages, its output held in files, then let out on
    this process's word (or dropped where it ends without one: killed, or gone, or where the
    search raised)."""
    try:
        _own_group(0)
        os.nice(19)  # a core the planning process and its helpers leave idle, no more
        from autoshard.search import helper

        helper._LIVE[0] = 0  # its own pipeline helper, a fork of it (the same priority)
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        real = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        # (Python's streams too, where they are not the descriptors': under a capture)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        code = run(held)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.read(go, 1) != b"g":  # the planning process is gone: nothing to show
            if held is not None and os.path.exists(held):
                os.remove(held)
            os._exit(0)
        os.dup2(real[0], 1)
        os.dup2(real[1], 2)
        for kept, fd in ((out, 1), (err, 2)):
            kept.seek(0)
            with os.fdopen(os.dup(fd), "wb") as to:
                shutil.copyfileobj(kept, to)
        os.write(done, bytes([code & 0xFF]))
        os._exit(code)
    except BaseException:  # this process searches again and tells the error as it would
        os._exit(1)


__all__ = ["StagesAhead"]
