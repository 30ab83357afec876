"""A whole plan's predicted step time and memory per device (docs/cost.md).

Step time is compute plus the communication the compute waits for: every redistribution and
gradient sum the runtime runs in line is exposed; communication the runtime runs beside compute
(:class:`Overlapped`) is hidden as far as a timeline of one compute and one communication stream
says it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.collectives import (
    BUCKET_CAP_MB,
    assign_buckets,
    bucket_latency,
    exchange_times,
    grad_sync,
    group_size,
    is_product,
    move_time,
    regathered,
    transition,
)
from autoshard.cost.compute import (
    input_time,
    local_bytes,
    op_time,
    optimizer_time,
    saved_bytes,
)
from autoshard.cost.decisions import OpDecisions, ParamDecisions, PlanDecisions
from autoshard.cost.timeline import Overlapped, exposed
from autoshard.cost.zero import (
    ZeroParam,
    ZeroUnit,
    gather_parts,
    master_layout,
    scatter_parts,
    sum_dtype,
    zero_param,
    zero_units,
)
from autoshard.graph import OpGraph
from autoshard.layout import Layout
from autoshard.ops import tensor_inputs
from autoshard.redistribution import backward_source

#: optimizer state values per parameter element (Adam's two moments)
ADAM_STATES = 2
#: the predicted memory breakdown per device, in bytes (``Estimate.memory``)
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations")


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
    bucket_latency: float = 0.0  # part of the overlapped: one latency per bucket
    optimizer: float = 0.0
    overlapped: list[Overlapped] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEMORY_KINDS, 0.0))
    model_flops: float = 0.0
    num_devices: int = 1
    peak_flops: float = 1.0
    #: the share of the timeline's overlap that really happens (``ClusterSpec``)
    overlap_efficiency: float = 1.0
    #: where the sums come from (``cost.breakdown``): each node's terms of one run and its
    #: number of runs; each parameter's or buffer's memory and in-line seconds, all copies
    by_node: dict[str, tuple[Estimate, int]] = field(default_factory=dict, repr=False)
    by_param: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

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
        return inline + exposed(self.overlapped, self.overlap_efficiency)

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
            "memory_bytes": {**self.memory, "total": self.peak_memory},
        }


def estimate(
    plan: PlanDecisions,
    og: OpGraph,
    cluster: ClusterSpec,
    optimizer_states: int = ADAM_STATES,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    depth: Mapping[str, int] | None = None,
) -> Estimate:
    """Price a plan (``search.Plan``, read as :class:`~autoshard.cost.decisions.PlanDecisions`)
    of ``og`` on ``cluster``: the runtime's gradient
    buckets of ``bucket_cap_mb`` overlap what is left of backward once they are full. ``depth``
    (block list prefix -> its real number of blocks) prices a model captured with fewer blocks
    as the real one: each captured block stands for its share of the real ones."""
    est = Estimate(num_devices=plan.mesh.num_devices, overlap_efficiency=cluster.overlap_efficiency)
    dtypes = []
    sequence, copies = _as_run(og, depth)
    terms: dict[fx.Node, Estimate] = {}
    backward_at: list[float] = []  # in-line backward seconds of each node run, in order
    forward_at: list[float] = []  # in-line forward seconds before each node run
    for node, _ in sequence:
        if node not in terms:
            terms[node] = _node_terms(plan, og, node, cluster)
            node_plan = plan.nodes.get(node.name)
            strategy = node_plan.strategy if node_plan is not None else None
            if strategy and strategy.outs and strategy.outs[0] is not None and og[node].flops:
                dtypes.append(strategy.outs[0].dtype)
        forward_at.append(est.compute_forward + est.comm_forward)
        _add(est, terms[node])
        est.by_node[node.name] = (terms[node], copies.get(node, 1))
        backward_at.append(terms[node].compute_backward + terms[node].comm_backward)
    for src, dst in plan.outputs:
        est.comm_forward += transition(src, dst, cluster).seconds
    reduce_dtype = sum_dtype(plan.precision)  # what gradient sums travel in under the policy
    nodes = list(og.graph.nodes)
    owners = {fqn: copies.get(nodes[i], 1) for fqn, i in og.first_use.items()}
    bucketed, zeroed = _price_params(est, plan, og, cluster, optimizer_states, reduce_dtype, owners)
    for name, layout in plan.inputs.items():
        est.memory["activations"] += local_bytes(layout)
        est.compute_forward += input_time(layout, cluster)
        taken = Estimate(compute_forward=input_time(layout, cluster))  # its own term too
        est.by_node[name] = (taken, 1)
    position = {item: k for k, item in enumerate(sequence)}
    if zeroed:
        run = _Run(position, forward_at, backward_at, est.grad_sync)
        _overlap_zero(est, og, zeroed, run, cluster)
    ready = {  # each copy of a bucketed parameter: where it is first read in the run
        f"{fqn}#{c}": position[(nodes[og.first_use[fqn]], c)] if fqn in og.first_use else 0
        for fqn in bucketed
        for c in range(owners.get(fqn, 1))
    }
    _overlap_buckets(est, bucketed, ready, backward_at, bucket_cap_mb * 2**20)
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    est.peak_flops = cluster.peak_flops(dtype)
    return est


def _as_run(
    og: OpGraph, depth: Mapping[str, int] | None
) -> tuple[list[tuple[fx.Node, int]], dict[fx.Node, int]]:
    """The graph's nodes in the order the real model runs them, as (node, copy): of a
    repeated block list whose real depth is D, k blocks captured, the last captured block
    stands for the last D - k + 1 (the first reads the embedding, its successors each other),
    its nodes repeated whole block after whole block. Also how many copies each node has."""
    sequence: list[tuple[fx.Node, int]] = []
    copies: dict[fx.Node, int] = {}
    segment: list[fx.Node] = []
    current: tuple[str, int] | None = None

    def flush() -> None:
        count = 1
        if current is not None and depth and depth.get(current[0]):
            blocks = og.repeated[current[0]]
            if current[1] == blocks[-1]:
                count = max(1, depth[current[0]] - len(blocks) + 1)
        for node in segment:
            copies[node] = count
        sequence.extend((node, c) for c in range(count) for node in segment)

    for node in og.graph.nodes:
        info = og[node]
        block = info.block if node.op != "placeholder" and og.is_repeated(info) else None
        if block != current:
            flush()
            segment, current = [], block
        segment.append(node)
    flush()
    return sequence, copies


def _node_terms(plan: PlanDecisions, og: OpGraph, node: fx.Node, cluster: ClusterSpec) -> Estimate:
    """What one run of ``node`` adds to a step: its op, moves and gradient sums."""
    terms = Estimate()
    node_plan = plan.nodes.get(node.name)
    if node_plan is not None:
        _price_node(terms, og, node, node_plan, cluster)
    if node.name in plan.shared_reduce:
        terms.comm_backward += transition(*plan.shared_reduce[node.name], cluster).seconds
    return terms


def _add(est: Estimate, terms: Estimate) -> None:
    est.compute_forward += terms.compute_forward
    est.compute_backward += terms.compute_backward
    est.comm_forward += terms.comm_forward
    est.comm_backward += terms.comm_backward
    est.grad_sync += terms.grad_sync
    est.model_flops += terms.model_flops
    est.memory["activations"] += terms.memory["activations"]


def _price_node(
    est: Estimate, og: OpGraph, node: fx.Node, node_plan: OpDecisions, cluster: ClusterSpec
) -> None:
    strategy = node_plan.strategy
    fwd, compute_bwd = op_time(node, strategy, cluster)
    est.compute_forward += fwd
    est.compute_backward += compute_bwd
    fwd, bwd = exchange_times(node, strategy, cluster)
    est.comm_forward += fwd
    est.comm_backward += bwd if og[node].requires_grad else 0.0
    est.model_flops += og[node].flops
    est.memory["activations"] += saved_bytes(node, strategy)
    args = tensor_inputs(node)
    for i, (src, dst) in node_plan.moves.items():
        if i in node_plan.reuses:  # an earlier reader moved it (and sums its gradient)
            continue
        beside = is_product(node) or is_product(args[i])
        est.comm_forward += move_time(src, dst, cluster, beside)
        if og[args[i]].requires_grad:  # the reader's pending sums with it (backward_plan)
            grad = node_plan.grad_reduce[i][0] if i in node_plan.grad_reduce else None
            back = backward_source(dst, grad)
            est.comm_backward += move_time(back, src.without_partial(), cluster, beside)
    for src, dst in regathered(node, node_plan):  # hidden behind the input's gradient
        est.comm_backward += max(0.0, transition(src, dst, cluster).seconds - compute_bwd / 2)
    for i, (grad, want) in node_plan.grad_reduce.items():
        if i in node_plan.moves:
            continue
        seconds = transition(grad, want, cluster).seconds
        if args[i].op == "placeholder":
            est.grad_sync += seconds
        else:
            est.comm_backward += seconds


def _price_params(
    est: Estimate,
    plan: PlanDecisions,
    og: OpGraph,
    cluster: ClusterSpec,
    optimizer_states: int,
    reduce_dtype: torch.dtype | None,
    copies: Mapping[str, int],
) -> tuple[dict[str, tuple[float, tuple, float, float]], dict[str, ZeroParam]]:
    """Memory and optimizer time of the parameters and buffers (``copies`` of a block's); the
    gradient sums the hooks run in line; the bucketed ones: (bandwidth seconds, bucket key,
    bytes, the bucket's latency) by name, for each copy; and the parameters under ZeRO."""
    kinds = {i.fqn: i.kind if i.node.users else "unused" for i in og if i.node.op == "placeholder"}
    compute = {i.fqn: i.dtype for i in og.state()}
    bucketed: dict[str, tuple[float, tuple, float, float]] = {}
    zeroed: dict[str, ZeroParam] = {}
    level = plan.zero_level
    for fqn, param in plan.params.items():
        memory, in_line = sum(est.memory.values()), est.grad_sync
        count = copies.get(fqn, 1)
        kept = master_layout(param.layout, plan.precision)
        if kinds.get(fqn) != "param":
            est.memory["parameters"] += count * local_bytes(param.layout)
        elif zp := _zero_param(
            param,
            level(fqn),
            cluster,
            optimizer_states,
            compute.get(fqn),
            reduce_dtype,
            kept,
        ):
            zeroed[fqn] = zp
            for kind, nbytes in zeroed[fqn].memory.items():
                est.memory[kind] += count * nbytes
            est.optimizer += count * optimizer_time(kept, cluster, zeroed[fqn].share)
            est.grad_sync += count * zeroed[fqn].copy
        else:
            bucket = _price_param(est, param, cluster, optimizer_states, reduce_dtype, count, kept)
            if bucket is not None:
                bucketed[fqn] = bucket
        est.by_param[fqn] = (sum(est.memory.values()) - memory, est.grad_sync - in_line)
    return bucketed, zeroed


def _zero_param(
    param: ParamDecisions,
    level: int,
    cluster: ClusterSpec,
    optimizer_states: int,
    compute: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    master: Layout,
) -> ZeroParam | None:
    """A trainable parameter under ZeRO (``cost.zero_groups``, the runtime's decision too),
    kept as ``master``."""
    if param.from_value or param.grad_partial is None:
        return None
    return zero_param(
        level, master, param.grad_partial, cluster, optimizer_states, compute, reduce_dtype
    )


def _price_param(
    est: Estimate,
    param: ParamDecisions,
    cluster: ClusterSpec,
    optimizer_states: int,
    reduce_dtype: torch.dtype | None,
    count: int,
    master: Layout,
) -> tuple[float, tuple, float, float] | None:
    """A parameter without ZeRO, kept as ``master``: its memory and optimizer time, its
    gradient sum in line, or as a bucket member (returned: bandwidth seconds, bucket key,
    bytes, bucket latency). Under a mixed policy the program's cast of it to the compute
    dtype is kept for backward, with the activations."""
    size = local_bytes(master)
    est.memory["parameters"] += count * size
    est.memory["gradients"] += count * size
    est.memory["optimizer"] += count * optimizer_states * size
    if master != param.layout:
        est.memory["activations"] += count * local_bytes(param.layout)
    est.optimizer += count * optimizer_time(master, cluster)
    if param.grad_partial is None:
        return None
    partial, full = param.grad_partial, param.layout
    if reduce_dtype is not None:  # mixed precision: summed in its reduce dtype
        partial, full = partial.with_dtype(reduce_dtype), full.with_dtype(reduce_dtype)
    seconds, in_line, key = grad_sync(partial, full, cluster)
    est.grad_sync += count * in_line
    if key is None:
        return None
    # a bucket holds it in the dtype it is summed in
    return seconds, key, local_bytes(partial), bucket_latency(param.grad_partial, cluster)


def _overlap_buckets(
    est: Estimate,
    bucketed: dict[str, tuple[float, tuple, float, float]],
    ready: dict[str, int],
    backward_at: list[float],
    cap_bytes: float,
) -> None:
    """The runtime's buckets (``runtime.GradSync``) as overlapped transfers: gradients join
    them in the order backward completes them, the reverse of where each is first read
    (``ready``: its position in the run), as ``OpGraph.gradient_order`` has it; each bucket
    starts when its last gradient is complete and is due when backward ends."""
    order = sorted(ready, key=lambda name: -ready[name])
    base = {name: name.rsplit("#", 1)[0] for name in order}
    items = [(n, bucketed[base[n]][1], bucketed[base[n]][2]) for n in order]
    forward = est.compute_forward + est.comm_forward
    due = forward + est.compute_backward + est.comm_backward + est.grad_sync
    # in-line work done when backward has gone back through run position i: forward, the
    # backward from i on and the hooks' copies (spread over backward as its share of it)
    tail = list(itertools.accumulate(reversed(backward_at)))[::-1] + [0.0]
    share = est.grad_sync / max(tail[0], 1e-30)
    for _, names in assign_buckets(items, cap_bytes):
        seconds = sum(bucketed[base[n]][0] for n in names)
        latency = bucketed[base[names[0]]][3]
        done = max(tail[ready[n]] for n in names)
        est.bucket_latency += latency
        est.overlapped.append(Overlapped(seconds + latency, forward + done * (1 + share), due))


@dataclass(frozen=True)
class _Run:
    """Where the run is: each (node, copy)'s position, the in-line forward seconds before each
    position and the in-line backward seconds of each."""

    position: dict[tuple[fx.Node, int], int]
    forward_at: list[float]
    backward_at: list[float]
    hooks: float  # in-line seconds of gradient hooks, spread over backward

    def forward(self, k: int) -> float:
        return self.forward_at[k] if k < len(self.forward_at) else self.forward_at[-1]

    def backward(self, k: int) -> float:
        """When backward has gone back through position ``k`` (from the step's start)."""
        tail = sum(self.backward_at[k:])
        total = sum(self.backward_at)
        end = self.forward_at[-1] if self.forward_at else 0.0
        return end + tail * (1 + self.hooks / max(total, 1e-30))


def _overlap_zero(
    est: Estimate,
    og: OpGraph,
    zeroed: dict[str, ZeroParam],
    run: _Run,
    cluster: ClusterSpec,
) -> None:
    """ZeRO's units (``cost.zero_units``, the runtime's) as overlapped transfers: one per unit
    and block copy, in the order of first use. Each unit's all-gather is started when the unit
    before it is first read and due at its own first read; its reduce-scatter starts when
    backward has passed its first read and is due when backward ends; at stage 3 backward
    gathers it again, started when backward reaches the next unit's last read, due at its own
    last read. Memory: at stage 3 two units' gathered parameters (one in use, the next one
    coming), at stages 2 and 3 two units' gradient buffers (one filling, one being summed)."""
    units = _zero_units(og, zeroed, run)
    due = run.backward(0)
    previous = 0.0
    for unit, members in units:
        zp = [zeroed[f] for f, _, _ in members]
        g, per_node = group_size(unit.groups[0], cluster.devices_per_node)
        first = min(k for _, k, _ in members)
        gather = gather_parts(sum(z.gathered for z in zp), g, per_node, cluster)
        scatter = scatter_parts(sum(z.summed for z in zp), g, per_node, cluster)
        est.overlapped.append(Overlapped(sum(gather), previous, run.forward(first)))
        previous = run.forward(first)
        est.overlapped.append(Overlapped(sum(scatter), run.backward(first), due))
        est.bucket_latency += gather[1] + scatter[1]
    # stage 3: backward gathers each unit again, started when backward needs the unit before
    # it in backward's order (the first when forward ends), due when backward needs it
    ends = [(max(e for _, _, e in ms), unit, ms) for unit, ms in units if unit.level == 3]
    ends.sort(key=lambda item: -item[0])
    previous_end = len(run.backward_at) - 1
    for end, unit, members in ends:
        g, per_node = group_size(unit.groups[0], cluster.devices_per_node)
        gather = gather_parts(sum(zeroed[f].gathered for f, _, _ in members), g, per_node, cluster)
        start, needed = run.backward(previous_end + 1), run.backward(end + 1)
        previous_end = end
        est.overlapped.append(Overlapped(sum(gather), start, needed))
        est.bucket_latency += gather[1]
    window = {"parameters": [0.0], "gradients": [0.0]}
    for unit, members in units:
        if unit.level == 3:
            window["parameters"].append(sum(zeroed[f].gathered for f, _, _ in members))
        if unit.level >= 2:
            window["gradients"].append(sum(zeroed[f].summed for f, _, _ in members))
    for kind, sizes in window.items():
        est.memory[kind] += sum(sorted(sizes)[-2:])


def _zero_units(
    og: OpGraph, zeroed: dict[str, ZeroParam], run: _Run
) -> list[tuple[ZeroUnit, list[tuple[str, int, int]]]]:
    """The runtime's ZeRO units in the run, each block copy of a unit once: (unit, members),
    each member (name, run position of its first read, of its last read), in the order of
    first use. Members no node reads are never gathered and cost nothing here."""
    nodes = list(og.graph.nodes)
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            if og[arg].kind == "param":
                last[og[arg].fqn] = i
    out = []
    for unit in zero_units(og, {f: (z.stage, z.groups) for f, z in zeroed.items()}):
        read = [f for f in unit.members if f in og.first_use]
        copy = 0
        while read and (nodes[og.first_use[read[0]]], copy) in run.position:
            members = []
            for fqn in read:
                k = run.position[(nodes[og.first_use[fqn]], copy)]
                members.append((fqn, k, run.position.get((nodes[last[fqn]], copy), k)))
            out.append((unit, members))
            copy += 1
    out.sort(key=lambda item: min(k for _, k, _ in item[1]))
    return out


__all__ = ["ADAM_STATES", "MEMORY_KINDS", "Estimate", "Overlapped", "estimate", "exposed"]
