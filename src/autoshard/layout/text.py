"""The short string form of a layout, e.g. ``f32[8@dp,(3,16@tp)]{partial:cp}on[4, 5, 6, 7]``: per
dim its size and the axes splitting it, a factored dim as its blocks."""

from __future__ import annotations

import math
from typing import Any

import torch

from autoshard.layout.normal import NOT_SPLIT, is_block_split

DTYPE_NAMES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def layout_str(layout: Any) -> str:
    dims = []
    for size, factors in zip(layout.shape, layout.factors, strict=True):
        axes = [layout.axis_names[a] for _, a in factors if a != NOT_SPLIT]
        if is_block_split(factors):
            where = "" if not axes else "@" + (axes[0] if len(axes) == 1 else f"({','.join(axes)})")
            dims.append(f"{size}{where}")
        else:
            # Show the dim as blocks: each split factor with the unsplit ones after it.
            groups: list[list[tuple[int, int]]] = []
            for fsize, axis in factors:
                if axis != NOT_SPLIT and groups and groups[-1][-1][1] != NOT_SPLIT:
                    groups[-1].append((fsize, axis))
                elif axis != NOT_SPLIT or not groups:
                    groups.append([(fsize, axis)])
                else:
                    groups[-1].append((fsize, axis))
            parts = []
            for group in groups:
                axes = [layout.axis_names[a] for _, a in group if a != NOT_SPLIT]
                where = (
                    "" if not axes else "@" + (axes[0] if len(axes) == 1 else f"({','.join(axes)})")
                )
                parts.append(f"{math.prod([f for f, _ in group])}{where}")
            dims.append("(" + ",".join(parts) + ")")
    text = f"{DTYPE_NAMES.get(layout.dtype, str(layout.dtype))}[{','.join(dims)}]"
    if layout.partial:
        text += "{partial:" + ",".join(layout.axis_names[a] for a in layout.partial) + "}"
    if tuple(layout.ranks) != tuple(range(len(layout.ranks))):
        text += f"on{list(layout.ranks)}"
    return text


def named_str(layout: Any, names: Any) -> str:
    """The layout with a name per dim instead of its size, ``[b@dp, s, out@tp]{sum:tp}``: a
    dim split over axes is ``name@axis`` (``name@(dp,tp)`` over several), a factored dim
    ``name(3,16@tp)``, pending sums after the dims."""
    dims = []
    for name, size, factors in zip(names, layout.shape, layout.factors, strict=True):
        axes = [layout.axis_names[a] for _, a in factors if a != NOT_SPLIT]
        if not is_block_split(factors):
            blocks = [
                f"{f}@{layout.axis_names[a]}" if a != NOT_SPLIT else str(f) for f, a in factors
            ]
            dims.append(f"{name}({','.join(blocks)})")
        elif axes:
            dims.append(f"{name}@" + (axes[0] if len(axes) == 1 else f"({','.join(axes)})"))
        else:
            dims.append(str(name) if size != 1 else "1")
    text = f"[{', '.join(dims)}]"
    if layout.partial:
        text += "{sum:" + ",".join(layout.axis_names[a] for a in layout.partial) + "}"
    return text


__all__ = ["DTYPE_NAMES", "layout_str", "named_str"]
