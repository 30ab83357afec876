"""The examples run as their docstrings say, and train as one device would."""

from __future__ import annotations

import importlib.util
import json
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


def _torchrun(script: str, steps: int) -> tuple[str, list[float]]:
    """``torchrun --nproc-per-node 2 examples/<script>.py --steps N``: its output and losses."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), str(EXAMPLES / f"{script}.py"), "--steps", str(steps),
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out.stdout, re.M)]
    assert len(losses) == steps
    return out.stdout, losses


def _one_device(model: torch.nn.Module, batches: list[tuple]) -> list[float]:
    one = single_device(model, batches[0])
    optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = one(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_plain_loop_under_torchrun_needs_no_init_process_group_and_matches_one_device():
    out, losses = _torchrun("train_loop", 4)
    assert "plan over 2 rank(s)" in out
    example = _module("train_loop")
    model, config = example.make_model()
    expected = _one_device(model, [example.batch_of(config, step) for step in range(4)])
    assert losses == pytest.approx(expected, rel=1e-5)


def test_the_transformers_example_under_torchrun_matches_one_device():
    pytest.importorskip("transformers")
    _, losses = _torchrun("transformers_gpt2", 3)
    example = _module("transformers_gpt2")
    expected = _one_device(example.build(), [example.batch_at(step) for step in range(3)])
    assert losses == pytest.approx(expected, rel=1e-5)


def _train(argv: list[str], tmp_path: Path) -> tuple[str, list[float]]:
    log = tmp_path / f"log{len(list(tmp_path.glob('log*')))}.jsonl"
    command = [sys.executable, "-m", "autoshard.cli", "train", "train_fn:make", "--batch-size", "8"]
    command += ["--nproc-per-node", "2"]
    command += ["--master-port", str(_free_port()), "--log", str(log), "--log-every", "1", *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        command, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_autoshard_train_resumes_from_the_latest_checkpoint_as_if_never_stopped(tmp_path):
    first, second = tmp_path / "stopped", tmp_path / "straight"
    out, early = _train(
        ["--steps", "4", "--checkpoint-dir", str(first), "--checkpoint-every", "2"], tmp_path
    )
    assert "plan over 2 rank(s)" in out and len(early) == 4
    out, late = _train(["--steps", "6", "--checkpoint-dir", str(first)], tmp_path)
    assert f"resumed from {first / 'step4'} at step 4" in out
    assert len(late) == 2
    _, straight = _train(["--steps", "6", "--checkpoint-dir", str(second)], tmp_path)
    assert early + late == straight  # bitwise: parameters, optimizer state and data order
