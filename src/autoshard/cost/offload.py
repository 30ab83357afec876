"""Offload priced (docs/cost.md, "Offload"): what each kind of offload moves off the device,
where it lives instead (host or NVMe) and what the step waits for because of it.

The estimate of a plan without offload (``estimate``) is the starting point: :func:`with_offload`
moves bytes from its device tier to the host and NVMe tiers and adds the time of the
transfers and of the host's update on the step's timeline. What overlaps is priced on a
stream of its own (the device's copy engines and the host's cores are not the communication
stream) with ``timeline.exposed``:

- optimizer (fraction f of each stepped tensor): each gradient's tail goes to the host as it is
  final (at ZeRO 2-3 when its unit's reduce-scatter lands during backward; at ZeRO 0-1 after
  backward, when the buckets are waited), the host's AdamW runs after backward, and the
  updated chunks go back while later chunks update (a two-stage pipeline of ``CHUNK_BYTES``);
- parameters (ZeRO 3 shards): each shard comes from the host ahead of its unit's gathers,
  forward and backward, one unit ahead, hidden behind the compute of the unit before it;
- activations (blocks matched by a module glob): what they save for backward goes to the host
  during forward and comes back during backward, hidden behind that pass's compute;
- embeddings (tables matched by a module glob): the table, its gradient and its state stay on
  the host; the rows looked up come to the device and their gradients go back, in line; the
  host updates only the rows;
- NVMe: the host's optimizer state and master weights (and offloaded parameter shards) live in
  files; each step reads and writes them, streamed with the host's update.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.compute import local_bytes
from autoshard.cost.decisions import PlanDecisions
from autoshard.cost.estimate import ADAM_STATES, MEMORY_KINDS, Estimate, _as_run
from autoshard.cost.timeline import Overlapped, exposed
from autoshard.cost.zero import master_layout, zero_param
from autoshard.graph import OpGraph

#: the kinds of ``offload=`` (``Options.offload``)
OFFLOAD_KINDS = ("optimizer", "parameters", "activations", "embeddings", "nvme")
#: host master bytes stepped in one go before that chunk's copy back starts (the runtime's)
CHUNK_BYTES = 32 * 2**20
#: the host buffer NVMe-held state streams through, per device: read-ahead, update, write-behind
NVME_BUFFER_CHUNKS = 3


@dataclass(frozen=True)
class Offload:
    """What a plan offloads: ``optimizer`` the fraction of each stepped tensor whose master
    weights, gradient and optimizer state live on the host; ``parameters`` the ZeRO 3 shards
    between uses; ``activations`` and ``embeddings`` module globs; ``nvme`` whether the host's
    state is kept in files (the path where one is given)."""

    optimizer: float = 0.0
    parameters: bool = False
    activations: str | None = None
    embeddings: str | None = None
    nvme: str | bool = False

    @classmethod
    def of(cls, offload: Mapping[str, Any] | Offload | None) -> Offload:
        if isinstance(offload, Offload):
            return offload
        given = dict(offload or {})
        # NVMe alone holds the optimizer's state: the whole of it on the host first
        whole = given.get("nvme") and not given.get("parameters")
        fraction = given.get("optimizer", 1.0 if whole else 0.0)
        return cls(
            optimizer=1.0 if fraction is True else float(fraction or 0.0),
            parameters=bool(given.get("parameters", False)),
            activations=given.get("activations") or None,
            embeddings=given.get("embeddings") or None,
            nvme=given.get("nvme") or False,
        )

    def __bool__(self) -> bool:
        return bool(self.optimizer or self.parameters or self.activations or self.embeddings)

    def as_json(self) -> dict[str, Any]:
        """The kinds offloaded, as ``offload=`` takes them (none: an empty dict)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    def describe(self) -> str:
        parts = [f"optimizer {self.optimizer:g}"] * bool(self.optimizer)
        parts += ["parameters"] * self.parameters
        parts += [
            f"{k} {getattr(self, k)}" for k in ("activations", "embeddings") if getattr(self, k)
        ]
        return ", ".join(parts + ["on NVMe"] * bool(self.nvme)) or "nothing"


