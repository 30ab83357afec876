"""A pipeline plan's step and memory (docs/parallelism/pipeline.md).

The stage sub-mesh's plan is priced over the whole model for one micro-batch (``estimate``,
at full depth); its ops are then cut into what comes before the repeated blocks (the
embedding), one block, and what comes after (the head and the loss). Stage ``s`` of ``S``
gets its share of the blocks, the first the embedding, the last the head; each action of the
schedule takes its stage's time (``F`` its forward, ``B`` its backward with what recompute
runs again, ``W`` the weight half of a split backward: half of the matrix products'
backward), each send the time of the stage's output over the link between the two pipeline
ranks; the simulator plays the schedule (the runtime runs the same list). The step adds the
stage's exposed gradient sums and its optimizer step. A stage's memory is its share of the
parameters, gradients and optimizer state, and what it keeps for backward times the
micro-batches it holds at once (``Timeline.in_flight``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields

from autoshard.cost.cluster import ClusterSpec
from autoshard.cost.collectives import PRODUCTS, collective_time
from autoshard.cost.copies import CopiesEstimate, hidden_in
from autoshard.cost.decisions import PlanDecisions
from autoshard.cost.estimate import MEMORY_KINDS, Estimate
from autoshard.cost.offload import Offload
from autoshard.cost.staged_offload import StagedOffload
from autoshard.graph import OpGraph, cut_at_modules
from autoshard.layout import Layout
from autoshard.schedule import Action, Schedule, Timeline, simulate

# PRODUCTS: ops whose outputs selective recompute keeps, and whose backward is two products
# (one for the input's gradient, one for the weight's)


@dataclass
class Piece:
    """Per micro-batch: seconds of forward and backward (compute and the communication they
    wait for), the weight half of backward, what recompute runs again (full: the forward;
    selective: the forward of everything but matrix products), bytes kept for backward
    (without recompute, and under selective recompute), bytes of state by kind, seconds of
    gradient sums, seconds of the parameter gathers forward waits for (ZeRO's), and its share
    of the model's parameter bytes (what it holds of an offloaded state)."""

    forward: float = 0.0
    backward: float = 0.0
    weight: float = 0.0
    again_selective: float = 0.0
    kept: float = 0.0
    kept_selective: float = 0.0
    state: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEMORY_KINDS, 0.0))
    grad_sums: float = 0.0
    gathers: float = 0.0
    share: float = 0.0

    def scaled(self, k: float) -> Piece:
        return Piece(
            self.forward * k,
            self.backward * k,
            self.weight * k,
            self.again_selective * k,
            self.kept * k,
            self.kept_selective * k,
            {n: v * k for n, v in self.state.items()},
            self.grad_sums * k,
            self.gathers * k,
            self.share * k,
        )

    def __add__(self, other: Piece) -> Piece:
        return Piece(
            self.forward + other.forward,
            self.backward + other.backward,
            self.weight + other.weight,
            self.again_selective + other.again_selective,
            self.kept + other.kept,
            self.kept_selective + other.kept_selective,
            {n: self.state[n] + other.state[n] for n in self.state},
            self.grad_sums + other.grad_sums,
            self.gathers + other.gathers,
            self.share + other.share,
        )


def _product(op: str) -> bool:
    return op.split(".")[0] in PRODUCTS


def model_pieces(est: Estimate, og: OpGraph) -> tuple[Piece, Piece, int, Piece]:
    """(before the blocks, one block, the number of blocks, after the blocks) of the estimate
    ``est`` of one micro-batch (at full depth: a captured block stands for its copies)."""
    pre, blocks, post = Piece(), Piece(), Piece()
    count, seen_block, block_copies = 0, False, []
    prefix = next(iter(og.repeated), None)
    runs: dict[int, list] = {id(pre): [], id(blocks): [], id(post): []}
    for node in og.graph.nodes:
        if node.name not in est.by_node:
            continue
        terms, copies = est.by_node[node.name]
        info = og[node]
        in_block = info.block is not None and info.block[0] == prefix
        seen_block |= in_block
        if in_block:
            block_copies.append(copies)
        piece = blocks if in_block else (post if seen_block else pre)
        runs[id(piece)].append((terms, copies))
        fwd = terms.compute_forward + terms.comm_forward
        bwd = terms.compute_backward + terms.comm_backward
        product = _product(str(info.op))
        piece.forward += copies * fwd
        piece.backward += copies * bwd
        piece.weight += copies * (0.5 * terms.compute_backward if product and info.params else 0.0)
        piece.again_selective += copies * (0.0 if product else fwd)
        piece.kept += copies * terms.memory["activations"]
        piece.kept_selective += copies * (terms.memory["activations"] if product else 0.0)
    if prefix is not None:
        # the last captured block stands for its copies, every other captured block for one
        count = len(og.repeated[prefix]) - 1 + max(block_copies, default=1)
    if isinstance(est, CopiesEstimate):  # what a stage's copies hide of its collectives
        for piece in (pre, blocks, post):
            forward, backward = hidden_in(est, runs[id(piece)])
            piece.forward, piece.backward = piece.forward - forward, piece.backward - backward
    _add_state(est, og, prefix, pre, blocks, post)
    return pre, blocks.scaled(1 / max(count, 1)), max(count, 1), post


