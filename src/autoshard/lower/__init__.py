"""Lowering: the captured graph and its plan -> the GraphModule one rank runs."""

from autoshard.lower.lower import RunState, attr_name, lower

__all__ = ["RunState", "attr_name", "lower"]