@dataclass
class OffloadEstimate(Estimate):
    """A plan's step with offload: ``memory`` is the device tier; ``host`` and ``nvme`` the
    bytes per device kept there, by kind; ``offload_s`` what the step waits for the
    offload's transfers and the host's update, ``offload_parts`` its terms."""

    offloaded: Offload = field(default_factory=Offload)
    host: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEMORY_KINDS, 0.0))
    nvme: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEMORY_KINDS, 0.0))
    offload_s: float = 0.0
    offload_parts: dict[str, float] = field(default_factory=dict)
    #: the device bytes the offload moved off (the layers' rows count them on the device)
    moved_off: float = 0.0

    @property
    def step_time(self) -> float:
        return super().step_time + self.offload_s

    def as_dict(self) -> dict[str, object]:
        return {
            **super().as_dict(),
            "offload": self.offloaded.as_json(),
            "offload_s": self.offload_s,
            "offload_parts_s": dict(self.offload_parts),
            "host_memory_bytes": {**self.host, "total": sum(self.host.values())},
            "nvme_memory_bytes": {**self.nvme, "total": sum(self.nvme.values())},
        }


@dataclass(frozen=True)
class _Stepped:
    """A trainable parameter as this device's optimizer steps it: its elements (its ZeRO
    shard), their master bytes, its ZeRO stage, where backward completes its gradient (0 at
    backward's start, 1 at its end), its copies in the real model and its device bytes."""

    fqn: str
    elements: float
    itemsize: int
    stage: int
    level: int  # the plan's ZeRO level for it (3 on one device too, where nothing is sharded)
    done: float
    count: int
    memory: dict[str, float]


def with_offload(
    est: Estimate,
    plan: PlanDecisions,
    og: OpGraph,
    cluster: ClusterSpec,
    offload: Mapping[str, Any] | Offload | None,
    depth: Mapping[str, int] | None = None,
) -> Estimate:
    """``est`` (the estimate of ``plan`` without offload) with ``offload`` priced; ``est``
    itself where nothing is offloaded."""
    choice = Offload.of(offload)
    if not choice:
        return est
    check_cluster(choice, cluster)
    out = OffloadEstimate(**{f.name: getattr(est, f.name) for f in fields(Estimate)})
    out.memory = dict(est.memory)
    out.offloaded = choice
    stepped = _stepped(plan, og, cluster, depth)
    parts = out.offload_parts
    if choice.embeddings:
        stepped = _embeddings(out, og, stepped, choice.embeddings, cluster)
    if choice.optimizer:
        parts |= _optimizer(out, stepped, choice.optimizer, cluster)
    if choice.parameters:
        parts |= _parameters(out, stepped, cluster, choice.optimizer)
    if choice.activations:
        parts |= _activations(out, og, choice.activations, cluster, depth)
    if choice.nvme:
        parts |= _nvme(out, cluster)
    out.offload_s = sum(parts.values())
    out.moved_off = est.peak_memory - out.peak_memory
    return out


def check_cluster(choice: Offload, cluster: ClusterSpec) -> None:
    """A cluster without the numbers an offload is priced by is an error naming them."""
    needed = ["host_memory_bytes", "host_bandwidth"] + ["host_adam_rate"] * bool(
        choice.optimizer or choice.embeddings
    )
    needed += ["nvme_bytes", "nvme_read_bandwidth", "nvme_write_bandwidth"] * bool(choice.nvme)
    missing = [name for name in needed if not getattr(cluster, name)]
    if missing:
        raise ValueError(
            f"offload {choice.describe()} on cluster {cluster.name!r}: it gives no "
            f"{', '.join(missing)}; set them in its JSON or measure them (autoshard calibrate)"
        )


