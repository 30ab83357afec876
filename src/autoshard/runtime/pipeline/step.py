"""One step of a pipeline schedule on this rank (``PipelineModule`` runs it): each action of
the rank's list is one call, with the state they share (inputs, saved values, what is in
flight). The sends and receives between two other actions are posted as one group when the
next other action comes (``autoshard.schedule.p2p_groups``): NCCL runs a rank's groups in
order, and the schedule orders them so that both sides of every pair agree."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.fx as fx

from autoshard import comm
from autoshard.graph import OpGraph
from autoshard.layout import Layout
from autoshard.runtime.pipeline.copies import run_stage
from autoshard.schedule import COMM, Action
from autoshard.search import Plan


def _value_layout(plan: Plan, og: OpGraph, name: str) -> Layout:
    node = og.by_name[name]
    if og[node].kind == "getitem":
        src = plan.nodes[node.args[0].name]
        return src.strategy.outs[node.args[1]]
    return plan.nodes[name].strategy.outs[0]


class _Kept:
    """A tensor autograd saved for backward, counted while autograd holds it."""

    __slots__ = ("tensor", "count", "stage")

    def __init__(self, tensor: torch.Tensor, count: SavedBytes, stage: int) -> None:
        self.tensor, self.count, self.stage = tensor, count, stage
        count.add(stage, tensor.numel() * tensor.element_size())

    def __del__(self) -> None:
        self.count.add(self.stage, -self.tensor.numel() * self.tensor.element_size())


class SavedBytes:
    """Bytes of the tensors autograd keeps for backward, per stage, now and at most (the
    forwards of a recorded step count them: a view is counted as its own bytes)."""

    def __init__(self) -> None:
        self.now: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    def add(self, stage: int, n: int) -> None:
        self.now[stage] = self.now.get(stage, 0) + n
        self.peak[stage] = max(self.peak.get(stage, 0), self.now[stage])

    def hooks(self, stage: int) -> tuple[Any, Any]:
        return (lambda t: _Kept(t, self, stage)), (lambda kept: kept.tensor)

    def reset(self) -> None:
        self.now, self.peak = {}, {}


class Step:
    """One step's state: the micro-batches' inputs, each stage's saved values, what is in
    flight."""

    def __init__(self, pm: Any, mode: bool, inputs: list[list[Any]]) -> None:
        self.pm, self.mode, self.inputs = pm, mode, inputs
        self.pipe = pm._pipe
        self.cut = self.pipe.cuts[mode]
        self.og, self.plan = pm.captured[mode], pm.plans[mode]
        self.programs: dict[int, fx.GraphModule] = pm.programs[mode]
        self.last = self.cut.num_stages - 1
        self.leaves: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.outs: dict[tuple[int, int], tuple] = {}
        self.inbox: dict[tuple[str, int, int], tuple[comm.Posted, list[torch.Tensor]]] = {}
        self.grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.sent: list[comm.Posted] = []
        self.group: list[Action] = []  # sends and receives waiting for the next other action
        self.losses: list[torch.Tensor] = []
        self.split = self.pipe.schedule.split_backward and mode
        self.ys: dict[tuple[int, int], tuple] = {}
        self.weight_grads: dict[tuple[int, int], list] = {}
        #: (action, start, end) in seconds from the step's start, when the module records
        self.record: list[tuple[str, float, float]] | None = [] if pm.recording else None
        self.t0 = time.perf_counter()
        self.saved = pm.saved_bytes if pm.counting_saved else None
        self.ready: float | None = None
        self.copies = pm.options.copies

    def needs_grad(self, name: str) -> bool:
        info = self.og[self.og.by_name[name]]
        return bool(info.requires_grad) and info.dtype.is_floating_point

    def do(self, a: Action) -> None:
        if a.kind in COMM:
            self.group.append(a)
            return
        self.post()
        # dropout's masks are those of the micro-batch's rows of the whole batch, also when a
        # backward runs a recomputed forward again
        self.pm.run_state.microbatch = max(a.microbatch, 0)
        if self.record is None:
            getattr(self, "_" + a.kind.lower())(a)
            return
        self.ready = None
        start = time.perf_counter()
        getattr(self, "_" + a.kind.lower())(a)
        end = time.perf_counter()
        # a compute action starts once what it reads has arrived
        begin = self.ready if self.ready is not None else start
        self.record.append((str(a), begin - self.t0, end - self.t0))

    def arrived(self) -> None:
        """What the compute running now reads is here (its measured start)."""
        if self.record is not None:
            self.ready = time.perf_counter()

    def _buffers(self, names: tuple[str, ...]) -> list[torch.Tensor]:
        out = []
        for name in names:
            # the shape and dtype the sending stage makes: the captured graph's (captured in
            # the compute dtype, so a value the model upcasts stays float32)
            layout = _value_layout(self.plan, self.og, name)
            shape = layout.local_shape()
            if self.copies > 1:  # the micro-batch's copies' parts, stacked
                shape = (self.copies, *shape)
            out.append(torch.empty(shape, dtype=layout.dtype, device=self.pm.device))
        return out

    def post(self) -> None:
        """Post the sends and receives gathered since the last other action, as one group:
        the sends first, then the receives (a forward's send with a backward's receive)."""
        if not self.group:
            return
        group, self.group = self.group, []
        start = time.perf_counter()
        sends, recvs, received = [], [], []
        for a in group:
            peer = self.pipe.rank_of(a.peer)
            tensors = getattr(self, "_" + a.kind.lower())(a)
            if a.kind.startswith("SEND"):
                sends += [(t, peer) for t in tensors]
            else:
                recvs += [(t, peer) for t in tensors]
                received.append(((a.kind[-1], a.stage, a.microbatch), tensors))
        posted = comm.post_p2p(sends, recvs)
        for key, tensors in received:
            self.inbox[key] = (posted, tensors)
        self.sent.append(posted)
        if self.record is not None:
            end = time.perf_counter()
            self.record += [(str(a), start - self.t0, end - self.t0) for a in group]

    def _recv_f(self, a: Action) -> list[torch.Tensor]:
        return self._buffers(self.cut.receives[a.stage])

    def _f(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        if s == 0:
            received: list[torch.Tensor] = []
        elif ("F", s, i) in self.inbox:
            posted, received = self.inbox.pop(("F", s, i))
            posted.wait()
            self.arrived()
        else:  # the stage before is on this rank
            received = list(self.outs[(s - 1, i)])
        names = self.cut.receives[s]
        leaves = [
            t.detach().requires_grad_(self.needs_grad(n) and torch.is_grad_enabled())
            for t, n in zip(received, names, strict=True)
        ]
        if self.saved is not None and torch.is_grad_enabled():
            with torch.autograd.graph.saved_tensors_hooks(*self.saved.hooks(s)):
                out = self._run(s, i, leaves)
        else:
            out = self._run(s, i, leaves)
        self.leaves[(s, i)] = leaves
        main = len(self.plan.outputs) if s == self.last else len(self.cut.sends(s))
        if self.split:  # what the weight halves of the backward start from
            self.ys[(s, i)] = out[main:]
        out = out[:main]
        if s == self.last:
            self.losses.append(out[self.og.outputs[0]])
        self.outs[(s, i)] = out

    def _run(self, s: int, i: int, leaves: list[torch.Tensor]) -> tuple:
        if self.copies > 1:
            return run_stage(self, s, i, leaves)
        return tuple(self.programs[s](*self.inputs[i], *leaves))

    def _send_f(self, a: Action) -> list[torch.Tensor]:
        out = self.outs[(a.stage, a.microbatch)]
        if not torch.is_grad_enabled():
            self.outs.pop((a.stage, a.microbatch))
        return [t.detach() for t in out]

    def _recv_b(self, a: Action) -> list[torch.Tensor]:
        return self._buffers(tuple(n for n in self.cut.sends(a.stage) if self.needs_grad(n)))

    def _targets(self, s: int, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What the backward of stage ``s`` on micro-batch ``i`` starts from: the loss (the
        last stage's, over the micro-batches' count) or the outputs sent on with the
        gradients that came back for them."""
        out = self.outs.pop((s, i))
        if s == self.last:
            loss = out[self.og.outputs[0]]
            tensors, grads = [loss], [torch.full_like(loss, self.pm._shares[i])]
        else:
            names = self.cut.sends(s)
            wanted = [t for t, n in zip(out, names, strict=True) if self.needs_grad(n)]
            if ("B", s, i) in self.inbox:
                posted, grads = self.inbox.pop(("B", s, i))
                posted.wait()
                self.arrived()
            else:  # the stage after is on this rank
                grads = self.grads_out.pop((s + 1, i))
            pairs = [(t, g) for t, g in zip(wanted, grads, strict=True) if t.requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        return tensors, grads

    def _wanted_leaves(self, s: int, i: int) -> list[torch.Tensor]:
        names = self.cut.receives[s]
        leaves = self.leaves.pop((s, i))
        return [leaf for leaf, n in zip(leaves, names, strict=True) if self.needs_grad(n)]

    def _b(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        tensors, grads = self._targets(s, i)
        last = i == self.pm._last_backward[s]
        self.pm.grad_sync.syncing = last
        # the data-parallel sums (buckets, ZeRO's reduce-scatters) run in the stage's last
        # micro-batch's backward, over the gradients of all of them
        with contextlib.nullcontext() if last else self.pm.zero_units.paused():
            if tensors:
                torch.autograd.backward(tensors, grads)
        self.pm.grad_sync.syncing = True
        self.grads_out[(s, i)] = [
            leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for leaf in self._wanted_leaves(s, i)
        ]

    def _i(self, a: Action) -> None:
        """The backward for the stage's inputs only; the gradients at every weight reader's
        output are kept for ``W``. A stage whose inputs need no gradient (the first) leaves
        the whole backward to ``W``: nothing waits for this half, and one backward costs less
        than the two."""
        s, i = a.stage, a.microbatch
        if not any(self.needs_grad(n) for n in self.cut.receives[s]):
            return  # no stage waits for this half (the first stage): all of it runs in W
        tensors, grads = self._targets(s, i)
        leaves = self._wanted_leaves(s, i)
        ys = [(k, y) for k, y in enumerate(self.ys.pop((s, i))) if y.requires_grad]
        inputs = leaves + [y for _, y in ys]
        got: list[torch.Tensor | None] = [None] * len(inputs)
        if tensors and inputs:
            with self.pm.zero_units.paused():
                got = list(
                    torch.autograd.grad(
                        tensors, inputs, grads, retain_graph=True, allow_unused=True
                    )
                )
        self.grads_out[(s, i)] = [
            g if g is not None else torch.zeros_like(leaf)
            for g, leaf in zip(got[: len(leaves)], leaves, strict=True)
        ]
        self.weight_grads[(s, i)] = [
            (k, y, g) for (k, y), g in zip(ys, got[len(leaves) :], strict=True) if g is not None
        ]

    def _w(self, a: Action) -> None:
        """The backward for the stage's weights, reader by reader from the gradients ``I``
        kept (each reaches only its own weights), or the whole backward where ``I`` ran none;
        summed over replicas by ``REDUCE_GRAD`` (ZeRO's units add them into their buffers
        meanwhile)."""
        s, i = a.stage, a.microbatch
        weights = self.pm._weights_of[s]
        self.pm.grad_sync.syncing = False
        try:
            with self.pm.zero_units.paused():
                if (s, i) not in self.weight_grads:  # ``I`` left the whole backward here
                    self.ys.pop((s, i))
                    self.leaves.pop((s, i))
                    tensors, grads = self._targets(s, i)
                    if tensors:
                        torch.autograd.backward(tensors, grads)
                    return
                for k, y, g in self.weight_grads.pop((s, i)):
                    if weights[k]:
                        torch.autograd.backward([y], [g], inputs=weights[k], retain_graph=True)
        finally:
            self.pm.grad_sync.syncing = True

    def _send_b(self, a: Action) -> list[torch.Tensor]:
        return self.grads_out.pop((a.stage, a.microbatch))

    def _reduce_grad(self, a: Action) -> None:
        """The stage's data-parallel sums: run in its last backward's buckets already, or
        (a split backward) here, once for every micro-batch's weight gradients."""
        if self.split:
            self.pm.grad_sync.sum_accumulated(self.pm._reduce_at[a.stage])
            self.pm.zero_units.sum_held(self.pm._reduce_at[a.stage])

    def finish(self) -> None:
        self.post()
        for posted in self.sent:
            posted.wait()
        self.sent = []

    def loss(self) -> torch.Tensor | None:
        """The model's output over the whole batch: the micro-batches' losses (each a mean
        over its part) weighted by their shares of it, or their outputs joined along the
        batch dim."""
        if not self.losses:
            return None
        parts = [x.detach() for x in self.losses]
        if parts[0].dim() == 0:
            shares = torch.tensor(self.pm._shares, dtype=parts[0].dtype, device=parts[0].device)
            return (torch.stack(parts) * shares).sum()
        return torch.cat(parts)


__all__ = ["SavedBytes", "Step"]
