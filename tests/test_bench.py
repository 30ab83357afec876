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
