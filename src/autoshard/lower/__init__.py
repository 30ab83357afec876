"""Lowering: the captured graph and its plan -> the GraphModule one rank runs."""

from autoshard.lower.lower import RunState, attr_name, lower, weight_readers
from autoshard.lower.recompute import MODES as RECOMPUTE_MODES
from autoshard.lower.recompute import RecomputeError, check_recompute

__all__ = [
    "RECOMPUTE_MODES",
    "RecomputeError",
    "RunState",
    "attr_name",
    "check_recompute",
    "lower",
    "weight_readers",
]
