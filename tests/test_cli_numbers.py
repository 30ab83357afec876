"""The numbers the commands print and write: a metrics log that does not count a step twice,
plans that say what they leave idle, the same step from ``plan`` and ``simulate``."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from autoshard.cli.main import main
from autoshard.cli.train import TrainConfig, _Log


def _records(steps: range) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


def test_the_metrics_log_starts_fresh_or_says_it_continues(tmp_path, capsys) -> None:
    path = tmp_path / "train.jsonl"
    cfg = TrainConfig(target="m:f", log=str(path))
    # a run killed after step 5 (its last line cut short) whose newest checkpoint is step 3's
    path.write_text(_records(range(1, 6)) + '{"step": 6, "lo')
    log = _Log(cfg, loud=True)
    log.start(3)
    log.step({"step": 4, "loss": 0.5, "step_s": 1.0, "unit": "samples", "samples_per_s": 8.0,
              "mfu": 0.1, "memory_bytes": 0, "peak_rss_bytes": 0, "bytes_sent": 0}, 4)  # fmt: skip
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("step") for r in lines] == [1, 2, 3, None, 4]  # steps 4 and 5 once each
    assert lines[3] == {"resumed_after_step": 3} and lines[4]["loss"] == 0.5
    assert f"metrics log {path} continues after step 3" in capsys.readouterr().out
    # resumed again from step 2: the earlier resumption's lines after it go too
    log = _Log(cfg, loud=True)
    log.start(2)
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"resumed_after_step": 2}
    ]  # fmt: skip
    assert "continues after step 2" in capsys.readouterr().out
    # a run from the start (no checkpoint) writes a new log
    log = _Log(cfg, loud=True)
    log.start(0)
    log.close()
    assert path.read_text() == "" and "continues" not in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--nodes", "--devices"])
def test_no_devices_to_plan_for_is_an_error(flag, capsys) -> None:
    """``--nodes 0`` planned for the preset's nodes without a word."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "mlp", flag, "0"])
    assert exit_info.value.code == 2
    assert f"autoshard: error: {flag} 0: at least 1" in capsys.readouterr().err


def test_a_plan_that_leaves_devices_idle_or_feeds_inputs_whole_says_so(tmp_path, capsys) -> None:
    """A batch of 8 on 64 devices: MFU 0.0%, most devices repeating each other's work; and a
    batch of one, fed whole to every rank."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "mlp", "--batch", "8", "--cluster", "dgx-h100", "--nodes", "8"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    idle = re.search(r"warning: only about (\d+) of the 64 devices do distinct work", printed)
    assert idle and int(idle.group(1)) < 32, printed
    assert json.loads(out.read_text())["warnings"][0].startswith(idle.group(0)[9:])
    assert (
        main(["plan", "--model", "mlp", "--batch", "1", "--cluster", "cpu", "--devices", "4"]) == 0
    )
    printed = capsys.readouterr().out
    assert "warning: input x [1, 256] is fed whole to every rank" in printed
    assert "devices do distinct work" not in printed  # four ways split by features


def _collectives_warned(_: object) -> list[str]:
    from autoshard.cost.calibrate import OTHER_KINDS, _kind_call

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for kind in OTHER_KINDS:
            _kind_call(kind, 1 << 12, 2)()
    return [str(w.message) for w in seen]


def test_calibrate_times_collectives_without_deprecation_warnings() -> None:
    """``autoshard calibrate`` printed torch's FutureWarnings for the old collective names."""
    from autoshard.testing import run_ranks

    assert run_ranks(_collectives_warned, 2, None, timeout=120) == [[], []]


def test_a_pipeline_plans_predicted_is_the_jobs_and_simulate_gives_its_step(tmp_path, capsys):
    """``predicted`` held the stage plan's figures (the whole model, one micro-batch, on one
    stage's sub-mesh: 213 GiB and 24% MFU for GPT-3 while its pipeline fit at 74.8 GiB), the
    stage plan was printed with that memory "per device", and ``simulate`` left out what the
    step adds after the schedule (11657.28 ms against the plan's 11825.2 ms)."""
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq", "1024", "--batch", "32", "--vocab", "32000", "--cluster", "dgx-h100",
            "--nodes", "1", "--pp", "2", "--microbatches", "8", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(path.read_text())
    pred, pipe = data["predicted"], data["pipeline"]
    assert (pred["step_time_s"], pred["mfu"]) == (pipe["step_time_s"], pipe["mfu"])
    busiest = max(sum(m.values()) for m in pipe["memory_bytes"])
    assert pred["peak_memory_bytes"] == pytest.approx(busiest)
    assert pred["memory_bytes"]["total"] == pytest.approx(busiest)
    stage = pipe["one_stage_one_microbatch"]
    assert stage["layers"] and stage["step_time_s"] < pred["step_time_s"]
    assert stage["peak_memory_bytes"] != pred["peak_memory_bytes"]
    per_device = re.findall(r"peak memory (.+?) per device", printed)
    assert len(per_device) == 1, printed  # the pipeline's, not the stage plan's
    assert main(["simulate", str(path)]) == 0
    step = re.search(r"predicted: step ([\d.]+) ms", capsys.readouterr().out).group(1)
    assert step == f"{pred['step_time_s'] * 1e3:.2f}"
    assert f"predicted step {step} ms" in printed
