"""The normal form of a layout: equal placements are equal values (see layout.py's docstring).

Pure functions over shapes, device matrices and factor lists; :class:`~autoshard.layout.Layout`
calls them when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autoshard import memo

NOT_SPLIT = -1


class LayoutError(ValueError):
    """A layout or a layout operation that cannot describe a valid placement."""


def split_factors(
    parts: list[tuple[int, tuple[int, ...]]],
    device_matrix: tuple[int, ...],
    where: str,
    axis_names: Sequence[str] | None = None,
) -> list[tuple[int, int]]:
    """Turn (factor size, split axes) into factors of the internal form, checking divisibility
    (the error names the axes when the device matrix has names)."""
    out: list[tuple[int, int]] = []
    for size, axes in parts:
        num_parts = math.prod([device_matrix[a] for a in axes])
        if size % num_parts:
            over = f" over {'*'.join(axis_names[a] for a in axes)}" if axis_names else ""
            raise LayoutError(
                f"{where}: size {size} is not divisible by its split {num_parts}{over} "
                f"(device matrix {device_matrix}, {math.prod(device_matrix)} devices)"
            )
        out.extend((device_matrix[a], a) for a in axes)
        out.append((size // num_parts, NOT_SPLIT))
    return out


def init_canonical(
    self: Any,
    shape: Sequence[int],
    mesh: Sequence[int],
    factors: Sequence[Sequence[tuple[int, int]]],
    partial: Sequence[int],
    ranks: Sequence[int],
    dtype: torch.dtype,
    axis_names: Sequence[str] | None,
) -> None:
    """Check the parts and set the normalized fields of the new Layout ``self``: size-1 axes
    dropped, neighbouring axes merged while the merge keeps the placement."""
    shape = tuple(int(s) for s in shape)
    mesh_list = [int(m) for m in mesh]
    ranks = interned_ranks(ranks)
    if math.prod(mesh_list) != len(ranks):
        raise LayoutError(
            f"device matrix {tuple(mesh_list)} has {math.prod(mesh_list)} devices but the rank "
            f"list {ranks_str(ranks)} has {len(ranks)}"
        )
    names = [[n] for n in axis_names] if axis_names is not None else None
    if names is not None and len(names) != len(mesh_list):
        raise LayoutError(f"{len(names)} axis names for device matrix {tuple(mesh_list)}")
    fac = [[(int(s), int(a)) for s, a in f] for f in factors]
    part = sorted({int(p) for p in partial})
    check_factors(shape, mesh_list, fac, part)

    drop_unit_axes(mesh_list, fac, part, names)
    changed = True
    while changed:
        fac = [merge_local(f) for f in fac]
        changed = merge_one_axis_pair(mesh_list, fac, part, names)
    if names is None:
        final_names = tuple(f"a{i}" for i in range(len(mesh_list)))
    else:
        final_names = tuple("*".join(n) for n in names)
    values = {
        "shape": shape,
        "mesh": tuple(mesh_list),
        "factors": tuple(tuple(f) for f in fac),
        "partial": tuple(part),
        "ranks": ranks,
        "dtype": dtype,
        "axis_names": final_names,
    }
    for name, value in values.items():
        object.__setattr__(self, name, value)
    key = (shape, values["mesh"], values["factors"], values["partial"], ranks, dtype)
    object.__setattr__(self, "_key", key)
    object.__setattr__(self, "_hash", hash(key))


def made_once(
    cls: type,
    shape: Sequence[int],
    mesh: Sequence[int],
    factors: Sequence[Sequence[tuple[int, int]]],
    partial: Sequence[int],
    ranks: Sequence[int] | None,
    dtype: torch.dtype,
    axis_names: Sequence[str] | None,
) -> Any:
    """A ``cls`` normalized from these arguments (``init_canonical``), made once for equal
    arguments in a search (a search makes each about five times; the runtime keeps a bounded
    few of its own): layouts are values, so one serves every call that asks for it."""
    return _made(
        cls,
        tuple(shape),
        tuple(mesh),
        tuple(tuple(map(tuple, f)) for f in factors),
        tuple(partial),
        ranks if ranks is None or isinstance(ranks, range) else tuple(ranks),
        dtype,
        None if axis_names is None else tuple(axis_names),
    )


@memo.per_search(outside=4096)
def _made(
    cls: type,
    shape: tuple,
    mesh: tuple,
    factors: tuple,
    partial: tuple,
    ranks: Any,
    dtype: torch.dtype,
    axis_names: tuple | None,
) -> Any:
    made = cls.__new__(cls)
    if ranks is None:
        ranks = range(math.prod(mesh))
    init_canonical(made, shape, mesh, factors, partial, ranks, dtype, axis_names)
    return made


def replaced(layout: Any, **fields: Any) -> Any:
    """``layout`` with ``fields`` (dtype or ranks) replaced: neither changes the normal form,
    so the fields are copied rather than normalized again."""
    new = type(layout).__new__(type(layout))
    for name in ("shape", "mesh", "factors", "partial", "ranks", "dtype", "axis_names"):
        object.__setattr__(new, name, fields.get(name, getattr(layout, name)))
    key = (new.shape, new.mesh, new.factors, new.partial, new.ranks, new.dtype)
    object.__setattr__(new, "_key", key)
    object.__setattr__(new, "_hash", hash(key))
    return new


def check_factors(
    shape: tuple[int, ...], mesh: list[int], fac: list[list[tuple[int, int]]], part: list[int]
) -> None:
    """Check that each dim's factors multiply to its size, each split factor is its mesh axis,
    no axis splits two dims, and partial axes exist and split nothing."""
    if len(fac) != len(shape):
        raise LayoutError(f"{len(fac)} factor lists for tensor {shape_str(shape)}")
    used: dict[int, str] = {}
    for dim, (size, dim_factors) in enumerate(zip(shape, fac, strict=True)):
        if math.prod([s for s, _ in dim_factors]) != size:
            raise LayoutError(f"dim {dim}: factors {dim_factors} do not multiply to {size}")
        for fsize, axis in dim_factors:
            if axis == NOT_SPLIT:
                continue
            if not 0 <= axis < len(mesh) or fsize != mesh[axis]:
                raise LayoutError(f"dim {dim}: factor {(fsize, axis)} does not match the mesh")
            if axis in used:
                raise LayoutError(
                    f"tensor {shape_str(shape)}: device axis {axis} (size {mesh[axis]}) "
                    f"splits both {used[axis]} and dim {dim}"
                )
            used[axis] = f"dim {dim}"
    for axis in part:
        if axis in used or not 0 <= axis < len(mesh):
            raise LayoutError(f"tensor {shape_str(shape)}: partial axis {axis} is invalid or split")


_RANKS: dict[tuple[int, ...], tuple[int, ...]] = {}
_RANGES: dict[int, tuple[int, ...]] = {}


def interned_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    """One shared tuple per rank list, so layouts on the same ranks compare by identity."""
    if type(ranks) is tuple and _RANKS.get(ranks) is ranks:  # already the shared one
        return ranks
    if isinstance(ranks, range) and ranks.start == 0 and ranks.step == 1:
        found = _RANGES.get(len(ranks))
        if found is None:
            found = interned_ranks(tuple(ranks))
            _RANGES[len(ranks)] = found
        return found
    ranks = tuple(int(r) for r in ranks)
    found = _RANKS.get(ranks)
    if found is None:
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise LayoutError(f"rank list {ranks_str(ranks)} repeats a rank or has a negative one")
        found = _RANKS.setdefault(ranks, ranks)
    return found


def drop_unit_axes(
    mesh: list[int], fac: list[list[tuple[int, int]]], part: list[int], names: list | None
) -> None:
    for axis in reversed(range(len(mesh))):
        if mesh[axis] == 1:
            remove_axis(axis, mesh, fac, part, names)


def remove_axis(
    axis: int,
    mesh: list[int],
    fac: list[list[tuple[int, int]]],
    part: list[int],
    names: list | None,
) -> None:
    def shift(a: int) -> int:
        return a - 1 if a > axis else a

    del mesh[axis]
    if names is not None:
        del names[axis]
    for dim, dim_factors in enumerate(fac):
        fac[dim] = [(s, NOT_SPLIT if a == axis else shift(a)) for s, a in dim_factors]
    part[:] = [shift(a) for a in part if a != axis]


def merge_local(factors: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop size-1 factors and fuse neighbouring unsplit ones; a split factor followed by
    unsplit ones stays as it is (that is a plain block split)."""
    out: list[tuple[int, int]] = []
    for size, axis in factors:
        if size == 1:
            continue
        if axis == NOT_SPLIT and out and out[-1][1] == NOT_SPLIT:
            out[-1] = (out[-1][0] * size, NOT_SPLIT)
        else:
            out.append((size, axis))
    return out


