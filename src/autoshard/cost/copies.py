"""A step of k copies (multi-copy parallelism, docs/parallelism/copies.md): each rank's batch
cut by its batch dim into ``k`` copies, run interleaved, so that one copy's in-line
collectives (tensor-parallel all-reduces, sequence-parallel all-gathers and reduce-scatters,
the experts' and Ulysses' all-to-alls) run while another copy computes.

The plan is priced for one copy (``estimate`` on the graph of ``batch / k`` rows: every op
at its efficiency for the smaller rows); :func:`with_copies` makes that the step of ``k``
copies. Each copy is a chain of its ops' in-line communication and compute, forward then
backward, the order the run meets them; the ``k`` chains go through two in-order streams, one
compute and one communication, copy after copy at each op (:func:`interleaved`). The first
copy's communication at the head of a chain has nothing to hide behind and the last copy's
compute nothing behind it: the timeline shows both. Of what it hides, only the cluster's
``overlap_efficiency`` share is really hidden. What a step does once for all copies (the
gradient sums and their buckets, ZeRO's gathers, the optimizer) is priced once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from autoshard.cost.compute import local_bytes
from autoshard.cost.decisions import PlanDecisions
from autoshard.cost.estimate import Estimate, _as_run
from autoshard.cost.timeline import Overlapped
from autoshard.graph import OpGraph

COMPUTE, COMM = 0, 1


@dataclass
class CopiesEstimate(Estimate):
    """The step of ``copies`` copies of a plan priced for one. The in-line fields count
    every copy's work; ``hidden_by_copies``: the in-line communication that runs behind
    another copy's compute, which the step does not wait for."""

    copies: int = 1
    hidden_by_copies: float = 0.0

    @property
    def exposed_comm(self) -> float:
        return super().exposed_comm - self.hidden_by_copies

    @property
    def exposed_comm_without_copies(self) -> float:
        """What the step would wait for if the copies ran one after another."""
        return super().exposed_comm

    def as_dict(self) -> dict[str, object]:
        return {
            **super().as_dict(),
            "copies": self.copies,
            "exposed_comm_without_copies_s": self.exposed_comm_without_copies,
        }


def interleaved(chain: list[tuple[int, float]], copies: int) -> float:
    """When the last of ``copies`` copies of ``chain`` ends: the chain is a list of
    (stream, seconds) each copy runs in order, a task after its copy's previous one; each
    stream (``COMPUTE``, ``COMM``) runs its tasks in the order they are issued, the chain's
    first task for every copy, then its second, and so on."""
    free = [0.0, 0.0]
    done = [0.0] * copies
    for stream, seconds in chain:
        for c in range(copies):
            done[c] = free[stream] = max(free[stream], done[c]) + seconds
    return max(done, default=0.0)


def copy_chain(est: Estimate, og: OpGraph, depth: Mapping[str, int] | None = None) -> list:
    """One copy's in-line work as the run meets it: per op its inputs' moves then its
    compute in forward, its backward compute then its inputs' gradient moves in backward;
    what no op holds (the outputs' moves) at the end of forward and the start of backward.
    The gradient sums of parameters run once a step and are not in it."""
    sequence, _ = _as_run(og, depth)
    forward: list[tuple[int, float]] = []
    backward: list[tuple[int, float]] = []
    totals = [0.0, 0.0, 0.0, 0.0]
    for node, _ in sequence:
        if node.name not in est.by_node:
            continue
        t = est.by_node[node.name][0]
        forward += [(COMM, t.comm_forward), (COMPUTE, t.compute_forward)]
        backward += [(COMM, t.comm_backward), (COMPUTE, t.compute_backward)]
        parts = (t.compute_forward, t.comm_forward, t.compute_backward, t.comm_backward)
        totals = [a + b for a, b in zip(totals, parts, strict=True)]
    forward += [(COMPUTE, est.compute_forward - totals[0]), (COMM, est.comm_forward - totals[1])]
    backward += [(COMM, est.comm_backward - totals[3])]
    backward += [(COMPUTE, est.compute_backward - totals[2])]
    return _merged(forward + backward[::-1])