def _stepped(
    plan: PlanDecisions, og: OpGraph, cluster: ClusterSpec, depth: Mapping[str, int] | None
) -> list[_Stepped]:
    """Every trainable parameter as this device steps it, in the order of first use."""
    sequence, copies = _as_run(og, depth)
    nodes = list(og.graph.nodes)
    trainable = {i.fqn for i in og.state() if i.kind == "param" and i.requires_grad}
    out = []
    for fqn, param in plan.params.items():
        if fqn not in trainable:
            continue
        kept = master_layout(param.layout, plan.precision)
        level = plan.zero_level(fqn)
        summed = not param.from_value and param.grad_partial is not None
        grad = param.grad_partial
        zp = zero_param(level, kept, grad, cluster, ADAM_STATES, None, None) if summed else None
        share = zp.share if zp is not None else 1.0
        size = local_bytes(kept)
        whole = {"parameters": size, "gradients": size, "optimizer": ADAM_STATES * size}
        memory = zp.memory if zp is not None else whole
        at = og.first_use.get(fqn, 0)
        out.append(
            _Stepped(
                fqn,
                kept.local_numel * share,
                kept.dtype.itemsize,
                zp.stage if zp else 0,
                level,
                1.0 - at / max(len(nodes), 1),
                copies.get(nodes[at], 1),
                memory,
            )  # fmt: skip
        )
    return sorted(out, key=lambda s: -s.done)


def _move(tier: dict[str, float], device: dict[str, float], kind: str, nbytes: float) -> None:
    device[kind] -= nbytes
    tier[kind] += nbytes


def _optimizer(
    est: OffloadEstimate, stepped: list[_Stepped], fraction: float, cluster: ClusterSpec
) -> dict[str, float]:
    """The optimizer's fraction on the host: the tails' gradients and state leave the
    device, the host holds their masters too; the device's update shrinks by the fraction."""
    backward_end = est.compute + est.comm_forward + est.comm_backward + est.grad_sync
    forward_end = est.compute_forward + est.comm_forward
    copies: list[Overlapped] = []
    elements = 0.0
    for s in stepped:
        tail = s.count * fraction * s.elements * s.itemsize
        _move(est.host, est.memory, "optimizer", ADAM_STATES * tail)
        _move(est.host, est.memory, "gradients", min(tail, s.count * s.memory["gradients"]))
        est.host["parameters"] += tail
        traffic = cluster.optimizer_passes * tail / cluster.memory_bandwidth
        est.optimizer -= traffic
        ready = (
            forward_end + (backward_end - forward_end) * s.done if s.stage >= 2 else backward_end
        )
        copies.append(Overlapped(tail / cluster.host_bandwidth, ready, backward_end))
        elements += s.count * fraction * s.elements
    itemsize = stepped[0].itemsize if stepped else 4
    update = elements / (cluster.host_adam_rate / cluster.devices_per_node)
    back = elements * itemsize / cluster.host_bandwidth
    return {
        "gradients_to_host": exposed(copies, cluster.overlap_efficiency),
        "host_update": pipelined([update, back], elements * itemsize),
    }


def pipelined(stages: list[float], nbytes: float, chunk: float = CHUNK_BYTES) -> float:
    """Seconds of a pipeline of ``stages`` (each its total seconds) over ``nbytes`` in chunks
    of ``chunk``: the slowest stage over every chunk plus the others over one chunk."""
    chunks = max(1, math.ceil(nbytes / chunk))
    slowest = max(stages, default=0.0)
    return slowest + (sum(stages) - slowest) / chunks


def _parameters(
    est: OffloadEstimate, stepped: list[_Stepped], cluster: ClusterSpec, fraction: float = 0.0
) -> dict[str, float]:
    """ZeRO 3 shards (a device's whole tensors where it has no replica) on the host between
    uses, each fetched one unit ahead of its gathers, forward and backward, behind the compute
    of the unit before it; the optimizer steps them there, so their state the optimizer's
    ``fraction`` left on the device is the host's too."""
    sharded = [s for s in stepped if s.level == 3]
    if not sharded:
        raise ValueError("offload parameters: no parameter is at ZeRO 3 (plan with zero=3)")
    forward, backward = est.compute_forward, est.compute_backward
    ahead: dict[str, list[Overlapped]] = {"forward": [], "backward": []}
    before = {"forward": 0.0, "backward": 0.0}
    for s in sorted(sharded, key=lambda s: s.done, reverse=True):  # forward's order
        shard = s.count * s.elements * s.itemsize
        _move(est.host, est.memory, "parameters", min(shard, s.count * s.memory["parameters"]))
        left = s.count * s.memory["optimizer"] * (1.0 - fraction)
        _move(est.host, est.memory, "optimizer", min(ADAM_STATES * shard * (1.0 - fraction), left))
        seconds = shard / cluster.host_bandwidth
        at = {"forward": (1.0 - s.done) * forward, "backward": s.done * backward}
        for run, items in ahead.items():
            items.append(Overlapped(seconds, before[run], at[run]))
            before[run] = at[run]
    eff = cluster.overlap_efficiency
    return {
        "parameters_forward": exposed(ahead["forward"], eff),
        "parameters_backward": exposed(sorted(ahead["backward"], key=lambda o: o.ready), eff),
    }


