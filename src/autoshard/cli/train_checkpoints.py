"""Whether ``autoshard train`` may resume from its checkpoint directory: a directory whose
checkpoints are all damaged is an error naming each, never a silent start from step 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_checkpoints(cfg: Any, failed: Sequence[str] = ()) -> None:
    """A checkpoint directory whose checkpoints are all damaged does not restart the run
    from step 1 unasked: a ValueError naming each and why (``failed``: those that failed to
    load, and why), unless ``restart`` starts over on purpose."""
    if not cfg.checkpoint_dir or cfg.restart:
        return
    from autoshard.runtime import damaged

    whole, problems = damaged(cfg.checkpoint_dir)
    if failed or (problems and not whole):
        named = {p.partition(" (")[0] for p in failed}
        listed = [*failed, *(p for p in problems if p.partition(" (")[0] not in named)]
        raise ValueError(
            f"--checkpoint-dir {cfg.checkpoint_dir} has no whole checkpoint to resume from: "
            f"{'; '.join(listed)}; --restart trains from step 1 over them"
        )


__all__ = ["check_checkpoints"]
