"""``ClusterSpec``: what the cost model knows about the machines a plan is for (docs/search.md).

Ranks are numbered node-major (rank ``r`` lives on node ``r // devices_per_node``). Collective
times are alpha-beta with ring formulas, on the intra-node link when the group stays in one node
and on the inter-node link otherwise.
"""

from __future__ import annotations

import json
import math
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
    """A cluster of ``nodes`` x ``devices_per_node`` identical devices (docs/cost.md).

    ``flops``: peak FLOP/s per dtype name. ``matmul_efficiency``: the share of peak a matrix
    product reaches, as ``[size, share]`` points over the cube root of its M*N*K (interpolated in
    log size; beyond the ends, the end values); ``attention_efficiency``: the share of peak a
    fused attention kernel that returns the log-sum-exp reaches, forward and backward (flash,
    cuDNN or memory-efficient on CUDA, flash on CPU: what ``scaled_dot_product_attention`` and
    the ring's blocks run, ``ops.blocks.kernel``); ``grouped_mm_efficiency``: the share of a
    separate product's speed at one expert's size that the experts' grouped product
    (``torch._grouped_mm``, ``ops.grouped``) reaches. ``memory_bandwidth``: achievable
    bytes/s of a streaming kernel; ``op_overhead``: seconds each kernel (or CPU op) costs beyond
    its work; ``sync_wait``: the share of its compute a rank of a parallel job waits for the
    slowest rank at the collectives that synchronize them (stragglers; a shared host's
    scheduler); ``collective_factors``: a collective kind's measured time over the link
    model's (calibrated; 1 when absent). Links: bytes/s of bus bandwidth per device (the
    inter-node one is a device's share of its node's network) and seconds of latency per step
    of a collective.
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
    matmul_efficiency: list[list[float]] = field(default_factory=list)
    attention_efficiency: list[float] = field(default_factory=lambda: [1.0, 1.0])
    #: bytes of memory traffic per attention score element, forward and backward, where the
    #: software materializes the scores (softmax, mask and dropout as separate passes over
    #: them); [0, 0]: a fused kernel, priced by ``attention_efficiency``
    attention_score_bytes: list[float] = field(default_factory=lambda: [0.0, 0.0])
    #: the experts' grouped product over a separate product of one expert's size (1: as fast)
    grouped_mm_efficiency: float = 1.0
    #: bytes of memory traffic per logit element of a cross-entropy, forward and backward,
    #: where the software computes it by separate passes in float32 (a cast, the max, the
    #: shift, the exponential, the sum and the division, each through memory); [0, 0]: the
    #: op's own reads and writes, as autoshard runs it
    loss_bytes: list[float] = field(default_factory=lambda: [0.0, 0.0])
    #: the share of its compute a rank waits at synchronizing collectives for the slowest rank
    sync_wait: float = 0.0
    #: measured time of a collective kind over what the link model prices it at (1 when
    #: absent: NCCL's reduce-scatter and all-gather run at the model's ring speed; gloo's do
    #: not, and ``autoshard calibrate`` measures by how much)
    collective_factors: dict[str, float] = field(default_factory=dict)
    #: the share of the overlap a timeline of separate compute and communication streams
    #: promises that really happens (1: GPUs, whose transfers run on their own engines; on
    #: CPU ranks the transfers take the cores the compute needs, and calibrate measures it)
    overlap_efficiency: float = 1.0
    #: whether the software runs a tensor-parallel all-gather into a matrix product, or a
    #: reduce-scatter out of one, in chunks under the product (Megatron-Core's
    #: ``--tp-comm-overlap``; ``collectives.move_time``): the presets' software does not
    tp_comm_overlap: bool = False
    #: the host beside the devices, per node (docs/parallelism/offload.md; 0: not known, nothing is
    #: offloaded there): its memory in bytes, and its fused CPU AdamW throughput in parameter
    #: elements a second on all its cores (shared by the node's devices)
    host_memory_bytes: float = 0.0
    host_adam_rate: float = 0.0
    #: bytes/s each way between one device and the host (its own PCIe link; 0: not known)
    host_bandwidth: float = 0.0
    #: the node's NVMe drives together: bytes they hold and their read and write bytes/s
    nvme_bytes: float = 0.0
    nvme_read_bandwidth: float = 0.0
    nvme_write_bandwidth: float = 0.0
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

    def link(self, crosses: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the link a group uses."""
        if crosses:
            return self.inter_bandwidth, self.inter_latency
        return self.intra_bandwidth, self.intra_latency

    # -- compute -------------------------------------------------------------------------------

    def matmul_share(self, size: float) -> float:
        """The share of peak a matrix product of cube-root size ``size`` reaches."""
        points = self.matmul_efficiency
        if not points:
            return 1.0
        if size <= points[0][0]:
            return points[0][1]
        for (s0, e0), (s1, e1) in zip(points, points[1:], strict=False):
            if size <= s1:
                t = math.log(size / s0) / math.log(s1 / s0)
                return e0 + t * (e1 - e0)
        return points[-1][1]

    def compute_time(self, cost: Any, dtype: torch.dtype, backward: bool = False) -> float:
        """Seconds of one op's forward (or backward) on one device: its FLOPs at the share of
        peak its kind and size reach, or its bytes at the memory bandwidth, whichever is slower,
        plus the per-op overhead (a backward with nothing to do costs nothing)."""
        flops = cost.backward_flops if backward else cost.flops
        nbytes = cost.backward_bytes if backward else cost.bytes
        if backward and not flops and not nbytes:
            return 0.0
        if cost.kind == "loss" and self.loss_bytes[1 if backward else 0]:
            nbytes = cost.scores * self.loss_bytes[1 if backward else 0]
        scored = self.attention_score_bytes[1 if backward else 0] if cost.kind == "attention" else 0
        if scored:  # unfused: two batched products, the scores' passes through memory beside
            share = self.matmul_share(math.inf)
            passes = cost.scores * scored / self.memory_bandwidth
        elif cost.kind == "attention":
            share, passes = self.attention_efficiency[1 if backward else 0], 0.0
        else:
            share = self.matmul_share(cost.size) if cost.kind in ("matmul", "grouped_mm") else 1.0
            share *= self.grouped_mm_efficiency if cost.kind == "grouped_mm" else 1.0
            passes = 0.0
        work = flops * cost.work / (self.peak_flops(dtype) * share) if flops else 0.0
        return max(work, nbytes / self.memory_bandwidth) + passes + self.op_overhead

    # -- files -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterSpec:
        known = {f for f in cls.__dataclass_fields__}
        data = {k: v for k, v in data.items() if k not in _RETIRED}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"cluster spec: unknown fields {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        return cls.from_json(json.loads(Path(path).read_text()))


