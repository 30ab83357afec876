"""The examples run as their docstrings say, and train as one device would."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard import single_device

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plain_loop_under_torchrun_needs_no_init_process_group_and_matches_one_device():
    steps = 4
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), str(EXAMPLES / "train_loop.py"),
        "--steps", str(steps),
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "plan over 2 rank(s)" in out.stdout
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out.stdout, re.M)]
    assert len(losses) == steps

    example = _module("train_loop")
    model, config = example.make_model()
    one = single_device(model, example.batch_of(config, 0))
    optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3)
    expected = []
    for step in range(steps):
        loss = one(*example.batch_of(config, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
