"""Distributed operators: the op-rule interface (``base``, docs/strategies.md), one module of rules
per op family, the registry mapping aten ops to rules, and what runs on a rank's shards
(``local``)."""

from autoshard.ops import local
from autoshard.ops.base import (
    FIXED,
    FREE,
    SUM,
    Contraction,
    Cost,
    Exchange,
    OpRule,
    Space,
    SpaceRule,
    Strategy,
    StrategyError,
)
from autoshard.ops.nodes import node_title, tensor_inputs
from autoshard.ops.registry import RULES, rule_for

__all__ = [
    "FIXED",
    "FREE",
    "RULES",
    "SUM",
    "Contraction",
    "Cost",
    "Exchange",
    "OpRule",
    "Space",
    "SpaceRule",
    "Strategy",
    "StrategyError",
    "local",
    "node_title",
    "rule_for",
    "tensor_inputs",
]