def _add_state(est: Estimate, og: OpGraph, prefix: str | None, *pieces: Piece) -> None:
    """Each piece's share of the state and of the gradient sums, by its parameters' bytes."""
    pre, blocks, post = pieces
    total = sum(m for m, _ in est.by_param.values()) or 1.0
    seen_block, where = False, {}
    for node in og.graph.nodes:
        info = og[node]
        in_block = info.block is not None and info.block[0] == prefix
        seen_block |= in_block
        for fqn in info.params:
            where.setdefault(fqn, blocks if in_block else (post if seen_block else pre))
    # a gather due in forward (ZeRO's, of the parameters the optimizer stepped) runs beside
    # a step's first micro-batch's forward; the sums beside its last one's backward
    forward = est.compute_forward + est.comm_forward
    gathers = sum(o.seconds for o in est.overlapped if o.due <= forward)
    sums = est.grad_sync + sum(o.seconds for o in est.overlapped) - gathers
    for fqn, (memory, _) in est.by_param.items():
        piece = where.get(fqn, pre)
        share = memory / total
        for kind in ("parameters", "gradients", "optimizer"):
            piece.state[kind] += share * est.memory[kind]
        piece.grad_sums += share * sums
        piece.gathers += share * gathers
        piece.share += share


@dataclass(frozen=True)
class PipelineEstimate:
    """A pipeline plan's predicted step (seconds) and each stage's memory by kind (bytes)."""

    timeline: Timeline
    step_time: float
    memory: tuple[dict[str, float], ...]
    stage_seconds: tuple[tuple[float, float], ...]  # (forward, backward) per micro-batch
    #: each stage's weight half of a backward (``W``), and a send's seconds between stages
    weight_seconds: tuple[float, ...] = ()
    hop: float = 0.0

    @property
    def peak_memory(self) -> float:
        return max(sum(m.values()) for m in self.memory)

    @property
    def bubble(self) -> float:
        return self.timeline.bubble

    def as_json(self) -> dict[str, object]:
        """Its figures as a plan JSON's ``pipeline`` section holds them."""
        return {
            "bubble": self.bubble,
            "step_time_s": self.step_time,
            "peak_memory_bytes": self.peak_memory,
            "memory_bytes": [dict(m) for m in self.memory],
            "stage_seconds": [list(x) for x in self.stage_seconds],
            "stage_weight_seconds": list(self.weight_seconds),
            "hop_s": self.hop,
            # the schedule's gradient sums left waiting, and the optimizer step, after its end
            "after_schedule_s": self.step_time - self.timeline.step,
        }


@dataclass(frozen=True)
class OffloadPipelineEstimate(PipelineEstimate):
    """A pipeline plan's step with offload (``cost.staged_offload``): ``memory`` is each
    pipeline rank's device tier, ``host_by_rank`` and ``nvme_by_rank`` its host and NVMe bytes
    by kind; ``offload_s`` what the step waits for the offload; ``offload_parts`` the terms of
    the stage holding the most state."""

    offloaded: Offload = field(default_factory=Offload)
    host_by_rank: tuple[dict[str, float], ...] = ()
    nvme_by_rank: tuple[dict[str, float], ...] = ()
    offload_s: float = 0.0
    offload_parts: dict[str, float] = field(default_factory=dict)

    @property
    def host(self) -> dict[str, float]:
        """The host bytes of the rank holding the most there (``offload.tiers_fit``)."""
        return max(self.host_by_rank, key=lambda m: sum(m.values()))

    @property
    def nvme(self) -> dict[str, float]:
        return max(self.nvme_by_rank, key=lambda m: sum(m.values()))

    def as_json(self) -> dict[str, object]:
        return super().as_json() | {
            "host_memory_bytes": [dict(m) for m in self.host_by_rank],
            "nvme_memory_bytes": [dict(m) for m in self.nvme_by_rank],
            "offload_s": self.offload_s,
            "offload_parts_s": dict(self.offload_parts),
        }