def _activations(
    est: OffloadEstimate,
    og: OpGraph,
    glob: str,
    cluster: ClusterSpec,
    depth: Mapping[str, int] | None,
) -> dict[str, float]:
    """What the blocks matched by ``glob`` save for backward, on the host between the two
    passes; two blocks' worth stays on the device (one being sent, one coming back)."""
    _, copies = _as_run(og, depth)
    blocks: dict[tuple, float] = {}
    for node in og.graph.nodes:
        info = og[node]
        if node.op == "placeholder" or node.name not in est.by_node:
            continue
        if not _matches(info.path, glob):
            continue
        saved = est.by_node[node.name][0].memory["activations"]
        blocks[info.block or (info.path, 0)] = blocks.get(info.block or (info.path, 0), 0.0)
        blocks[info.block or (info.path, 0)] += saved * copies.get(node, 1)
    if not blocks:
        raise ValueError(f"offload activations {glob!r}: matches no module of the model")
    total = sum(blocks.values())
    kept = min(total, 2 * max(blocks.values()))
    _move(est.host, est.memory, "activations", total - kept)
    seconds = (total - kept) / cluster.host_bandwidth
    eff = cluster.overlap_efficiency
    return {
        "activations_to_host": exposed([Overlapped(seconds, 0.0, est.compute_forward)], eff),
        "activations_back": exposed([Overlapped(seconds, 0.0, est.compute_backward)], eff),
    }


def _matches(path: str, glob: str) -> bool:
    """Whether module ``path`` is one ``glob`` names or inside one."""
    return fnmatch.fnmatchcase(path, glob) or fnmatch.fnmatchcase(path, glob + ".*")


def _embeddings(
    est: OffloadEstimate,
    og: OpGraph,
    stepped: list[_Stepped],
    glob: str,
    cluster: ClusterSpec,
) -> list[_Stepped]:
    """The tables an embedding lookup reads in the modules ``glob`` names, wholly on the
    host with their gradients and state; the rows looked up come in and their gradients go
    out in line; the host updates those rows. Returns the parameters left to the others."""
    looked_up: dict[str, float] = {}
    for info in og.ops():
        if info.op.startswith("embedding") and _matches(info.path, glob):
            for fqn in info.params:
                looked_up[fqn] = looked_up.get(fqn, 0.0) + math.prod(info.out_shapes[0])
    tables = [s for s in stepped if s.fqn in looked_up]
    if not tables:
        raise ValueError(f"offload embeddings {glob!r}: no embedding lookup in those modules")
    rows = 0.0
    for s in tables:
        for kind, nbytes in s.memory.items():
            _move(est.host, est.memory, kind, s.count * nbytes)
        traffic = cluster.optimizer_passes * s.elements * s.itemsize
        est.optimizer -= traffic / cluster.memory_bandwidth
        rows += min(looked_up[s.fqn], s.elements) * s.itemsize
    est.offload_parts["embedding_rows"] = 2 * rows / cluster.host_bandwidth
    rate = cluster.host_adam_rate / cluster.devices_per_node
    est.offload_parts["embedding_update"] = rows / tables[0].itemsize / rate
    return [s for s in stepped if s.fqn not in looked_up]