#: fields older specs carry that no longer mean anything (overlap is the runtime's, docs/cost.md)
_RETIRED = {"overlap"}

_GB = 1e9
_GIB = 1024**3

# Where each preset number comes from: docs/cost.md ("Presets").
PRESETS: dict[str, ClusterSpec] = {
    # 8 x A100-SXM4-80GB, NVLink3 + NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node.
    "dgx-a100": ClusterSpec(
        name="dgx-a100",
        nodes=1,
        devices_per_node=8,
        flops={"bfloat16": 312e12, "float16": 312e12, "float32": 156e12, "float64": 19.5e12},
        memory_bytes=80 * _GIB,
        memory_bandwidth=1790 * _GB,
        intra_bandwidth=235 * _GB,
        intra_latency=2e-6,
        inter_bandwidth=23 * _GB,
        inter_latency=5e-6,
        op_overhead=5e-6,
        optimizer_passes=7.0,
        host_memory_bytes=1000 * _GB,
        host_adam_rate=7e9,
        host_bandwidth=25 * _GB,
        nvme_bytes=4 * 3.84e12,
        nvme_read_bandwidth=4 * 7 * _GB,
        nvme_write_bandwidth=4 * 3.8 * _GB,
        matmul_efficiency=[
            [128, 0.02],
            [256, 0.08],
            [512, 0.25],
            [1024, 0.42],
            [2048, 0.7],
            [4096, 0.75],
            [8192, 0.765],
        ],
        attention_efficiency=[0.6, 0.5],
    ),
    # 8 x H100-SXM5-80GB, NVLink4 + NVSwitch, 8 x 400 Gb/s NDR InfiniBand per node.
    "dgx-h100": ClusterSpec(
        name="dgx-h100",
        nodes=1,
        devices_per_node=8,
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 494e12, "float64": 67e12},
        memory_bytes=80 * _GIB,
        memory_bandwidth=3000 * _GB,
        intra_bandwidth=450 * _GB,
        intra_latency=1.5e-6,
        inter_bandwidth=46 * _GB,
        inter_latency=5e-6,
        op_overhead=4e-6,
        optimizer_passes=7.0,
        host_memory_bytes=2000 * _GB,
        host_adam_rate=1e10,
        host_bandwidth=55 * _GB,
        nvme_bytes=8 * 3.84e12,
        nvme_read_bandwidth=8 * 7 * _GB,
        nvme_write_bandwidth=8 * 3.8 * _GB,
        matmul_efficiency=[
            [128, 0.01],
            [256, 0.035],
            [512, 0.12],
            [1024, 0.3],
            [2048, 0.57],
            [4096, 0.67],
            [8192, 0.70],
        ],
        attention_efficiency=[0.45, 0.35],
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
        # gloo's threads sum and copy on the cores the ranks compute on: `autoshard
        # calibrate` measures 0 to 0.3 of a collective hidden beside compute (docs/cost.md)
        overlap_efficiency=0.0,
        host_memory_bytes=8 * _GIB,
        # measured here, not guessed (`autoshard calibrate`'s `calibrate_host`, a quiet run of
        # `python -m bench offload`): torch's fused AdamW on both cores 0.97e9 elements/s,
        # copies between host tensors 8.45 GB/s
        host_adam_rate=9.7e8,
        host_bandwidth=8.45 * _GB,
        nvme_bytes=50 * _GB,
        nvme_read_bandwidth=1 * _GB,
        nvme_write_bandwidth=0.5 * _GB,
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
