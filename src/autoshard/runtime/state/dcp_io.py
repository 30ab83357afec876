"""What ``autoshard.save`` and ``load`` hand torch.distributed.checkpoint (DCP): its planners
with :class:`~autoshard.runtime.state.chunks.Chunks` values written and read as their boxes, and
its file writer keeping the names it wrote. Imported when a checkpoint is saved or loaded, not
before: DCP brings DTensor with it, a second of every ``autoshard`` command's start."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autoshard.runtime.state.chunks import Chunks
from autoshard.runtime.state.manifest import CheckpointError


class Writer(dcp.FileSystemWriter):
    """DCP's file writer, keeping the names of the files this rank wrote."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.written = super().write_data(plan, planner)
        return self.written

    def names(self) -> set[str]:
        written = getattr(self, "written", None)
        if written is None:  # this rank had nothing to write
            return set()
        return {result.storage_data.relative_path for result in written.wait()}


class SavePlanner(dcp.DefaultSavePlanner):
    """DCP's planner with :class:`Chunks` values written as their boxes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.chunked = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        rest = {k: v for k, v in state_dict.items() if not isinstance(v, Chunks)}
        super().set_up_planner(rest, storage_meta, is_coordinator)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, chunks in self.chunked.items():
            for start, sizes, view in chunks.boxes:
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(start)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size(start), torch.Size(sizes)),
                            properties=TensorProperties.create_from_tensor(view),
                            size=torch.Size(chunks.shape),
                        ),
                    )
                )
        self.plan = type(plan)(items, planner_data=plan.planner_data, usable=plan.usable)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        chunks = self.chunked.get(write_item.index.fqn)
        if chunks is None:
            return super().resolve_data(write_item)
        return chunks.find(write_item.index.offset).contiguous()


class LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner with :class:`Chunks` values read into their boxes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None, *args: Any, **kw: Any):
        self.chunked = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        rest = {k: v for k, v in state_dict.items() if not isinstance(v, Chunks)}
        missing = [k for k in self.chunked if k not in metadata.state_dict_metadata]
        if missing:
            raise CheckpointError(f"the checkpoint has no {missing[0]!r}")
        super().set_up_planner(rest, metadata, *args, **kw)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, chunks in self.chunked.items():
            saved = self.metadata.state_dict_metadata[fqn]
            if tuple(saved.size) != chunks.shape:
                raise CheckpointError(
                    f"{fqn} is {tuple(saved.size)} in the checkpoint, {chunks.shape} here"
                )
            local = [ChunkStorageMetadata(torch.Size(s), torch.Size(n)) for s, n, _ in chunks.boxes]
            items += create_read_items_for_chunk_list(fqn, saved, local)
        return type(plan)(items, planner_data=plan.planner_data)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        chunks = self.chunked.get(read_item.dest_index.fqn)
        if chunks is None:
            return super().resolve_tensor(read_item)
        box = chunks.find(read_item.dest_index.offset)
        for d, (start, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            box = box.narrow(d, start, n)
        return box
