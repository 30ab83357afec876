"""Tensor layouts: how one global tensor is split over a device matrix (MindSpore's tensor layout).

A layout is stored in one normalized form so that equal placements are equal values:

- ``mesh``: the device matrix, major axis first, over ``ranks`` in row-major order, with no axis of
  size 1 and no two neighbouring axes that could be merged without changing the placement.
- ``factors``: per tensor dim, the dim viewed as factors (major first), each ``(size, axis)`` with
  ``axis`` an index into ``mesh`` or -1 (not split). A plain split dim is
  ``((k, a), (n // k, -1))``;
  a factored dim such as a fused QKV weight's ``3H`` is ``((3, -1), (k, a), (NH // k * HD, -1))``.
- ``partial``: mesh axes over which the local values are pending a sum.

Mesh axes never used and never partial are replicated axes: every coordinate holds the same values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.layout.dtensor import grid_placements, placement_spec
from autoshard.layout.normal import (
    NOT_SPLIT,
    LayoutError,
    init_canonical,
    interned_ranks,
    is_block_split,
    made_once,
    ranks_str,
    replaced,
    resolve_view_shape,
    shape_str,
    split_factors,
)
from autoshard.layout.text import layout_str
from autoshard.layout.views import chunk_factors, view_factors
from autoshard.mesh import mesh_axes

__all__ = ["NOT_SPLIT", "Factored", "Layout", "LayoutError"]


@dataclass(frozen=True)
class Factored:
    """One tensor dim viewed as factors, each with its own map entry.

    ``Factored((3, 8, 64), (-1, 0, -1))`` in a MindSpore-form tensor map, or
    ``Factored((3, 8, 64), (None, "tp", None))`` in a named spec: the 3*8*64 dim is split by its
    middle factor, so each rank holds its heads of Q, K and V.
    """

    sizes: tuple[int, ...]
    maps: tuple[Any, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "maps", tuple(self.maps))
        if len(self.sizes) != len(self.maps):
            raise LayoutError(
                f"Factored: {len(self.sizes)} sizes {self.sizes} but {len(self.maps)} map entries"
            )


class Layout:
    """How a global tensor of ``tensor_shape`` is split over ``device_matrix``.

    MindSpore's constructor: ``tensor_map`` has one entry per tensor dim, counting device matrix
    axes from the right (0 is the last axis), -1 for not split, a tuple for several axes (major
    first) or a :class:`Factored` entry. ``partial`` lists axes (same counting) holding a pending
    sum. ``ranks`` is the global rank list the device matrix is laid over (default
    ``range(prod(device_matrix))``), so a layout may live on a pipeline stage's sub-mesh.
    """

    __slots__ = (
        "shape",
        "mesh",
        "factors",
        "partial",
        "ranks",
        "dtype",
        "axis_names",
        "_key",
        "_hash",
        "_local",
        "_grad",
    )

    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    factors: tuple[tuple[tuple[int, int], ...], ...]
    partial: tuple[int, ...]
    ranks: tuple[int, ...]
    dtype: torch.dtype
    axis_names: tuple[str, ...]

    def __init__(
        self,
        device_matrix: Sequence[int],
        tensor_map: Sequence[Any],
        tensor_shape: Sequence[int],
        *,
        partial: Sequence[int] = (),
        ranks: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        axis_names: Sequence[str] | None = None,
    ) -> None:
        device_matrix = tuple(int(d) for d in device_matrix)
        shape = tuple(int(s) for s in tensor_shape)
        num_axes = len(device_matrix)
        if any(d < 1 for d in device_matrix):
            raise LayoutError(f"device matrix {device_matrix} has a size below 1")
        if len(tensor_map) != len(shape):
            raise LayoutError(
                f"tensor_map {tuple(tensor_map)} has {len(tensor_map)} entries but the tensor "
                f"shape {shape} has {len(shape)} dims"
            )

        def axis_of(entry: int, where: str) -> int:
            if not -1 <= entry < num_axes:
                raise LayoutError(
                    f"{where}: map entry {entry} names no axis of device matrix {device_matrix} "
                    f"(entries count axes from the right, 0..{num_axes - 1}, or -1)"
                )
            return NOT_SPLIT if entry == -1 else num_axes - 1 - entry

        def axes_of(entry: Any, where: str) -> tuple[int, ...]:
            entries = entry if isinstance(entry, tuple | list) else (entry,)
            return tuple(a for a in (axis_of(int(e), where) for e in entries) if a != NOT_SPLIT)

        factors = []
        for dim, (size, entry) in enumerate(zip(shape, tensor_map, strict=True)):
            where = f"tensor {shape_str(shape)} dim {dim}"
            if isinstance(entry, Factored):
                if math.prod(entry.sizes) != size:
                    raise LayoutError(
                        f"{where}: factors {entry.sizes} multiply to "
                        f"{math.prod(entry.sizes)}, not {size}"
                    )
                parts = [
                    (fsize, axes_of(fmap, where))
                    for fsize, fmap in zip(entry.sizes, entry.maps, strict=True)
                ]
            else:
                parts = [(size, axes_of(entry, where))]
            factors.append(split_factors(parts, device_matrix, where, axis_names))
        partial_axes = tuple(axis_of(int(p), "partial") for p in partial)
        if ranks is None:
            ranks = range(math.prod(device_matrix))
        init_canonical(self, shape, device_matrix, factors, partial_axes, ranks, dtype, axis_names)

    # -- other constructors -------------------------------------------------------------------

    @classmethod
    def from_factors(
        cls,
        shape: Sequence[int],
        mesh: Sequence[int],
        factors: Sequence[Sequence[tuple[int, int]]],
        partial: Sequence[int] = (),
        ranks: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        axis_names: Sequence[str] | None = None,
    ) -> Layout:
        """Build from the internal form: ``factors`` per dim as ``(size, axis)``, major first, axes
        counted from the left of ``mesh`` (-1: not split); normalized like every layout (once
        for equal arguments: layouts do not change, so one serves every call)."""
        return made_once(cls, shape, mesh, factors, partial, ranks, dtype, axis_names)

    @classmethod
    def from_strategy(
        cls,
        tensor_shape: Sequence[int],
        splits: Sequence[int],
        num_devices: int,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> Layout:
        """One tensor's layout from its split factors, as MindSpore reads a strategy.

        The device matrix is the splits with the repeated-calculation factor appended on the
        right, so ``(2, 1)`` on 4 devices puts rows 0:n/2 on ranks 0 and 1.
        """
        shape = tuple(int(s) for s in tensor_shape)
        splits = tuple(int(s) for s in splits)
        if len(splits) != len(shape):
            raise LayoutError(
                f"strategy {splits} has {len(splits)} entries but tensor {shape_str(shape)} "
                f"has {len(shape)} dims"
            )
        num_used = math.prod(splits)
        if any(s < 1 for s in splits) or num_devices % num_used:
            raise LayoutError(
                f"strategy {splits} for tensor {shape_str(shape)} uses {num_used} devices, "
                f"which does not divide the {num_devices} devices available"
            )
        device_matrix = splits + (num_devices // num_used,)
        tensor_map = tuple(len(splits) - i for i in range(len(splits)))
        return cls(device_matrix, tensor_map, shape, dtype=dtype)

    @classmethod
    def from_named(
        cls,
        tensor_shape: Sequence[int],
        spec: Sequence[Any],
        mesh: Any,
        *,
        partial: Sequence[str] = (),
        dtype: torch.dtype = torch.float32,
    ) -> Layout:
        """The named form: one entry per tensor dim, ``None``, an axis name, a tuple of names
        (major first) or :class:`Factored` with names; ``mesh`` is a DeviceMesh or a mapping
        ``{"dp": 2, "tp": 2}`` over ranks ``0..N-1``."""
        names, sizes, ranks = mesh_axes(mesh)
        index = {name: len(names) - 1 - i for i, name in enumerate(names)}

        def to_map(entry: Any) -> Any:
            if entry is None:
                return -1
            if isinstance(entry, str):
                entry = (entry,)
            unknown = [e for e in entry if e not in index]
            if unknown:
                raise LayoutError(f"axis names {unknown} are not in mesh axes {names}")
            return tuple(index[e] for e in entry)

        tensor_map = tuple(
            Factored(e.sizes, tuple(to_map(m) for m in e.maps))
            if isinstance(e, Factored)
            else to_map(e)
            for e in spec
        )
        if len(tensor_map) != len(tuple(tensor_shape)):
            raise LayoutError(
                f"spec {tuple(spec)} has {len(tensor_map)} entries but tensor "
                f"{shape_str(tuple(tensor_shape))} has {len(tuple(tensor_shape))} dims"
            )
        return cls(
            sizes,
            tensor_map,
            tensor_shape,
            partial=tuple(to_map(p)[0] for p in partial),
            ranks=ranks,
            dtype=dtype,
            axis_names=names,
        )

    @classmethod
    def replicated(
        cls,
        tensor_shape: Sequence[int],
        ranks: Sequence[int] | int,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> Layout:
        """The whole tensor on every rank of ``ranks`` (a count means ``range(count)``)."""
        ranks = range(ranks) if isinstance(ranks, int) else tuple(ranks)
        shape = tuple(int(s) for s in tensor_shape)
        return cls.from_factors(
            shape, (len(ranks),), [((s, NOT_SPLIT),) for s in shape], (), ranks, dtype
        )

    # -- value semantics ----------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Layout) and self._hash == other._hash and self._key == other._key
        )

    def __hash__(self) -> int:
        return self._hash

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Layout is immutable")

    def __reduce__(self) -> Any:
        return (
            _rebuild,
            (
                self.shape,
                self.mesh,
                self.factors,
                self.partial,
                self.ranks,
                str(self.dtype),
                self.axis_names,
            ),
        )

    def __str__(self) -> str:
        return layout_str(self)

    def __repr__(self) -> str:
        return (
            f"Layout(shape={self.shape}, mesh={self.mesh}, factors={self.factors}, "
            f"partial={self.partial}, ranks={ranks_str(self.ranks)}, dtype={self.dtype}, "
            f"axis_names={self.axis_names})"
        )

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self.ranks)

    @property
    def tensor_map(self) -> tuple[Any, ...]:
        """MindSpore's tensor map of the normalized device matrix (axes counted from the right);
        a dim split over several axes gives a tuple, a factored dim a :class:`Factored`."""
        num_axes = len(self.mesh)
        out: list[Any] = []
        for factors in self.factors:
            split = [a for _, a in factors if a != NOT_SPLIT]
            if is_block_split(factors):
                entries = tuple(num_axes - 1 - a for a in split)
                out.append(-1 if not entries else entries[0] if len(entries) == 1 else entries)
            else:
                out.append(
                    Factored(
                        tuple(s for s, _ in factors),
                        tuple(-1 if a == NOT_SPLIT else num_axes - 1 - a for _, a in factors),
                    )
                )
        return tuple(out)

    @property
    def global_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape())

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """The shape every rank of the layout holds (splits are even); ``rank`` is checked."""
        if rank is not None:
            self.position(rank)
        try:
            return self._local
        except AttributeError:
            local = tuple(
                math.prod([s for s, a in factors if a == NOT_SPLIT]) for factors in self.factors
            )
            object.__setattr__(self, "_local", local)
            return local

    def position(self, rank: int) -> int:
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise LayoutError(f"rank {rank} is not in layout {self} ranks") from None

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate on each mesh axis (row-major over ``ranks``)."""
        position = self.position(rank)
        coords = []
        for size in reversed(self.mesh):
            coords.append(position % size)
            position //= size
        return tuple(reversed(coords))

    def local_index(self, rank: int) -> tuple[slice | torch.Tensor, ...]:
        """Which global elements ``rank`` holds: per dim a slice where contiguous, else a
        LongTensor of global indices (factored dims)."""
        coords = self.coordinates(rank)
        out: list[slice | torch.Tensor] = []
        for factors in self.factors:
            if is_block_split(factors):
                start = 0  # row-major over the factors; no division, so a size-0 dim works
                for size, axis in factors:
                    start = start * size + (coords[axis] if axis != NOT_SPLIT else 0)
                length = math.prod([s for s, a in factors if a == NOT_SPLIT])
                out.append(slice(start, start + length))
                continue
            index = torch.zeros((), dtype=torch.long)
            for size, axis in factors:
                index = index.reshape(-1, 1) * size
                index = index + (coords[axis] if axis != NOT_SPLIT else torch.arange(size))
            out.append(index.reshape(-1))
        return tuple(out)

    def with_dtype(self, dtype: torch.dtype) -> Layout:
        if dtype == self.dtype:
            return self
        return replaced(self, dtype=dtype)

    def on_ranks(self, ranks: Sequence[int]) -> Layout:
        """The same placement over another rank list of the same size (a pipeline stage's
        sub-mesh: position ``i`` of ``ranks`` holds what position ``i`` held)."""
        ranks = tuple(ranks)
        if len(ranks) != len(self.ranks):
            raise LayoutError(f"{self} is on {len(self.ranks)} ranks, not {len(ranks)}")
        if ranks == self.ranks:
            return self
        return replaced(self, ranks=interned_ranks(ranks))

    def without_partial(self) -> Layout:
        """The layout of this tensor's gradient: partial axes become replicated."""
        if not self.partial:
            return self
        try:
            return self._grad
        except AttributeError:
            grad = Layout.from_factors(
                self.shape, self.mesh, self.factors, (), self.ranks, self.dtype, self.axis_names
            )
            object.__setattr__(self, "_grad", grad)
            return grad

    # -- mapping through shape ops ------------------------------------------------------------

    def view(self, shape: Sequence[int]) -> Layout:
        """The layout of ``tensor.view(shape)`` (also reshape, flatten, unflatten, squeeze,
        unsqueeze) where every split survives the view; a LayoutError where one cannot."""
        shape = resolve_view_shape(tuple(int(s) for s in shape), self.global_numel)
        factors = view_factors(self, shape)
        return Layout.from_factors(
            shape, self.mesh, factors, self.partial, self.ranks, self.dtype, self.axis_names
        )

    def permute(self, dims: Sequence[int]) -> Layout:
        dims = tuple(d % max(len(self.shape), 1) for d in dims)
        if sorted(dims) != list(range(len(self.shape))):
            raise LayoutError(f"permute of {self}: {tuple(dims)} is not a permutation")
        return Layout.from_factors(
            tuple(self.shape[d] for d in dims),
            self.mesh,
            [self.factors[d] for d in dims],
            self.partial,
            self.ranks,
            self.dtype,
            self.axis_names,
        )

    def transpose(self, dim0: int, dim1: int) -> Layout:
        dims = list(range(len(self.shape)))
        dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
        return self.permute(dims)

    def chunk(self, dim: int, num_chunks: int, index: int) -> Layout:
        """The layout of ``tensor.chunk(num_chunks, dim)[index]`` (``split`` into equal parts):
        valid when the chunks are whole on every rank, e.g. Q of a head-split fused QKV."""
        dim %= len(self.shape)
        factors = chunk_factors(self, dim, num_chunks)
        return Layout.from_factors(
            self.shape[:dim] + (self.shape[dim] // num_chunks,) + self.shape[dim + 1 :],
            self.mesh,
            factors,
            self.partial,
            self.ranks,
            self.dtype,
            self.axis_names,
        )

    # -- DTensor boundary ---------------------------------------------------------------------

    def to_placements(self, device_mesh: Any) -> tuple[Any, ...]:
        """DTensor placements on ``device_mesh`` (one per mesh dim), where DTensor can say it."""
        names, sizes, ranks = mesh_axes(device_mesh)
        if tuple(ranks) != tuple(self.ranks):
            raise LayoutError(f"{self} lives on ranks {ranks_str(self.ranks)}, not the mesh's")
        placements = grid_placements(self, sizes)
        if placements is None or (
            Layout.from_placements(placements, device_mesh, self.shape, dtype=self.dtype) != self
        ):
            raise LayoutError(
                f"DTensor placements cannot express {self} on mesh "
                f"{dict(zip(names, sizes, strict=True))} "
                "(factored dim, or a dim split over mesh dims in other than mesh order)"
            )
        return tuple(placements)

    @classmethod
    def from_placements(
        cls,
        placements: Sequence[Any],
        device_mesh: Any,
        tensor_shape: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
    ) -> Layout:
        """The layout of a DTensor (shards of one dim split in mesh-dim order, major first)."""
        names, _, _ = mesh_axes(device_mesh)
        shape = tuple(int(s) for s in tensor_shape)
        spec, partial = placement_spec(placements, names, len(shape))
        return cls.from_named(shape, spec, device_mesh, partial=partial, dtype=dtype)


def _rebuild(shape, mesh, factors, partial, ranks, dtype_name, names) -> Layout:
    """Unpickle a layout (``Layout.__reduce__``): dtypes travel by name."""
    dtype = getattr(torch, dtype_name.replace("torch.", ""))
    return Layout.from_factors(shape, mesh, factors, partial, ranks, dtype, names)
