"""ZeRO's units of a plan on one rank (``cost.zero_units``, as the estimate prices them), made
into the shards, gathers and sums of ``zero.Zero``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autoshard.cost.zero import zero_groups, zero_units
from autoshard.graph import OpGraph
from autoshard.runtime.program.zero import Fetch, Zero
from autoshard.search import Plan


def build_zero(
    og: OpGraph,
    plan: Plan,
    tensors: dict[str, torch.Tensor],
    rank: int,
    reduce: torch.dtype | None,
    reshard_after_forward: bool,
    device: torch.device | None = None,
    host: Any = None,
) -> tuple[Zero, dict[str, Fetch], dict[str, nn.Parameter]]:
    """The ZeRO units of ``plan`` on this rank (``cost.zero_units``, as the estimate prices
    them): every trainable parameter ``cost.zero_groups`` puts under ZeRO, in units by
    (stage, group, block of its first reader), ordered by first use. Returns the units, what
    the program calls in place of each parameter, and the shards the optimizer steps. A tensor
    on the meta device (a model built there) gets an unset shard on ``device``; ``host`` (a
    ``HostTier``): the shards of stage 3 are made there."""
    zero = Zero(rank, reshard_after_forward, device, host)
    dtypes = {i.fqn: i.dtype for i in og.state()}
    members = {}
    for fqn, p in plan.params.items():
        t = tensors.get(fqn)
        if p.from_value or t is None or not t.requires_grad:
            continue
        groups = zero_groups(plan.zero_level(fqn), p.layout, p.grad_partial)
        if groups is not None and any(rank in g for g in groups):
            members[fqn] = (plan.zero_level(fqn), groups)
    fetchers, shards = {}, {}
    for unit in zero_units(og, members):
        group = next(g for g in unit.groups if rank in g)
        tensors_of = {fqn: tensors[fqn] for fqn in unit.members}
        made = zero.add_unit(
            unit.name, unit.level, group, tensors_of, dtypes, reduce, set(og.first_use)
        )
        shards |= made
        fetchers |= {fqn: Fetch(zero, fqn) for fqn in made}
    return zero, fetchers, shards


__all__ = ["build_zero"]
