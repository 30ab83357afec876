"""What ``autoshard train`` does with a user's mistakes and with ranks that fail
(docs/failures.md): a target that cannot be trained is one line before any rank starts; a rank
that hangs is named by the ranks that waited for it and every process ends; a rank that
crashes shows its traceback once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_examples import _free_port

MODULE = """
import os, time
from pathlib import Path

import torch


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
        self.reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        if os.environ.get("RANK") == "1" and self.reads > 200:  # rank 1, a few steps in
            {failure}
        return self.x[i], self.x[i].sum(0, keepdim=True).sin()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
            torch.nn.ReLU(), torch.nn.Linear(512, 1),
        )

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def make():
    if "RANK" in os.environ:
        (Path(os.environ["PIDS"]) / os.environ["RANK"]).write_text(str(os.getpid()))
    return Net(), Data()
"""

HANG = """with open(os.environ["PIDS"] + "/hang", "w") as f:
                f.write(str(time.time()))
            time.sleep(3600)"""

CRASH = 'raise RuntimeError("the disk went away")'


def _start(tmp_path: Path, target: str, *argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PIDS": str(tmp_path)}
    command = [sys.executable, "-m", "autoshard.cli", "train", target, "--nproc-per-node", "2"]
    command += ["--master-port", str(_free_port()), "--log", str(tmp_path / "log.jsonl"), *argv]
    pipe = subprocess.PIPE
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=pipe, stderr=pipe, text=True)


def _finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def failing_runs(tmp_path_factory) -> Iterator[dict[str, tuple[Path, subprocess.Popen]]]:
    """The run whose rank hangs and the one whose rank crashes, started together: most of the
    first is rank 0 waiting out its timeout, time the second runs in."""
    runs = {}
    for name, failure, timeout in (("hangs", HANG, ["--timeout", "12"]), ("crashes", CRASH, [])):
        directory = tmp_path_factory.mktemp(name)
        (directory / f"{name}.py").write_text(MODULE.format(failure=failure))
        argv = ["--steps", "1000", "--batch-size", "64", *timeout]
        runs[name] = directory, _start(directory, f"{name}:make", *argv)
    yield runs
    for _, proc in runs.values():
        proc.kill()
        proc.wait()


def test_a_target_that_cannot_train_is_one_line_before_any_rank_starts(tmp_path) -> None:
    """A missing module, a missing function, a result that is no model and data, a TOML
    setting of the wrong type: one ``autoshard: error:`` line and status 2, no rank started
    (no torchrun output, no traceback). The four launchers run side by side."""
    (tmp_path / "broken.py").write_text("def make():\n    return 3\n")
    (tmp_path / "run.toml").write_text('[train]\ntarget = "broken:make"\nsteps = "ten"\n')
    cases = {
        "nosuch:make": "'nosuch:make': no module 'nosuch'",
        "broken:nothing": "'broken:nothing': broken has no function 'nothing'",
        "broken:make": "broken:make: return (model, data[, loss_fn]) or a dict, not 3",
        "run.toml": "train setting steps = 'ten': expected int",
    }
    started = {target: _start(tmp_path, target) for target in cases}
    for target, message in cases.items():
        out = _finished(started[target])
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (target, out.stderr)
        assert len(lines) <= 3 and lines[-1].startswith(f"autoshard: error: {message}"), out.stderr
        assert not out.stdout and "torch" not in out.stderr, target
    assert not list(tmp_path.glob("autoshard-torchrun.log"))


def test_a_rank_that_hangs_in_its_data_loader_is_named_and_every_process_ends(
    failing_runs,
) -> None:
    """Rank 1 sleeps for an hour reading a batch a few steps in; with ``--timeout 12`` rank 0 stops
    waiting, names rank 1 and what it is doing, and every process is gone within 45 s of the
    hang; the launcher's last line is that message."""
    tmp_path, proc = failing_runs["hangs"]
    out = _finished(proc)
    ended = time.time()
    hung = float((tmp_path / "hang").read_text())
    assert ended - hung < 45, (ended - hung, out.stderr)
    assert out.returncode != 0, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("autoshard: error: rank 0 waited 12 s in "), out.stderr
    assert re.search(r"rank 1 never arrived \(rank 1 is at step \d+, reading its batch for", last)
    for rank in ("0", "1"):
        pid = int((tmp_path / rank).read_text())
        assert not Path(f"/proc/{pid}").exists(), f"rank {rank} (pid {pid}) is still running"


def test_a_rank_that_crashes_shows_its_traceback_once(failing_runs) -> None:
    """Rank 1 raises in its data loader: its traceback is shown once, rank 0's consequence
    (its peer gone) is not, and the launcher ends with one line."""
    out = _finished(failing_runs["crashes"][1])
    assert out.returncode != 0
    assert out.stderr.count("Traceback") == 1, out.stderr
    assert "rank 1 failed:\nTraceback" in out.stderr
    assert "RuntimeError: the disk went away" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("autoshard: error: training stopped, a rank exited with code 1")
