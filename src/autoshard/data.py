"""Data for each rank: its data-parallel shard of a map-style dataset, in the plan's layouts.

The seeds' data parallelism gives each replica ``num_shards`` / ``shard_id`` of the dataset. Here
the shards come from the plan: the ranks whose part of the input's batch dim is the same block
are one shard (a tensor-parallel group sees the same samples), and each rank's batches come out
as its part of the global batch, as ``ParallelModule`` takes them. Shuffling is a permutation
drawn from ``(seed, epoch)``, the same on every rank; the position is a ``state_dict``, so a
resumed run continues with the exact next batch.

    loader = autoshard.data.loader(dataset, pm, batch_size=32, seed=0)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            pm(*batch).backward()
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, Dataset, Sampler

from autoshard.layout import Layout

#: what happens to the samples past the last whole global batch of an epoch
END_OF_EPOCH = ("drop", "pad")


class ShardSampler(Sampler[int]):
    """The indices of one shard's part of every global batch of an epoch, in order.

    The epoch's order is a permutation of the dataset (or the identity without ``shuffle``);
    global batch ``b`` is its ``b``-th run of ``batch_size`` indices, and shard ``shard_id``
    takes the ``shard_id``-th of ``num_shards`` equal blocks of it. With ``end="drop"`` the last
    incomplete global batch is left out; with ``"pad"`` it is filled from the epoch's start, so
    every sample is seen at least once. ``start`` skips that many of this shard's batches."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        num_shards: int,
        shard_id: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        end: str = "drop",
    ) -> None:
        if end not in END_OF_EPOCH:
            raise ValueError(f"end={end!r}: expected one of {', '.join(END_OF_EPOCH)}")
        if batch_size % num_shards:
            raise ValueError(
                f"global batch {batch_size} does not divide into {num_shards} data-parallel "
                f"shards of the plan's input layout"
            )
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard {shard_id} of {num_shards}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.num_shards, self.shard_id = num_shards, shard_id
        self.shuffle, self.seed, self.end = shuffle, seed, end
        self.epoch = 0
        self.start = 0

    @property
    def num_batches(self) -> int:
        """Global batches in an epoch."""
        if self.end == "drop":
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def order(self) -> list[int]:
        """The epoch's order of the dataset, the same on every rank."""
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def batches(self) -> list[list[int]]:
        """This shard's indices, batch by batch, for the whole epoch."""
        order = self.order()
        needed = self.num_batches * self.batch_size
        order = (order * (needed // max(len(order), 1) + 1))[:needed]  # pad from the start
        local = self.batch_size // self.num_shards
        out = []
        for b in range(self.num_batches):
            first = b * self.batch_size + self.shard_id * local
            out.append(order[first : first + local])
        return out

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches()[self.start :]:
            yield from batch

    def __len__(self) -> int:
        return (self.num_batches - self.start) * (self.batch_size // self.num_shards)


class ShardLoader:
    """A ``torch.utils.data.DataLoader`` over one shard (``ShardSampler``) whose batches are cut
    to this rank's part of each input's layout, and whose position is a ``state_dict``."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        layouts: Sequence[Layout],
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        end: str = "drop",
        **loader_kwargs: Any,
    ) -> None:
        self.layouts, self.rank = list(layouts), rank
        shards = {batch_shard(layout, rank) for layout in self.layouts}
        # Inputs that split their batch dim differently (a plan may cut the targets by the
        # sequence): every rank reads whole global batches and cuts each input by its layout.
        # No layouts: whole global batches, uncut (a pipeline's).
        self.whole = len(shards) != 1
        num_shards, shard_id = (1, 0) if self.whole else shards.pop()
        for layout in self.layouts:
            if layout.shape[0] != batch_size:
                raise ValueError(
                    f"batch_size {batch_size} is not the plan's global batch {layout.shape[0]} "
                    f"(input {layout})"
                )
        self.sampler = ShardSampler(
            len(dataset), batch_size, num_shards, shard_id, shuffle=shuffle, seed=seed, end=end
        )
        self.local_batch = batch_size // num_shards
        self._loader = DataLoader(
            dataset, batch_size=self.local_batch, sampler=self.sampler, **loader_kwargs
        )
        self.position = 0  # batches of the current epoch handed out

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (its own order) from its first batch."""
        self.sampler.epoch, self.sampler.start, self.position = epoch, 0, 0

    def __len__(self) -> int:
        return self.sampler.num_batches - self.sampler.start

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            self.position += 1
            yield self._local(batch)
        self.sampler.epoch += 1
        self.sampler.start = self.position = 0

    def _local(self, batch: Any) -> Any:
        """Each tensor of a batch cut to this rank's part of its input's non-batch dims."""
        flat, spec = pytree.tree_flatten(batch)
        tensors = iter(self.layouts)
        out = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                layout = next(tensors, None)
                if layout is not None:
                    first = 0 if self.whole else 1  # else the sampler picked dim 0's block
                    index = layout.local_index(self.rank)[first:]
                    for dim, part in enumerate(index, start=first):
                        x = x[(slice(None),) * dim + (part,)]
            out.append(x)
        return pytree.tree_unflatten(out, spec)

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: the epoch and the batches of it already handed out."""
        return {"epoch": self.sampler.epoch, "position": self.position, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue with the batch after the one the saved loader handed out last."""
        if state.get("seed", self.sampler.seed) != self.sampler.seed:
            raise ValueError(f"state of a loader seeded {state['seed']}, not {self.sampler.seed}")
        self.sampler.epoch = state["epoch"]
        self.sampler.start = self.position = state["position"]


def batch_shard(layout: Layout, rank: int) -> tuple[int, int]:
    """(number of shards, this rank's shard) of a layout's batch dim (dim 0): the ranks holding
    the same block of it are one shard."""
    index = layout.local_index(rank)[0]
    if not isinstance(index, slice):
        raise ValueError(f"{layout}: the batch dim must be split in contiguous blocks")
    size = index.stop - index.start
    return layout.shape[0] // size, index.start // size


class _Inputs(Protocol):
    @property
    def inputs(self) -> Mapping[str, Layout]: ...


class Planned(Protocol):
    """What :func:`loader` reads of a ``runtime.ParallelModule``: its plan's input layouts,
    its inputs' names, its rank and whether it takes whole batches."""

    @property
    def plan(self) -> _Inputs: ...

    @property
    def input_names(self) -> Sequence[str]: ...

    @property
    def rank(self) -> int: ...

    #: whether forward takes whole global batches (a pipeline cuts them itself)
    whole_batch: bool

    #: the device the rank computes on
    device: torch.device


def loader(dataset: Dataset, pm: Planned, batch_size: int, **kwargs: Any) -> ShardLoader:
    """This rank's loader of ``dataset`` for a ParallelModule: its shard of every global batch
    of ``batch_size`` samples, cut to the plan's input layouts (a pipeline's: whole batches;
    ``shuffle``, ``seed``, ``end="drop"|"pad"`` and DataLoader options such as
    ``num_workers`` pass through). For a rank computing on CUDA its batches come in pinned
    memory (``pin_memory``, unless given), so moving them there does not block the host."""
    kwargs.setdefault("pin_memory", pm.device.type == "cuda")
    plan = pm.plan
    layouts = [] if pm.whole_batch else [plan.inputs[name] for name in pm.input_names]
    return ShardLoader(dataset, batch_size, layouts, pm.rank, **kwargs)


__all__ = ["END_OF_EPOCH", "ShardLoader", "ShardSampler", "batch_shard", "loader"]
