"""ZeRO's memory and communication (docs/zero.md): what a parameter sharded over its
data-parallel replicas costs each device.

:func:`model_states` is the ZeRO paper's accounting of model state per device (Ψ parameters,
``param_bytes`` and ``grad_bytes`` each, ``k`` bytes of optimizer state, n devices);
:func:`zero_param` is what autoshard's runtime holds and sends for one parameter, which the
estimate and the searches price.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.collectives import collective_parts, group_size
from autoshard.graph import OpGraph
from autoshard.layout import Layout
from autoshard.precision import Precision
from autoshard.redistribution import replica_sum_groups

#: an all-reduce's rank groups (``replica_sum_groups``), the same on every rank
Groups = tuple[tuple[int, ...], ...]


def model_states(
    psi: float, n: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2, k: float = 12
) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state at ZeRO ``stage`` (the
    ZeRO paper, section 5: stage 1 divides the optimizer state by ``n``, stage 2 the gradients
    too, stage 3 the parameters too)."""
    return {
        "parameters": psi * param_bytes / (n if stage >= 3 else 1),
        "gradients": psi * grad_bytes / (n if stage >= 2 else 1),
        "optimizer": psi * k / (n if stage >= 1 else 1),
    }


@dataclass(frozen=True)
class ZeroParam:
    """One parameter under ZeRO on one device: bytes held between steps, by kind, and the
    bytes of its unit's collectives (the whole local tensor in the compute dtype for the
    gathers, in the reduce dtype for the reduce-scatter) over ``group`` ranks, ``per_node`` of
    them in a node."""

    stage: int
    memory: dict[str, float]
    gathered: float
    summed: float
    group: int
    per_node: int
    share: float  # the fraction of the local tensor this device's optimizer steps
    copy: float  # seconds of backward adding the gradient into the unit's buffer, in line
    groups: Groups  # its all-reduce's groups (``zero_groups``), its unit's key

    def bandwidth(self, cluster: ClusterSpec) -> float:
        """The bandwidth terms of its share of the unit's collectives in a step: the
        reduce-scatter and the all-gather (twice at stage 3), latencies left out as a
        bucket's are (they are the unit's)."""
        gathers = 2 if self.stage == 3 else 1
        ag = collective_parts("all_gather", self.gathered, self.group, self.per_node, cluster)
        rs = collective_parts("reduce_scatter", self.summed, self.group, self.per_node, cluster)
        return gathers * ag[0] + rs[0]


def zero_param(
    stage: int,
    layout: Layout,
    grad: Layout,
    cluster: ClusterSpec,
    optimizer_states: int,
    compute: torch.dtype | None,
    reduce: torch.dtype | None,
) -> ZeroParam | None:
    """What a parameter stored as ``layout`` (its master dtype), whose gradient is ``grad``
    before its sum, costs at ZeRO ``stage``; None when ZeRO leaves it alone (stage 0, or a
    gradient sum that is not one all-reduce of data-parallel replicas)."""
    groups = zero_groups(stage, layout, grad)
    if groups is None:
        return None
    g, per_node = group_size(groups[0], cluster.devices_per_node)
    elements = layout.local_numel
    master = layout.dtype.itemsize
    c = (compute or layout.dtype).itemsize
    r = (reduce or layout.dtype).itemsize
    shard = elements * master / g
    memory = {
        "parameters": shard + (elements * c if stage < 3 else 0.0),
        "gradients": shard + (elements * r if stage == 1 else 0.0),
        "optimizer": optimizer_states * shard,
    }
    copy = elements * r / cluster.memory_bandwidth
    return ZeroParam(stage, memory, elements * c, elements * r, g, per_node, 1.0 / g, copy, groups)


def zero_groups(level: int, layout: Layout, grad: Layout | None) -> Groups | None:
    """Whether a trainable parameter stored as ``layout``, whose gradient is ``grad`` before
    its sum, is under ZeRO at ``level``, the one decision the runtime and the cost model read:
    the groups of its gradient's all-reduce (its data-parallel replicas), which it is sharded
    over; None when ZeRO leaves it alone (level 0, no sum, a sum that is not one all-reduce,
    or nothing held locally)."""
    if level == 0 or grad is None or layout.local_numel == 0:
        return None
    return replica_sum_groups(grad, layout.with_dtype(grad.dtype))


@dataclass(frozen=True)
class ZeroUnit:
    """Parameters gathered and summed together (``runtime.zero``): those of one ZeRO level
    and one all-reduce's groups whose first reader is in one block of the model (the root's
    outside any block: None), in the order of first use."""

    level: int
    groups: Groups
    block: tuple[str, int] | None
    members: tuple[str, ...]

    @property
    def name(self) -> str:
        return "root" if self.block is None else f"{self.block[0]}.{self.block[1]}"


def zero_units(og: OpGraph, members: Mapping[str, tuple[int, Groups]]) -> list[ZeroUnit]:
    """The ZeRO units of ``members`` (parameter -> its level and groups, from
    :func:`zero_groups`), ordered by their first use in ``og``: the runtime builds these and the
    estimate prices these."""
    order = og.first_use
    nodes = list(og.graph.nodes)
    units: dict[tuple, list[str]] = {}
    for fqn, (level, groups) in members.items():
        block = og[nodes[order[fqn]]].block if fqn in order else ("unused", 0)
        units.setdefault((level, groups, block), []).append(fqn)
    first = {key: min(order.get(f, len(nodes)) for f in fqns) for key, fqns in units.items()}
    return [ZeroUnit(*key, tuple(units[key])) for key in sorted(units, key=lambda k: first[k])]


def gather_parts(
    param_bytes: float, group: int, per_node: int, cluster: ClusterSpec
) -> tuple[float, float]:
    """(bandwidth, latency) of a unit's all-gather."""
    return collective_parts("all_gather", param_bytes, group, per_node, cluster)


def scatter_parts(
    grad_bytes: float, group: int, per_node: int, cluster: ClusterSpec
) -> tuple[float, float]:
    """(bandwidth, latency) of a unit's reduce-scatter."""
    return collective_parts("reduce_scatter", grad_bytes, group, per_node, cluster)


def master_layout(layout: Layout, precision: Precision | None) -> Layout:
    """A parameter's layout as a rank keeps it under ``precision``: in the master dtype where
    the graph computes in another (a graph captured under the policy holds the compute
    dtype's)."""
    if precision is None or precision.compute is None or not layout.dtype.is_floating_point:
        return layout
    return layout.with_dtype(precision.master or torch.float32)


def sum_dtype(precision: Precision | None) -> torch.dtype | None:
    """The dtype gradient sums travel in under ``precision``: its reduce dtype, else the
    master weights' (None without a mixed policy: the graph's own)."""
    if precision is None or precision.compute is None:
        return None
    return precision.reduce or precision.master or torch.float32


__all__ = [
    "Groups",
    "ZeroParam",
    "ZeroUnit",
    "gather_parts",
    "master_layout",
    "model_states",
    "scatter_parts",
    "sum_dtype",
    "zero_groups",
    "zero_param",
    "zero_units",
]