def _merged(chain: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The chain with empty tasks dropped and neighbours on one stream joined (the same
    timeline, fewer steps)."""
    out: list[tuple[int, float]] = []
    for stream, seconds in chain:
        if seconds <= 0.0:
            continue
        if out and out[-1][0] == stream:
            out[-1] = (stream, out[-1][1] + seconds)
        else:
            out.append((stream, seconds))
    return out


def with_copies(
    est: Estimate,
    plan: PlanDecisions,
    og: OpGraph,
    copies: int,
    depth: Mapping[str, int] | None = None,
) -> Estimate:
    """The step of ``copies`` copies of ``plan``, whose estimate ``est`` prices one copy of
    ``og`` (the graph of a copy's rows). One copy: ``est`` itself."""
    if copies == 1:
        return est
    chain = copy_chain(est, og, depth)
    end = interleaved(chain, copies)
    serial = copies * sum(seconds for _, seconds in chain)
    hidden = est.overlap_efficiency * max(0.0, serial - end)
    inline = est.compute + est.comm_forward + est.comm_backward + est.grad_sync
    stretch = (copies * inline - est.grad_sync * (copies - 1) - hidden) / max(inline, 1e-30)
    return CopiesEstimate(
        compute_forward=copies * est.compute_forward,
        compute_backward=copies * est.compute_backward,
        comm_forward=copies * est.comm_forward,
        comm_backward=copies * est.comm_backward,
        grad_sync=est.grad_sync,
        bucket_latency=est.bucket_latency,
        optimizer=est.optimizer,
        overlapped=[
            Overlapped(o.seconds, o.ready * stretch, o.due * stretch) for o in est.overlapped
        ],
        memory={**est.memory, "activations": _activations(est, plan, copies)},
        model_flops=copies * est.model_flops,
        num_devices=est.num_devices,
        peak_flops=est.peak_flops,
        overlap_efficiency=est.overlap_efficiency,
        by_node={n: (_scaled(t, copies), runs) for n, (t, runs) in est.by_node.items()},
        by_param=dict(est.by_param),
        copies=copies,
        hidden_by_copies=hidden,
    )


def hidden_in(est: CopiesEstimate, ops: list[tuple[Estimate, int]]) -> tuple[float, float]:
    """The in-line seconds of forward and of backward that ``est``'s copies hide over a run
    of ``ops`` (each op's terms for every copy and its runs, in graph order: a run of ops
    with the same runs repeated whole, as a block stands for its copies): a pipeline stage's
    forward and backward, each its own timeline (``price_pipeline``)."""
    k = est.copies
    forward: list[tuple[int, float]] = []
    backward: list[tuple[int, float]] = []
    segment: list[Estimate] = []
    for i, (terms, runs) in enumerate(ops):
        segment.append(terms)
        if i + 1 < len(ops) and ops[i + 1][1] == runs:
            continue
        for _ in range(runs):
            for t in segment:
                forward += [(COMM, t.comm_forward / k), (COMPUTE, t.compute_forward / k)]
                backward += [(COMM, t.comm_backward / k), (COMPUTE, t.compute_backward / k)]
        segment = []
    out = []
    for chain in (_merged(forward), _merged(backward[::-1])):
        serial = k * sum(seconds for _, seconds in chain)
        out.append(est.overlap_efficiency * max(0.0, serial - interleaved(chain, k)))
    return out[0], out[1]


def _activations(est: Estimate, plan: PlanDecisions, copies: int) -> float:
    """Every copy's activations and inputs: the interleaving runs all copies' forward
    before their backward, so each copy keeps its own until then; the casts of parameters
    a mixed policy keeps for backward are made once for all copies."""
    per_copy = sum(runs * t.memory["activations"] for t, runs in est.by_node.values())
    per_copy += sum(local_bytes(layout) for layout in plan.inputs.values())
    return copies * per_copy + est.memory["activations"] - per_copy


def _scaled(terms: Estimate, copies: int) -> Estimate:
    """One op's terms for every copy."""
    return replace(
        terms,
        compute_forward=copies * terms.compute_forward,
        compute_backward=copies * terms.compute_backward,
        comm_forward=copies * terms.comm_forward,
        comm_backward=copies * terms.comm_backward,
        model_flops=copies * terms.model_flops,
        memory={k: copies * v for k, v in terms.memory.items()},
        by_node={},
    )


__all__ = [
    "COMM",
    "COMPUTE",
    "CopiesEstimate",
    "copy_chain",
    "hidden_in",
    "interleaved",
    "with_copies",
]