def price_pipeline(
    est: Estimate,
    og: OpGraph,
    schedule: Schedule,
    cluster: ClusterSpec,
    recompute: str = "none",
    boundary_bytes: float = 0.0,
    stride: int = 1,
    parts: tuple | None = None,
) -> PipelineEstimate:
    """The step and memory of ``schedule`` over the stages of the model ``est`` prices for
    one micro-batch (on one stage's sub-mesh); ``boundary_bytes``: what a stage sends on per
    micro-batch (per rank); ``stride``: ranks between two neighbouring pipeline ranks (the
    link they use: inside a node or across); ``parts``: ``model_pieces(est, og)`` where the
    caller made it already (a search prices one stage plan under many schedules)."""
    block, shares, pieces, seconds = _stages(est, og, schedule.num_stages, recompute, parts)
    staged = StagedOffload.of(est, pieces)  # None: nothing offloaded
    weights = tuple(p.weight for p in pieces)
    crosses = stride >= cluster.devices_per_node
    hop = collective_time("send_recv", boundary_bytes, 2, 1 if crosses else 2, cluster)
    busy = staged.seconds(seconds) if staged else seconds
    # what autoshard simulate replays from the JSON
    timeline = simulate(schedule, stage_costs(busy, weights), lambda send: hop)
    state = sum(est.memory[k] for k in ("parameters", "gradients", "optimizer")) or 1.0
    tail = bare = 0.0
    e = cluster.overlap_efficiency
    for s, p in enumerate(pieces):  # the gradient sums overlap the last micro-batch's
        # backward, the gathers the first one's forward (as much of them as the cluster's
        # streams really overlap); an offload's host step follows that backward
        waited = max(0.0, p.grad_sums - e * p.backward) + max(0.0, p.gathers - e * p.forward)
        waited += sum(p.state.values()) / state * est.optimizer
        bare = max(bare, waited)
        tail = max(tail, waited + (staged.after(s) if staged else 0.0))
    memory = []
    for s, (p, n) in enumerate(zip(pieces, shares, strict=True)):
        kept, working = _kept(p, block.scaled(n), recompute, boundary_bytes, n)
        memory.append(p.state | {"activations": kept * timeline.in_flight[s] + working})
    per_rank = tuple(_per_rank(memory, schedule))
    priced = PipelineEstimate(timeline, timeline.step + tail, per_rank, busy, weights, hop)
    if staged is None:
        return priced
    tiers = staged.tiers(memory, timeline.in_flight, lambda m: _per_rank(m, schedule))
    bare += simulate(schedule, stage_costs(seconds, weights), lambda send: hop).step
    return OffloadPipelineEstimate(
        **{f.name: getattr(priced, f.name) for f in fields(priced)} | tiers,
        offload_s=priced.step_time - bare,
    )


