"""A run going on from a directory of its checkpoints: the newest whole one is loaded, a
damaged one (by its sizes, or by its sums when it is read) is named and the next older tried,
and a directory whose checkpoints are all damaged is named as such, never taken for an empty
one (docs/checkpoints.md)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autoshard.runtime.state.checkpoint import load
from autoshard.runtime.state.manifest import CheckpointDamaged, damaged, latest


def resume(
    directory: str | os.PathLike,
    module: Any,
    optimizer: Any = None,
    loader: Any = None,
    say: Callable[[str], None] = print,
) -> tuple[int, list[str]]:
    """The step of the newest whole checkpoint in ``directory``, loaded into ``module``,
    ``optimizer`` and ``loader``; 0 where none is whole, with those that failed to load and
    why (for :func:`unresumable`). What was passed over and what was loaded is told to ``say``."""
    skipped: list[Path] = []
    failed: list[str] = []
    while True:
        with warnings.catch_warnings(record=True) as passed:
            warnings.simplefilter("always")
            found = latest(directory, skip=skipped)
        for warning in passed:
            say(str(warning.message).removeprefix("autoshard: "))
        if found is None:
            return 0, failed
        try:
            step = load(found, module, optimizer, loader=loader)["step"]
        except CheckpointDamaged as err:
            say(f"not resuming from {found}: {err}")
            skipped.append(found)
            failed.append(f"{found} ({' '.join(str(err).removeprefix(f'{found}: ').split())})")
            continue
        say(f"resumed from {found} at step {step}")
        return step, failed


def unresumable(directory: str | os.PathLike, failed: Sequence[str] = ()) -> list[str]:
    """Each checkpoint of ``directory`` named with why it is damaged, where none is whole
    (``failed``: those that failed to load, and why, named first); empty where one is whole,
    or where there are none."""
    whole, problems = damaged(directory)
    if not failed and (whole or not problems):
        return []
    named = {p.partition(" (")[0] for p in failed}
    return [*failed, *(p for p in problems if p.partition(" (")[0] not in named)]


__all__ = ["resume", "unresumable"]
