"""A whole plan's predicted step time and memory per device (docs/cost.md).

Step time is compute plus the communication the compute waits for: every redistribution and
gradient sum the runtime runs in line is exposed; communication the runtime runs beside compute
(:class:`Overlapped`) is hidden as far as a timeline of one compute and one communication stream
says it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.collectives import bucket_latency, grad_sync, transition
from autoshard.cost.compute import local_bytes, op_time, optimizer_time, saves_output
from autoshard.graph import OpGraph
from autoshard.ops import tensor_inputs

#: optimizer state values per parameter element (Adam's two moments)
ADAM_STATES = 2


@dataclass(frozen=True)
class Overlapped:
    """Communication the runtime runs beside compute: ``seconds`` on the communication stream,
    started once ``ready`` seconds of the step's in-line work have run (a bucket's last
    gradient is made), and waited for at ``due`` (the optimizer reads the gradients)."""

    seconds: float
    ready: float
    due: float


def exposed(overlapped: list[Overlapped]) -> float:
    """Seconds the in-line work waits for overlapped communication: one communication stream
    runs the transfers in the order they become ready; the in-line work stalls when it reaches
    a transfer's due point before the transfer ends, which delays everything after it."""
    delay = stream = 0.0
    for item in sorted(overlapped, key=lambda o: o.ready):
        start = max(stream, item.ready + delay)
        stream = start + item.seconds
        delay = max(delay, stream - item.due)
    return delay


@dataclass
class Estimate:
    """A plan's predicted step time (seconds) and memory per device (bytes), by kind. The
    communication fields are in line with compute (the step waits for them); ``overlapped``
    is what runs beside it."""

    compute_forward: float = 0.0
    compute_backward: float = 0.0
    comm_forward: float = 0.0
    comm_backward: float = 0.0
    grad_sync: float = 0.0
    bucket_latency: float = 0.0  # part of grad_sync: one latency per coalesced all-reduce
    optimizer: float = 0.0
    overlapped: list[Overlapped] = field(default_factory=list)
    memory: dict[str, float] = field(
        default_factory=lambda: {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    )
    model_flops: float = 0.0
    num_devices: int = 1
    peak_flops: float = 1.0

    @property
    def compute(self) -> float:
        return self.compute_forward + self.compute_backward

    @property
    def comm(self) -> float:
        """All communication, in line or overlapped."""
        return self.comm_forward + self.comm_backward + self.grad_sync + self.overlapped_comm

    @property
    def overlapped_comm(self) -> float:
        return sum(o.seconds for o in self.overlapped)

    @property
    def exposed_comm(self) -> float:
        """The communication the step waits for."""
        inline = self.comm_forward + self.comm_backward + self.grad_sync
        return inline + exposed(self.overlapped)

    @property
    def step_time(self) -> float:
        return self.compute + self.exposed_comm + self.optimizer

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.num_devices * self.peak_flops)

    def as_dict(self) -> dict[str, object]:
        return {
            "step_time_s": self.step_time,
            "compute_s": self.compute,
            "comm_s": self.comm,
            "exposed_comm_s": self.exposed_comm,
            "grad_sync_s": self.grad_sync,
            "optimizer_s": self.optimizer,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory,
            "memory_bytes": dict(self.memory),
        }


def estimate(
    plan: Any, og: OpGraph, cluster: ClusterSpec, optimizer_states: int = ADAM_STATES
) -> Estimate:
    """Price a :class:`~autoshard.search.Plan` of ``og`` on ``cluster``."""
    graph_nodes = og.by_name
    est = Estimate(num_devices=plan.mesh.num_devices)
    dtypes = []
    for name, node_plan in plan.nodes.items():
        node = graph_nodes[name]
        strategy = node_plan.strategy
        fwd, bwd = op_time(node, strategy, cluster)
        est.compute_forward += fwd
        est.compute_backward += bwd
        est.model_flops += og[node].flops
        if saves_output(node):
            est.memory["activations"] += sum(local_bytes(o) for o in strategy.outs)
        args = tensor_inputs(node)
        for i, (src, dst) in node_plan.moves.items():
            est.comm_forward += transition(src, dst, cluster).seconds
            if og[args[i]].requires_grad:
                back = transition(dst.without_partial(), src.without_partial(), cluster)
                est.comm_backward += back.seconds
        for i, (grad, want) in node_plan.grad_reduce.items():
            seconds = transition(grad, want, cluster).seconds
            if args[i].op == "placeholder":
                est.grad_sync += seconds
            else:
                est.comm_backward += seconds
        if strategy.outs and strategy.outs[0] is not None and og[node].flops:
            dtypes.append(strategy.outs[0].dtype)
    kinds = {i.fqn: i.kind if i.node.users else "unused" for i in og if i.node.op == "placeholder"}
    buckets: dict[tuple, float] = {}
    for fqn, param in plan.params.items():
        size = local_bytes(param.layout)
        if kinds.get(fqn) == "param":
            est.memory["params"] += size
            est.memory["grads"] += size
            est.memory["optimizer"] += optimizer_states * size
            est.optimizer += optimizer_time(param.layout, cluster)
            if param.grad_partial is not None:
                seconds, key = grad_sync(param.grad_partial, param.layout, cluster)
                est.grad_sync += seconds
                if key is not None and key not in buckets:
                    buckets[key] = bucket_latency(param.grad_partial, cluster)
        else:
            est.memory["params"] += size
    est.bucket_latency = sum(buckets.values())
    est.grad_sync += est.bucket_latency
    for layout in plan.inputs.values():
        est.memory["activations"] += local_bytes(layout)
    for src, dst in plan.outputs:
        est.comm_forward += transition(src, dst, cluster).seconds
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    est.peak_flops = cluster.peak_flops(dtype)
    return est


__all__ = ["ADAM_STATES", "Estimate", "Overlapped", "estimate", "exposed"]
