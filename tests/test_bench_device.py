"""``python -m bench device`` (bench/bench_device.py): its help and its refusal without CUDA
run on CPU, and its measurements' pieces run on a CPU rank and agree with their references
(the autoshard run of transformers' Llama with PyTorch's autocast run, the attention and
experts kernels with torch's and transformers')."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's bench/


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def test_the_device_check_says_what_it_measures() -> None:
    done = _bench("device", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m bench" in done.stdout
    assert "device (bench/bench_device.py):" in done.stdout
    assert "transformers' Llama (8 layers, hidden 1024" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check runs")
def test_without_cuda_the_device_check_says_so_and_fails_nothing() -> None:
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_text()
    done = _bench("device")
    assert done.returncode == 0, done.stderr
    assert "skipped device: no CUDA device here" in done.stdout
    assert results.read_text() == before  # nothing ran: nothing rewritten


def _pieces() -> dict:
    from autoshard.cost import cluster_spec
    from bench import bench_device as bd

    cpu = torch.device("cpu")
    tiny = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 128,
            "seq": 32, "batch": 2}  # fmt: skip
    return {
        "train": bd.train_llama(cpu, tiny, 4, cluster_spec("cpu", 1)),
        "attention": bd.attention_kernels(cpu, (1, 2, 64, 16)),
        "experts": bd.experts_kernels(cpu, (4, 64, 32, 16)),
    }


def test_the_device_checks_pieces_agree_with_their_references_on_cpu() -> None:
    """bf16 on CPU: autoshard's losses within the bench's 2% of autocast's, every attention
    way and block kernel and the experts within its bf16 tolerance of their references."""
    from bench import bench_device as bd

    out = run_ranks(_pieces, 1, timeout=300)[0]
    train = out["train"]
    assert len(train["autoshard"]["losses"]) == len(train["pytorch"]["losses"]) == 4
    assert train["loss_worst_rel"] <= bd.LOSS_RTOL
    assert train["autoshard"]["predicted_step_s"] > 0 and train["step_ratio"] > 0
    attention = out["attention"]
    assert attention["kernel"] == "flash_cpu" and set(attention["blocks"]) == {"flash_cpu"}
    for name, row in {**attention["ways"], **attention["blocks"]}.items():
        assert row["max_diff"] <= bd.BF16_TOL, name
    assert out["experts"]["kernel"] == "grouped_mm"
    assert out["experts"]["max_diff"] <= bd.BF16_TOL