def merge_one_axis_pair(
    mesh: list[int], fac: list[list[tuple[int, int]]], part: list[int], names: list | None
) -> bool:
    """Merge the first pair of neighbouring axes whose merge keeps the placement; True if any."""
    where = {a: (d, k) for d, f in enumerate(fac) for k, (_, a) in enumerate(f) if a != NOT_SPLIT}
    for axis in range(len(mesh) - 1):
        nxt = axis + 1
        both_free = axis not in where and nxt not in where and axis not in part and nxt not in part
        both_partial = axis in part and nxt in part
        consecutive = (
            axis in where and nxt in where and where[nxt] == (where[axis][0], where[axis][1] + 1)
        )
        if not (both_free or both_partial or consecutive):
            continue
        if consecutive:
            dim, k = where[axis]
            fac[dim][k] = (mesh[axis] * mesh[nxt], axis)
            fac[dim][k + 1] = (1, nxt)
            fac[dim] = [(s, a) for s, a in fac[dim] if not (s == 1 and a == nxt)]
        mesh[axis] *= mesh[nxt]
        mesh[nxt] = 1
        if names is not None:
            names[axis] = names[axis] + names[nxt]
            names[nxt] = []
        if both_partial:
            part.remove(nxt)
        remove_axis(nxt, mesh, fac, part, names)
        return True
    return False


def is_block_split(factors: Sequence[tuple[int, int]]) -> bool:
    """True when the dim is split in contiguous blocks: no unsplit factor before a split one."""
    seen_local = False
    for _, axis in factors:
        if axis == NOT_SPLIT:
            seen_local = True
        elif seen_local:
            return False
    return True


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def ranks_str(ranks: Sequence[int]) -> str:
    ranks = tuple(ranks)
    if ranks and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return str(list(ranks))


def resolve_view_shape(shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise LayoutError(f"view shape {shape} has more than one -1")
    if -1 in shape:
        known = math.prod([s for s in shape if s != -1])
        if known == 0 or numel % known:
            raise LayoutError(f"view shape {shape} does not fit {numel} elements")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        raise LayoutError(f"view shape {shape} has {math.prod(shape)} elements, not {numel}")
    return shape


__all__ = [
    "NOT_SPLIT",
    "LayoutError",
    "check_factors",
    "init_canonical",
    "interned_ranks",
    "is_block_split",
    "ranks_str",
    "replaced",
    "resolve_view_shape",
    "shape_str",
    "split_factors",
]
