"""The JSONL metrics log of ``autoshard train``: one record per step, never one step twice.

A run from the start empties the file. A run resumed from a checkpoint of step N keeps the
records up to step N, drops the later ones (that run trains those steps again) and any line
cut short by a killed run, and writes ``{"resumed_after_step": N}`` before its own."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO


def open_log(path: Path, step: int) -> IO[str]:
    """``path`` opened for appending the records of a run that begins after ``step``."""
    kept = []
    if step and path.is_file():
        kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
    if step:
        kept.append(json.dumps({"resumed_after_step": step}))
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")  # closed by its caller


def _step_of(line: str) -> float:
    """The step a line records; infinite for a line that is no record (cut short), so that
    it goes with the steps trained again."""
    try:
        record = json.loads(line)
        return float(record.get("step", record.get("resumed_after_step")))
    except (ValueError, AttributeError, TypeError):
        return math.inf


__all__ = ["open_log"]
