"""``ClusterSpec``: what the cost model knows about the machines a plan is for (docs/search.md).

Ranks are numbered node-major (rank ``r`` lives on node ``r // devices_per_node``). Collective
times are alpha-beta with ring formulas, on the intra-node link when the group stays in one node
and on the inter-node link otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

_DTYPE_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


@dataclass(frozen=True, eq=False)
class ClusterSpec:
    """A cluster of ``nodes`` x ``devices_per_node`` identical devices.

    Bandwidths are bytes/s per device (the inter-node one is a device's share of its node's
    network), latencies seconds per message, ``flops`` peak FLOP/s per dtype name.
    ``optimizer_passes``: bytes of memory traffic of one AdamW step per parameter byte (torch's
    default per-tensor and foreach AdamW make about 20 passes; a fused kernel about 7)."""

    name: str
    nodes: int
    devices_per_node: int
    flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    op_overhead: float = 5e-6
    optimizer_passes: float = 20.0
    overlap: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def peak_flops(self, dtype: torch.dtype) -> float:
        name = _DTYPE_NAMES.get(dtype, "float32")
        if name in self.flops:
            return self.flops[name]
        return self.flops.get("float32") or max(self.flops.values())

    def with_devices(self, num_devices: int) -> ClusterSpec:
        """The same machines, ``num_devices`` of them (whole nodes, or part of one)."""
        if num_devices <= self.devices_per_node:
            return replace(self, nodes=1, devices_per_node=num_devices)
        if num_devices % self.devices_per_node:
            raise ValueError(
                f"{num_devices} devices is not a whole number of {self.devices_per_node}-device "
                f"nodes of {self.name}"
            )
        return replace(self, nodes=num_devices // self.devices_per_node)

    # -- communication ---------------------------------------------------------------------

    def spans_nodes(self, group: Iterable[int]) -> bool:
        return len({r // self.devices_per_node for r in group}) > 1

    def link(self, crosses: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the link a group uses."""
        if crosses:
            return self.inter_bandwidth, self.inter_latency
        return self.intra_bandwidth, self.intra_latency

    def collective_time(self, kind: str, nbytes: float, group_size: int, crosses: bool) -> float:
        """Seconds for one collective of ``kind`` moving ``nbytes`` (per rank: the input of an
        all-reduce / reduce-scatter / all-to-all, the output of an all-gather): ring bandwidth,
        tree latency (``log2`` steps), as collective libraries pick per message size."""
        g = group_size
        if g <= 1 or nbytes <= 0:
            return 0.0
        bw, _ = self.link(crosses)
        if kind == "all_reduce":
            volume = 2 * (g - 1) / g * nbytes
        elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
            volume = (g - 1) / g * nbytes
        elif kind == "send_recv":
            volume = nbytes
        else:
            raise ValueError(f"unknown collective {kind!r}")
        return volume / bw + self.collective_latency(kind, g, crosses)

    def collective_latency(self, kind: str, group_size: int, crosses: bool) -> float:
        """The latency term of :meth:`collective_time`."""
        g = group_size
        if g <= 1:
            return 0.0
        _, alpha = self.link(crosses)
        steps = math.ceil(math.log2(g))
        if kind == "all_reduce":
            return 2 * steps * alpha
        if kind in ("all_gather", "reduce_scatter"):
            return steps * alpha
        if kind == "all_to_all":
            return (g - 1) * alpha
        return alpha

    def compute_time(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        return (
            max(flops / self.peak_flops(dtype), nbytes / self.memory_bandwidth) + self.op_overhead
        )

    # -- files -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"cluster spec: unknown fields {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        return cls.from_json(json.loads(Path(path).read_text()))


_GB = 1e9
_GIB = 1024**3

PRESETS: dict[str, ClusterSpec] = {
    # 8 x A100-SXM4-80GB, NVLink3 (300 GB/s per direction per GPU), 8 x 200 Gb/s HDR per node.
    "dgx-a100": ClusterSpec(
        name="dgx-a100",
        nodes=1,
        devices_per_node=8,
        flops={"bfloat16": 312e12, "float16": 312e12, "float32": 156e12, "float64": 19.5e12},
        memory_bytes=80 * _GIB,
        memory_bandwidth=2039 * _GB,
        intra_bandwidth=240 * _GB,
        intra_latency=5e-6,
        inter_bandwidth=23 * _GB,
        inter_latency=1e-5,
        op_overhead=5e-6,
        overlap=False,  # the runtime reduces gradients synchronously (docs/search.md)
    ),
    # 8 x H100-SXM5-80GB, NVLink4 (450 GB/s per direction per GPU), 8 x 400 Gb/s NDR per node.
    "dgx-h100": ClusterSpec(
        name="dgx-h100",
        nodes=1,
        devices_per_node=8,
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 494e12, "float64": 67e12},
        memory_bytes=80 * _GIB,
        memory_bandwidth=3350 * _GB,
        intra_bandwidth=360 * _GB,
        intra_latency=4e-6,
        inter_bandwidth=46 * _GB,
        inter_latency=8e-6,
        op_overhead=4e-6,
        overlap=False,  # the runtime reduces gradients synchronously (docs/search.md)
    ),
    # This kind of machine: 2 CPU ranks of one thread each, gloo over loopback. Rough; run
    # `autoshard calibrate` for measured numbers.
    "cpu": ClusterSpec(
        name="cpu",
        nodes=1,
        devices_per_node=2,
        flops={"float32": 5e10, "float64": 2.5e10},
        memory_bytes=8 * _GIB,
        memory_bandwidth=8 * _GB,
        intra_bandwidth=1 * _GB,
        intra_latency=4e-5,
        inter_bandwidth=0.5 * _GB,
        inter_latency=1e-4,
        op_overhead=1e-5,
        overlap=False,
    ),
}


def cluster_spec(
    spec: str | ClusterSpec | dict | None, num_devices: int | None = None
) -> ClusterSpec:
    """A preset name, a JSON path, a dict or a ClusterSpec; resized to ``num_devices``."""
    if spec is None:
        spec = "cpu"
    if isinstance(spec, str):
        if spec in PRESETS:
            spec = PRESETS[spec]
        elif Path(spec).is_file():
            spec = ClusterSpec.load(spec)
        else:
            raise ValueError(
                f"cluster {spec!r}: not a preset ({', '.join(PRESETS)}) nor a JSON file"
            )
    elif isinstance(spec, dict):
        spec = ClusterSpec.from_json(spec)
    if num_devices is not None and num_devices != spec.num_devices:
        spec = spec.with_devices(num_devices)
    return spec


__all__ = ["PRESETS", "ClusterSpec", "cluster_spec"]
