"""The numbers the commands print and write: a metrics log that does not count a step twice,
plans that say what they leave idle, the same step from ``plan`` and ``simulate``."""

from __future__ import annotations

import json

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
