"""What rules read off an fx node: its tensor inputs, output values, shapes, dtypes and
arguments, and the title errors give it."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The fx nodes a node reads, in argument order (lists such as cat's are flattened)."""
    out: list[fx.Node] = []

    def visit(value: Any) -> None:
        if isinstance(value, fx.Node):
            out.append(value)
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v)

    for arg in node.args:
        visit(arg)
    for arg in node.kwargs.values():
        visit(arg)
    return out


def node_vals(node: fx.Node) -> list[Any]:
    """The fake values of a node's outputs (a tuple output flattened, non-tensors kept as None)."""
    val = node.meta.get("val")
    values = list(val) if isinstance(val, list | tuple) else [val]
    return [v if isinstance(v, torch.Tensor) else None for v in values]


def shape_of(node: fx.Node) -> tuple[int, ...]:
    val = node.meta["val"]
    return tuple(int(s) for s in val.shape)


def dtype_of(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def node_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """An argument given either positionally at ``index`` or by keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def node_title(node: fx.Node) -> str:
    """How errors name a node: its graph name, its aten op and the module it came from."""
    target = getattr(node.target, "__name__", str(node.target))
    stack = node.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else ""
    return f"{node.name} (aten.{target}" + (f" in {module}" if module else "") + ")"


__all__ = ["dtype_of", "node_arg", "node_title", "node_vals", "shape_of", "tensor_inputs"]
