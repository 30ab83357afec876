"""ZeRO's memory and communication (docs/zero.md): what a parameter sharded over its
data-parallel replicas costs each device.

:func:`model_states` is the ZeRO paper's accounting of model state per device (Ψ parameters,
``param_bytes`` and ``grad_bytes`` each, ``k`` bytes of optimizer state, n devices);
:func:`zero_param` is what autoshard's runtime holds and sends for one parameter, which the
estimate and the searches price.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.collectives import collective_parts, reduce_group
from autoshard.layout import Layout


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
    if stage == 0 or not grad.partial:
        return None
    found = reduce_group(grad, layout, cluster)
    if found is None:
        return None
    g, per_node = found
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
    return ZeroParam(stage, memory, elements * c, elements * r, g, per_node, 1.0 / g, copy)


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


__all__ = ["ZeroParam", "gather_parts", "model_states", "scatter_parts", "zero_param"]
