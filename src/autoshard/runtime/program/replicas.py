"""Replicas start equal: every rank holding the same part of a parameter or buffer holds the
same values before the first step.

A layout's replica group is the ranks whose local part is the same block of the tensor (the
ranks that differ only on its replicated mesh axes). ``"broadcast"`` copies the first rank's
part to the others, one flat broadcast per group and dtype (as DDP does at construction);
``"check"`` compares a fingerprint of each part across its group and names the parameter and
the rank that differs; ``"none"`` trusts the user.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.distributed as dist

from autoshard import comm
from autoshard.layout import Layout
from autoshard.options import REPLICAS as MODES


class ReplicaMismatchError(ValueError):
    """Ranks that should hold the same part of a parameter hold different values."""


def replica_group(layout: Layout, rank: int) -> tuple[int, ...]:
    """The ranks holding the same part of the tensor as ``rank`` (first one first)."""
    mine = repr(layout.local_index(rank))
    return tuple(r for r in layout.ranks if repr(layout.local_index(r)) == mine)


def sync_replicas(
    tensors: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout], rank: int, mode: str
) -> None:
    """Make (or check) every replica group's parts equal; a collective of all ranks."""
    if mode not in MODES:
        raise ValueError(f"replicas={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "none" or not (dist.is_available() and dist.is_initialized()):
        return
    groups: dict[tuple, list[str]] = defaultdict(list)
    for fqn, layout in layouts.items():
        group = replica_group(layout, rank)
        if len(group) > 1:
            everyone = tuple(sorted({replica_group(layout, r) for r in layout.ranks}))
            groups[(everyone, group, str(tensors[fqn].dtype))].append(fqn)
    # The same order on every rank, one partition of the ranks into groups at a time: torch
    # names a group made by its members alone after how many groups each has made, so members
    # must make theirs in step (by rank 0's own groups first, rank 0 would make (0,1) then
    # (0,2) while rank 2 makes (0,2) first, and the two never meet). Names in the plan's order.
    problems = []
    for (_, group, _), names in sorted(groups.items()):
        if mode == "broadcast":
            _broadcast(group, [tensors[n] for n in names])
        else:
            problems += _check(group, names, tensors)
    if mode == "check":
        # Every rank takes the same decision, so none goes on to train alone and hang.
        everyone = comm.all_gather_object(problems)
        found = sorted({p for ps in everyone for p in ps})
        if found:
            raise ReplicaMismatchError(
                f"{found[0]}; seed every rank alike or use replicas='broadcast'"
                + (f" ({len(found) - 1} more)" if len(found) > 1 else "")
            )


def _broadcast(group: tuple[int, ...], parts: list[torch.Tensor]) -> None:
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in parts])
        comm.broadcast_(flat, group)
        offset = 0
        for p in parts:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def _check(group: tuple[int, ...], names: list[str], tensors: Mapping[str, torch.Tensor]) -> list:
    """What differs in this group: one line per (rank, parameter) unlike the group's first."""
    mine = [_fingerprint(tensors[n]) for n in names]
    everyone = comm.all_gather_object(mine, group)
    return [
        f"rank {member} holds other values of {name} than rank {group[0]}, which should hold "
        f"the same part"
        for member, theirs in zip(group, everyone, strict=True)
        for name, a, b in zip(names, everyone[0], theirs, strict=True)
        if a != b
    ]


__all__ = ["MODES", "ReplicaMismatchError", "replica_group", "sync_replicas"]