def _stages(
    est: Estimate, og: OpGraph, stages: int, recompute: str, parts: tuple | None = None
) -> tuple:
    """One block, each stage's number of blocks, its piece, and its (forward, backward)
    seconds per micro-batch with what ``recompute`` runs again."""
    pre, block, count, post = parts or model_pieces(est, og)
    shares = [count // stages + (1 if s >= stages - count % stages else 0) for s in range(stages)]
    pieces = [
        (pre if s == 0 else Piece()) + block.scaled(n) + (post if s == stages - 1 else Piece())
        for s, n in enumerate(shares)
    ]
    again = [_again(block.scaled(n), recompute) for n in shares]
    seconds = tuple((p.forward, p.backward + a) for p, a in zip(pieces, again, strict=True))
    return block, shares, pieces, seconds


def busiest_rank_seconds(
    est: Estimate,
    og: OpGraph,
    placement: Sequence[int],
    microbatches: int,
    recompute: str,
    parts: tuple | None = None,
) -> float:
    """The compute of the busiest pipeline rank over a step whose stage ``s`` runs on rank
    ``placement[s]``: a lower bound of the step ``price_pipeline`` predicts (what the search
    needs to skip a configuration without making its schedule); ``parts`` as there."""
    seconds = _stages(est, og, len(placement), recompute, parts)[3]
    busy: dict[int, float] = {}
    for s, rank in enumerate(placement):
        busy[rank] = busy.get(rank, 0.0) + sum(seconds[s])
    return microbatches * max(busy.values())


def boundary_bytes(og: OpGraph, plan: PlanDecisions) -> float:
    """Bytes per rank of what one block hands the next (what crosses a stage boundary)."""
    prefix = next(iter(og.repeated), None)
    if prefix is None or len(og.repeated[prefix]) < 2:
        return 0.0
    second = f"{prefix}.{og.repeated[prefix][1]}"
    total = 0.0
    for name in cut_at_modules(og, [second]).receives[1]:
        node = og.by_name[name]
        if og[node].kind == "getitem":
            layout = plan.nodes[node.args[0].name].strategy.outs[node.args[1]]
        else:
            layout = plan.nodes[name].strategy.outs[0]
        if isinstance(layout, Layout):
            total += layout.local_numel * layout.dtype.itemsize
    return total


def least_busiest(
    one: Estimate, og: OpGraph, devices: int, placements: Iterable[Sequence[int]], m: int
) -> float:
    """A floor under the step of every schedule of ``m`` micro-batches whose stages run on
    the ranks of one of ``placements``, each stage on ``devices`` devices: the busiest rank's
    compute were each op's time on one device (``one``: a plan's estimate on one device of
    a ``steady`` spec) spread over the stage's devices, with no communication nor recompute.
    No op runs faster on ``devices`` devices: its work and bytes are split at most that many
    ways, and a part of a product reaches no more of the peak than the whole."""
    pre, block, count, post = model_pieces(one, og)
    k = 1 / devices
    spread = (pre.scaled(k), block.scaled(k), count, post.scaled(k))
    seconds = (busiest_rank_seconds(one, og, p, m, "none", spread) for p in placements)
    return min(seconds, default=math.inf)  # no placement: no schedule at all


def steady(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with its matrix products' efficiency at each size raised to the most a
    smaller size reaches (a measured curve may dip): never less for a larger product."""
    points, most = [], 0.0
    for size, share in cluster.matmul_efficiency:
        most = max(most, share)
        points.append([size, most])
    return dataclasses.replace(cluster, matmul_efficiency=points)


def stage_costs(
    stage_seconds: Sequence[Sequence[float]], weight_seconds: Sequence[float]
) -> Callable[[Action], float]:
    """The simulator's cost of each action from a priced pipeline's per-stage seconds (as its
    JSON stores them): F the forward, B the backward, I and W its two halves (the first
    stage's inputs need no gradient: its I is empty and W the whole backward, as the runtime
    runs it)."""

    table: dict[tuple[str, int], float] = {}
    for s, (forward, backward) in enumerate(stage_seconds):
        weight = backward if s == 0 else weight_seconds[s] if weight_seconds else 0.0
        parts = {"F": forward, "B": backward, "I": backward - weight, "W": weight}
        table.update({(kind, s): seconds for kind, seconds in parts.items()})

    def cost(a: Action) -> float:
        return table.get((a.kind, a.stage), 0.0)

    return cost


def _again(blocks: Piece, recompute: str) -> float:
    """Seconds a backward runs forward again under ``recompute`` (its blocks only)."""
    if recompute == "full":
        return blocks.forward
    if recompute == "selective":
        return blocks.again_selective
    return 0.0


def _kept(
    piece: Piece, blocks: Piece, recompute: str, boundary: float, n: int
) -> tuple[float, float]:
    """Bytes one micro-batch leaves on the stage for its backward, and the bytes a backward
    holds at once besides (full recompute: one block's activations, run again)."""
    if recompute == "full":  # each block's input is kept
        return piece.kept - blocks.kept + n * boundary, blocks.kept / n if n else 0.0
    if recompute == "selective":
        return piece.kept - blocks.kept + blocks.kept_selective, 0.0
    return piece.kept, 0.0


def _per_rank(memory: list[dict[str, float]], schedule: Schedule) -> list[dict[str, float]]:
    """Each pipeline rank's memory: the sum over the stages it holds."""
    out = []
    for r in range(schedule.num_ranks):
        mine = [memory[s] for s in schedule.stages_of(r)]
        out.append({k: sum(m[k] for m in mine) for k in mine[0]})
    return out


__all__ = [
    "boundary_bytes",
    "busiest_rank_seconds",
    "least_busiest",
    "PRODUCTS",
    "Piece",
    "OffloadPipelineEstimate",
    "PipelineEstimate",
    "model_pieces",
    "price_pipeline",
    "stage_costs",
    "steady",
]
