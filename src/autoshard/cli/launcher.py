"""How ``autoshard train`` runs torchrun and stops it: torchrun in a session of its own (a
Ctrl-C in the terminal reaches the launcher alone, which stops the run and says where it
stopped), bound to the launcher's life by a parent-death signal, and each rank bound to
torchrun's the same way (or, without one, by a thread that notices its parent is gone)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

WORKER = "AUTOSHARD_TRAIN"  # the settings, as JSON, on the ranks launch() starts
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


def launch(cfg: Any, nproc: int, torchrun_args: list[str]) -> int:
    """Run ``autoshard.cli.train``'s worker on ``nproc`` ranks of this node under torchrun.
    The settings travel in the environment as JSON: torchrun would read the options of ours
    that look like its own (``--log``) as its own. The ranks' output comes through as it is,
    torchrun's own log is left out; when a rank fails, what torchrun reports goes to a file,
    and the last line says why the run stopped: the first ``autoshard: error:`` a rank
    printed, or the exit code and where torchrun's report is. Stopped by a signal, the run
    ends with one line saying at which step and from which checkpoint it can go on."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command = [*run, *torchrun_args, "-m", "autoshard.cli.train"]
    report_path = Path(cfg.log).parent / "autoshard-torchrun.log"  # beside the metrics
    report_path.unlink(missing_ok=True)  # a report left by an earlier run is not this one's
    with tempfile.TemporaryDirectory(prefix="autoshard-train-") as scratch:
        progress = Path(scratch) / "step"
        env = {"OMP_NUM_THREADS": "1", **os.environ, PROGRESS: str(progress)}
        env[WORKER] = json.dumps(dataclasses.asdict(cfg))
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
            print(f"autoshard train: stopped at step {step}; {_last_checkpoint(cfg)}", flush=True)
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


def _last_checkpoint(cfg: Any) -> str:
    """Where a stopped run can go on from: its newest whole checkpoint."""
    if not cfg.checkpoint_dir:
        return "no checkpoints were asked for (--checkpoint-dir)"
    import warnings

    from autoshard.runtime import latest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = latest(cfg.checkpoint_dir)
    return f"the last checkpoint is {found}" if found else "no checkpoint was written"


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


__all__ = ["GRACE_S", "PROGRESS", "STOPPING", "die_with_parent", "launch", "record_step"]
