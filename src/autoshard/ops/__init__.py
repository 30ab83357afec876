"""Distributed operators: the op-rule interface (docs/strategies.md) and one rule per op family."""

from autoshard.ops.base import (
    FIXED,
    FREE,
    SUM,
    Cost,
    OpRule,
    Space,
    SpaceRule,
    Strategy,
    StrategyError,
    node_title,
    tensor_inputs,
)
from autoshard.ops.rules import RULES, rule_for

__all__ = [
    "FIXED",
    "FREE",
    "RULES",
    "SUM",
    "Cost",
    "OpRule",
    "Space",
    "SpaceRule",
    "Strategy",
    "StrategyError",
    "node_title",
    "rule_for",
    "tensor_inputs",
]
