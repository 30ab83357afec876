"""The timing the benchmarks against native PyTorch share (``bench/timing.py``)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from autoshard.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench/

from bench.timing import in_turns, paired_ratio  # noqa: E402


def _turns() -> tuple[list[str], dict[str, list[float]]]:
    log: list[str] = []
    steps = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    return log, in_turns(steps, rounds=3, warmup=2)


def test_in_turns_turns_the_order_around_every_round_and_keeps_the_rounds_after_warmup() -> None:
    log, times = run_ranks(_turns, 1)[0]
    forward, backward = ["a", "b", "c"], ["c", "b", "a"]
    assert log == (forward + backward) * 2 + forward
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_paired_ratio_is_the_median_of_the_rounds_ratios_inside_its_interval() -> None:
    theirs = [10.0, 20.0, 11.0, 30.0, 12.0, 9.0, 25.0]
    factors = [0.9, 1.1, 0.95, 1.0, 0.97, 1.2, 0.92]
    ours = [t * f for t, f in zip(theirs, factors, strict=True)]
    got = paired_ratio(ours, theirs)
    assert got["median"] == pytest.approx(statistics.median(factors))
    assert got["low"] <= got["median"] <= got["high"]
    assert min(factors) <= got["low"] and got["high"] <= max(factors)
    constant = paired_ratio([2.0 * t for t in theirs], theirs)
    assert constant == pytest.approx({"median": 2.0, "low": 2.0, "high": 2.0})
    with pytest.raises(ValueError):
        paired_ratio(ours, theirs[:-1])  # rounds that do not pair up


def test_src_modified_is_asked_of_the_whole_repository(tmp_path, monkeypatch) -> None:
    """git runs in bench/; the package's changes (``src/`` at the root) and the benchmarks'
    code count as modified, the results the benchmarks write do not."""
    import subprocess

    import bench.__main__ as main

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    for name in ("src/autoshard/x.py", "bench/bench_x.py", "bench/results/x.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    monkeypatch.setattr(main, "BENCH_DIR", tmp_path / "bench")
    assert main.machine_facts()["src_modified"] is False
    (tmp_path / "bench/results/x.json").write_text("1\n")
    assert main.machine_facts()["src_modified"] is False
    (tmp_path / "src/autoshard/x.py").write_text("1\n")
    assert main.machine_facts()["src_modified"] is True
    git("checkout", "--", "src")
    (tmp_path / "bench/bench_x.py").write_text("1\n")
    assert main.machine_facts()["src_modified"] is True


def test_megatron_cores_attention_is_autoshards_with_its_projection_laid_out_by_head() -> None:
    """``bench.published_h100``'s Megatron-Core attention computes what autoshard's GPT
    attention does once the fused projection's rows are laid out by head (each head's query,
    key and value rows side by side): the same model, its weight stored as Megatron does."""
    import torch

    from autoshard.models.gpt import CausalSelfAttention, GPTConfig
    from bench.published_h100 import HeadGroupedAttention

    torch.manual_seed(0)
    config = GPTConfig(hidden=32, num_heads=4)
    ours, theirs = CausalSelfAttention(config), HeadGroupedAttention(config)
    head = config.hidden // config.num_heads
    rows = torch.arange(3 * config.hidden).view(3, config.num_heads, head).transpose(0, 1)
    with torch.no_grad():
        theirs.c_attn.weight.copy_(ours.c_attn.weight[rows.reshape(-1)])
        theirs.c_attn.bias.copy_(ours.c_attn.bias[rows.reshape(-1)])
        theirs.c_proj.load_state_dict(ours.c_proj.state_dict())
    x = torch.randn(2, 8, config.hidden)
    torch.testing.assert_close(theirs(x), ours(x))
    assert not torch.allclose(HeadGroupedAttention(config)(x), ours(x))


def test_the_megatron_core_models_count_the_readmes_parameters_and_torchtitans_norm_is_fp32() -> (
    None
):
    """Each Megatron-Core run's ``--model-fn`` builds a GPT of the size its README row names
    (output layer untied); torchtitan's RMSNorm normalizes in float32 and returns bf16."""
    import torch

    from bench import published_h100 as h100

    for name, *_ in h100.MEGATRON_CORE:
        model = getattr(h100, h100.MCORE_FNS[name])()["model"]
        count = sum(p.numel() for p in model.parameters()) / 1e9
        assert count == pytest.approx(float(name.rstrip("B")), rel=0.05), name
    norm = h100.Float32RMSNorm(64, 1e-5).bfloat16()  # the weights as --precision bf16 keeps them
    x = (torch.randn(3, 64) * 100).bfloat16()
    y = x.float()
    want = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert norm(x).dtype == torch.bfloat16
    torch.testing.assert_close(norm(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_published_runs_parts_add_up_to_its_predicted_step(tmp_path, pp) -> None:
    """``bench.published_parts`` splits a run planned as ``bench published`` plans it (here a
    small GPT on two nodes of the H100 preset, ZeRO 1, selective recompute, with and without
    stages) into parts that add up to the step the plan predicts: its kinds of compute,
    what recompute runs again, the bubble, the data-parallel sums waited for and the
    optimizer; beside them, the kernels the rank launches."""
    import json

    from autoshard.cost import cluster_spec
    from bench import published_parts

    cluster = tmp_path / "h100.json"
    cluster.write_text(json.dumps(cluster_spec("dgx-h100").to_json()))
    run = {
        "run": "small", "model": "gpt", "layers": 4, "hidden": 256, "heads": 4, "vocab": 1024,
        "seq": 128, "tp": 2, "pp": pp, "gpus": 16, "batch": 32, "microbatches": 4,
        "schedule": "1f1b", "virtual_stages": 1, "recompute": "selective",
        "sequence_parallel": True, "zero": 1, "precision": "bf16", "seconds": 1.0,
    }  # fmt: skip
    got = published_parts.run_parts(run, cluster)
    parts = sum(got[k] for k in published_parts.PARTS)
    assert parts == pytest.approx(got["predicted"], rel=1e-6)
    assert all(got[k] >= -1e-12 for k in published_parts.PARTS)
    assert got["matrix products"] > 0 and got["recompute"] > 0 and got["optimizer"] > 0
    assert (got["bubble"] > 0) == (pp > 1)
    assert got["dp comm priced"] > 0 and got["dp comm priced"] >= got["dp comm"]
    # every micro-batch launches the same kernels; with stages the rank holds half the blocks
    kernels = got[published_parts.KERNELS]
    assert kernels > 0 and (pp > 1 or kernels % run["microbatches"] == 0)
