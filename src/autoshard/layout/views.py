"""How a layout's factors regroup under ``view`` and ``chunk``: every split factor must stay whole
in one dim of the new shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autoshard.layout.normal import NOT_SPLIT, LayoutError, shape_str


def resplit(layout: Any, dims: Mapping[int, Any], partial: Sequence[int] | None = None) -> Any:
    """``layout`` with the factors of each dim in ``dims`` replaced (``(size, axis)`` pairs,
    major first) and, when given, its partial axes."""
    factors = list(layout.factors)
    for d, f in dims.items():
        factors[d] = tuple(f)
    keep = layout.partial if partial is None else partial
    return type(layout).from_factors(
        layout.shape, layout.mesh, factors, keep, layout.ranks, layout.dtype, layout.axis_names
    )


def view_factors(layout: Any, shape: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """The factors of ``layout`` regrouped into the dims of ``shape`` (same number of elements),
    an unsplit factor cut where a dim needs part of it; a LayoutError where a dim would cut a
    split one."""
    stream = [list(f) for factors in layout.factors for f in factors]
    new_factors: list[list[tuple[int, int]]] = []
    for dim, want in enumerate(shape):
        current: list[tuple[int, int]] = []
        need = want
        while need > 1:
            if not stream:
                break
            size, axis = stream[0]
            if size <= need and need % size == 0:
                current.append((size, axis))
                need //= size
                stream.pop(0)
            elif axis == NOT_SPLIT and size % need == 0:
                current.append((need, NOT_SPLIT))
                stream[0][0] = size // need
                need = 1
            else:
                raise LayoutError(
                    f"view of {layout} as {shape_str(shape)}: dim {dim} (size {want}) would "
                    f"cut the factor of size {size}"
                    + ("" if axis == NOT_SPLIT else f" split over {layout.axis_names[axis]}")
                )
        while stream and stream[0][0] == 1:
            stream.pop(0)
        new_factors.append(current)
    return new_factors


def chunk_factors(layout: Any, dim: int, num_chunks: int) -> list[Any]:
    """The factors of one of ``num_chunks`` equal chunks of ``layout`` along ``dim`` (counted
    from 0); a LayoutError unless every chunk is whole on every rank."""
    size = layout.shape[dim]
    if size % num_chunks:
        raise LayoutError(f"chunk of {layout}: dim {dim} ({size}) not divisible by {num_chunks}")
    unflat = layout.shape[:dim] + (num_chunks, size // num_chunks) + layout.shape[dim + 1 :]
    try:
        viewed = layout.view(unflat)
    except LayoutError as err:
        raise LayoutError(
            f"chunk of {layout} into {num_chunks} along dim {dim}: chunks are not whole on "
            f"each rank ({err})"
        ) from None
    if viewed.factors[dim] and viewed.factors[dim][0][1] != NOT_SPLIT:
        axis = viewed.axis_names[viewed.factors[dim][0][1]]
        raise LayoutError(
            f"chunk of {layout} into {num_chunks} along dim {dim}: each chunk lives on other "
            f"ranks of axis {axis}; redistribute first"
        )
    factors = list(viewed.factors)
    del factors[dim]
    return factors


__all__ = ["chunk_factors", "view_factors"]
