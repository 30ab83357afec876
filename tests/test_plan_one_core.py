"""A plan does not depend on the cores the planner has: `autoshard plan` with pipeline stages
searched gives the same plan on every core, on one core (`taskset -c 0`) and where the
environment turns the planner's forks off (``AUTOSHARD_PLAN_HELPERS=0``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

_PLAN = [
    "plan",
    "--model",
    "gpt",
    "--layers",
    "4",
    "--hidden",
    "1024",
    "--heads",
    "16",
    "--seq",
    "1024",
    "--batch",
    "32",
    "--vocab",
    "32000",
    "--cluster",
    "dgx-h100",
    "--nodes",
    "2",
    "--pp",
    "auto",
]


def _plan(tmp_path, name: str, prefix: list[str], env: dict[str, str]) -> dict:
    out = tmp_path / f"{name}.json"
    command = [*prefix, sys.executable, "-m", "autoshard.cli", *_PLAN, "--json", str(out)]
    done = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return _untimed(json.loads(out.read_text()))


def _untimed(value):
    """The plan less the seconds its search took, which differ run to run."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not k.endswith(_TIMINGS)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


_TIMINGS = ("search_s", "solve_s", "capture_s", "end_to_end_s")


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset is not installed")
def test_one_core_and_no_forks_give_the_plan_all_cores_give(tmp_path) -> None:
    everywhere = _plan(tmp_path, "all", [], {})
    one_core = _plan(tmp_path, "one", ["taskset", "-c", "0"], {})
    no_forks = _plan(tmp_path, "none", [], {"AUTOSHARD_PLAN_HELPERS": "0"})
    assert one_core == everywhere
    assert no_forks == everywhere
    assert everywhere["predicted"]["step_time_s"] > 0
