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
from pathlib import Path

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


def _run(tmp_path: Path, target: str, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PIDS": str(tmp_path)}
    command = [sys.executable, "-m", "autoshard.cli", "train", target, "--nproc-per-node", "2"]
    command += ["--master-port", str(_free_port()), "--log", str(tmp_path / "log.jsonl"), *argv]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_target_that_cannot_train_is_one_line_before_any_rank_starts(tmp_path) -> None:
    """A missing module, a missing function, a result that is no model and data, a TOML
    setting of the wrong type: one ``autoshard: error:`` line and status 2, no rank started
    (no torchrun output, no traceback)."""
    (tmp_path / "broken.py").write_text("def make():\n    return 3\n")
    (tmp_path / "run.toml").write_text('[train]\ntarget = "broken:make"\nsteps = "ten"\n')
    cases = {
        "nosuch:make": "'nosuch:make': no module 'nosuch'",
        "broken:nothing": "'broken:nothing': broken has no function 'nothing'",
        "broken:make": "broken:make: return (model, data[, loss_fn]) or a dict, not 3",
        "run.toml": "train setting steps = 'ten': expected int",
    }
    for target, message in cases.items():
        out = _run(tmp_path, target)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, out.stderr
        assert len(lines) <= 3 and lines[-1].startswith(f"autoshard: error: {message}"), out.stderr
        assert not out.stdout and "torch" not in out.stderr
    assert not list(tmp_path.glob("autoshard-torchrun.log"))


def test_a_rank_that_hangs_in_its_data_loader_is_named_and_every_process_ends(tmp_path) -> None:
    """Rank 1 sleeps for an hour reading a batch a few steps in; with ``--timeout 12`` rank 0 stops
    waiting, names rank 1 and what it is doing, and every process is gone within 45 s of the
    hang; the launcher's last line is that message."""
    (tmp_path / "hangs.py").write_text(MODULE.format(failure=HANG))
    out = _run(tmp_path, "hangs:make", "--steps", "1000", "--batch-size", "64", "--timeout", "12")
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


def test_a_rank_that_crashes_shows_its_traceback_once(tmp_path) -> None:
    """Rank 1 raises in its data loader: its traceback is shown once, rank 0's consequence
    (its peer gone) is not, and the launcher ends with one line."""
    (tmp_path / "crashes.py").write_text(MODULE.format(failure=CRASH))
    out = _run(tmp_path, "crashes:make", "--steps", "1000", "--batch-size", "64")
    assert out.returncode != 0
    assert out.stderr.count("Traceback") == 1, out.stderr
    assert "rank 1 failed:\nTraceback" in out.stderr
    assert "RuntimeError: the disk went away" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("autoshard: error: training stopped, a rank exited with code 1")