def _nvme(est: OffloadEstimate, cluster: ClusterSpec) -> dict[str, float]:
    """The host's masters, optimizer state and parameter shards in files, read and written
    each step through a buffer of ``NVME_BUFFER_CHUNKS`` chunks, streamed with the update."""
    state = est.host["optimizer"] + est.host["parameters"]
    if not state:
        raise ValueError("offload nvme: nothing is on the host to keep in files")
    buffer = min(state, NVME_BUFFER_CHUNKS * CHUNK_BYTES)
    for kind in ("optimizer", "parameters"):
        _move(est.nvme, est.host, kind, est.host[kind] * (1 - buffer / state))
    per_device = cluster.devices_per_node
    read = state / (cluster.nvme_read_bandwidth / per_device)
    write = state / (cluster.nvme_write_bandwidth / per_device)
    update = est.offload_parts.get("host_update", 0.0)
    streamed = pipelined([read, update, write], state)
    return (
        {"host_update": streamed} if "host_update" in est.offload_parts else {"nvme": read + write}
    )


def tiers_fit(est: Any, cluster: ClusterSpec) -> str | None:
    """What does not fit of an offloaded estimate's host and NVMe tiers, per device (a node's
    host memory and drives shared by its devices), or None; a pipeline's
    (``cost.pipeline.OffloadPipelineEstimate``) by its rank holding the most."""
    if not hasattr(est, "nvme"):
        return None
    over = []
    for tier, held, room in (
        ("host", est.host, cluster.host_memory_bytes),
        ("NVMe", est.nvme, cluster.nvme_bytes),
    ):
        share = room / cluster.devices_per_node
        if sum(held.values()) > share:
            over.append(f"{tier} {sum(held.values()) / 2**30:.1f} GiB > {share / 2**30:.1f} GiB")
    return "; ".join(over) or None


def host_parts(elements: float, itemsize: int, fraction: float, cluster: ClusterSpec) -> float:
    """The search's price of a tensor's offloaded update (its ``elements`` stepped, their
    master ``itemsize``): the host's AdamW and the copy back, in line, less the device's share
    of the update the host takes over."""
    moved = fraction * elements
    update = moved / (cluster.host_adam_rate / cluster.devices_per_node)
    back = moved * itemsize / cluster.host_bandwidth
    device = cluster.optimizer_passes * moved * itemsize / cluster.memory_bandwidth
    return max(update, back) - device


#: the offloads a search tries where nothing fits without, in order: from the least moved
LADDER = (
    Offload(optimizer=1.0),
    Offload(optimizer=1.0, parameters=True),
    Offload(optimizer=1.0, nvme=True),
    Offload(optimizer=1.0, parameters=True, nvme=True),
)


def ladder(cluster: ClusterSpec, zero: int | None, staged: bool = False) -> list[Offload]:
    """The ``LADDER``'s offloads ``cluster`` gives the numbers of and ZeRO ``zero`` (None:
    searched) allows; with pipeline stages (``staged``) the optimizer's alone (a pipeline
    regathers ZeRO 3's shards every micro-batch, which its pricing does not hold)."""
    out = []
    for choice in LADDER:
        try:
            check_cluster(choice, cluster)
        except ValueError:
            continue
        if (zero in (None, 3) and not staged) or not choice.parameters:
            out.append(choice)
    return out


def device_bytes(memory: Mapping[str, float], stage: int, choice: Offload) -> float:
    """A parameter's device bytes (``memory``: by kind, without offload) under ``choice``
    (the search's memory of it): the optimizer fraction of its state and shard gradient, and at
    ZeRO 3 with parameters its shard, are the host's."""
    states = memory.get("optimizer", 0.0)
    shard = states / ADAM_STATES
    kept = sum(memory.values()) - choice.optimizer * (states + min(shard, memory["gradients"]))
    if choice.parameters and stage == 3:
        kept -= min(shard, memory["parameters"])
    return kept


__all__ = [
    "CHUNK_BYTES",
    "LADDER",
    "OFFLOAD_KINDS",
    "Offload",
    "OffloadEstimate",
    "check_cluster",
    "device_bytes",
    "host_parts",
    "ladder",
    "pipelined",
    "tiers_fit",
    "with_offload",
]
