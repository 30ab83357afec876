"""A job's ranks under torchrun, started, stopped and their failure told once (``autoshard
train`` runs its ranks so; a Python program may run its own): torchrun in a session of its own
(a Ctrl-C in the terminal reaches the launcher alone, which stops the run and says where it
stopped), bound to the launcher's life by a parent-death signal, and each rank bound to
torchrun's the same way (or, without one, by a thread that notices its parent is gone).

    code = supervise("mypackage.rank", 4, [], {"MY_SETTINGS": "..."}, Path("torchrun.log"),
                     lambda step: f"stopped at step {step}")

and in ``mypackage/rank.py``: ``sys.exit(run_rank(train))``, ``record_step(step)`` after each
step on rank 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: the signals that stop a run; the launcher's status is 128 + the signal's number
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: how long torchrun has to end its ranks after the launcher asked, before all are killed
GRACE_S = 10.0
#: the file rank 0 writes the last finished step to (named to the ranks in the environment)
PROGRESS = "AUTOSHARD_PROGRESS"
#: torchrun's own log lines (its banner, its notes on the ranks it watches)
_TORCHRUN_LOG = re.compile(r"^[DIWE]\d{4} [\d:.]+ +\d+ .*torch/distributed/(run|elastic)/")
#: the line after which torchrun only tells how the ranks failed (its traceback, its summary)
_TORCHRUN_FAILED = re.compile(r"torch/distributed/elastic/.*failed \(exitcode")
_PR_SET_PDEATHSIG = 1  # prctl's option: the signal this process gets when its parent ends


def _parent_death_signal(sig: int) -> None:
    """``sig`` to this process when its parent ends, where the C library offers ``prctl``
    (torchrun's start takes SIGTERM, which it passes on to the ranks)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process ends when its parent does: Linux's parent-death signal, and everywhere a
    thread that watches the parent's pid (the signal alone misses a parent that ended before
    it was set)."""
    parent = os.getppid()
    _parent_death_signal(sig)

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="autoshard-parent", daemon=True).start()


class _Stopper:
    """The launcher's handler of the stopping signals: the first asks torchrun to end the
    ranks (SIGTERM), and kills torchrun's session and the ranks after ``GRACE_S``; a second
    kills at once."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.signal = proc, None
        self.timer: threading.Timer | None = None
        self.before = {s: signal.signal(s, self.stop) for s in STOPPING}

    def stop(self, signum: int, _frame: Any) -> None:
        if self.signal is not None:
            self.kill()
            return
        self.signal = signum
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        self.timer = threading.Timer(GRACE_S, self.kill)
        self.timer.daemon = True
        self.timer.start()

    def kill(self) -> None:
        # the ranks are in sessions of their own; killed, torchrun takes them with it (their
        # parent-death signal)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def restore(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for s, handler in self.before.items():
            signal.signal(s, handler)


def supervise(
    module: str,
    nproc: int,
    torchrun_args: list[str],
    env: Mapping[str, str],
    report_path: Path,
    stopped: Callable[[str], str],
) -> int:
    """Run ``python -m module`` on ``nproc`` ranks of this node under torchrun, ``env`` added
    to their environment; the exit status. The ranks' output comes through as it is,
    torchrun's own log is left out; when a rank fails, what torchrun reports goes to
    ``report_path``, and the last line says why the run stopped: the first ``autoshard:
    error:`` a rank printed, or the exit code and where torchrun's report is. Stopped by a
    signal, the run ends with the line ``stopped`` gives for the last step a rank recorded
    (``record_step``), and the status is 128 + the signal's number."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command = [*run, *torchrun_args, "-m", module]
    report_path.unlink(missing_ok=True)  # a report left by an earlier run is not this one's
    with tempfile.TemporaryDirectory(prefix="autoshard-run-") as scratch:
        progress = Path(scratch) / "step"
        env = {"OMP_NUM_THREADS": "1", **os.environ, **env, PROGRESS: str(progress)}
        from autoshard.mesh import nccl_environment  # imports torch: once a run launches

        nccl_environment(env)  # NCCL's watchdog and flight recorder, where the user set none
        proc = subprocess.Popen(
            command,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # told to stop when the launcher ends, even by SIGKILL
            preexec_fn=functools.partial(_parent_death_signal, signal.SIGTERM),
        )
        stopper = _Stopper(proc)
        try:
            with proc:
                report, told, last = _relay(proc.stderr, stopper)
        finally:
            stopper.restore()
        if stopper.signal is not None:
            step = (progress.read_text().strip() if progress.exists() else "") or "0"
            print(stopped(step), flush=True)
            return 128 + stopper.signal
    if not proc.returncode:
        return 0
    if report:
        report_path.write_text("".join(report))
    if told is None:
        told = (
            f"autoshard: error: training stopped, a rank exited with code {proc.returncode} "
            f"(its output is above; torchrun's report: {report_path})"
        )
    if told != last:
        print(told, file=sys.stderr)
    return proc.returncode


def _relay(stream: Any, stopper: _Stopper) -> tuple[list[str], str | None, str | None]:
    """Copy the ranks' lines of torchrun's stderr to ours until the run stops; return
    torchrun's failure report, the first ``autoshard: error:`` line a rank printed and the
    last line copied. Once a signal stops the run, what the ending ranks and torchrun say
    is theirs, not the user's, and is not copied."""
    report: list[str] = []
    told = last = None
    for line in stream:
        if stopper.signal is not None:
            continue
        if report or _TORCHRUN_FAILED.search(line):
            report.append(line)
        elif not _TORCHRUN_LOG.match(line):
            if told is None and line.startswith("autoshard: error:"):
                told = line.rstrip("\n")
            last = line.rstrip("\n")
            sys.stderr.write(line)
            sys.stderr.flush()
    return report, told, last


def record_step(step: int) -> None:
    """Rank 0's last finished step, for the launcher's line when the run is stopped."""
    path = os.environ.get(PROGRESS)
    if path:
        # written aside and renamed: a rank killed mid-write leaves the last step whole
        with contextlib.suppress(OSError):
            Path(path + ".new").write_text(str(step))
            os.replace(path + ".new", path)


def run_rank(work: Callable[[], Any]) -> int:
    """A rank torchrun started: ``work``, and the exit status. Only the first rank that fails
    says why (the others fail because it did, or with the same error): an error of the
    user's input in one line, any other error with its traceback (``AUTOSHARD_DEBUG=1``:
    Python's own, on every rank)."""
    die_with_parent()  # torchrun gone (killed, its launcher killed): this rank stops too
    try:
        work()
        return 0
    except Exception as err:
        if os.environ.get("AUTOSHARD_DEBUG"):
            raise
        if _first_to_fail():
            rank = os.environ.get("RANK", "0")
            if isinstance(err, ValueError | OSError):  # autoshard's errors of the input too
                print(f"autoshard: error: {' '.join(str(err).split())}", file=sys.stderr)
            else:
                import traceback

                print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="")
        sys.stderr.flush()
        sys.stdout.flush()
        # not through the exit handlers: they would wait for collectives the failure left
        # unmatched, and tear down a process group whose peers may be gone
        os._exit(1)


def _first_to_fail() -> bool:
    """Whether no other rank of the job has failed before this one (the job's store counts
    them; without a store, every rank is first)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        if dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        else:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        return store.add("autoshard/failed", 1) == 1
    except Exception:
        return True


__all__ = [
    "GRACE_S",
    "PROGRESS",
    "STOPPING",
    "die_with_parent",
    "record_step",
    "run_rank",
    "supervise",
]
