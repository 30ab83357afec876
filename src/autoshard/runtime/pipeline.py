"""Pipeline parallelism (docs/parallelism/pipeline.md): a ``pp`` mesh axis cuts the model into
stages, each on its own sub-mesh, and a schedule (``autoshard.schedule``) runs micro-batches
through them.

The user's loop does not change: ``loss = pm(*batch)`` runs the whole schedule, forwards and
backwards, and returns the global loss on every rank; ``loss.backward()`` then only scales
the gradients the schedule made by the gradient it is given (1 for a plain ``backward()``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard import comm, watch
from autoshard.graph import OpGraph, StageCut, cut_at_modules, cut_balanced
from autoshard.layout import Layout
from autoshard.lower import lower
from autoshard.mesh import MeshInfo
from autoshard.runtime.parallel import ParallelModule, _local_input
from autoshard.schedule import Action, Schedule
from autoshard.search import Plan


@dataclass(frozen=True)
class Pipe:
    """Where this rank is in the pipeline: the cut (per mode), the schedule, the global ranks
    of each pipeline rank's sub-mesh (``groups[c]``, row-major over the other axes), this
    rank's pipeline coordinate and its position in its sub-mesh."""

    cuts: dict[bool, StageCut]
    schedule: Schedule
    groups: tuple[tuple[int, ...], ...]
    coordinate: int
    position: int

    def rank_of(self, stage: int) -> int:
        """The global rank that holds ``stage`` at this rank's position."""
        return self.groups[self.schedule.placement[stage]][self.position]

    @property
    def stages(self) -> list[int]:
        return self.schedule.stages_of(self.coordinate)


def pipeline_groups(info: MeshInfo) -> tuple[tuple[int, ...], ...]:
    """The global ranks of each ``pp`` coordinate, row-major over the other axes."""
    axis = info.names.index("pp")
    stride = 1
    for size in info.sizes[axis + 1 :]:
        stride *= size
    return tuple(
        tuple(r for r in range(info.num_devices) if (r // stride) % info.sizes[axis] == c)
        for c in range(info.sizes[axis])
    )


def stage_mesh(info: MeshInfo) -> MeshInfo:
    """The mesh one stage is planned on: ``info`` without its ``pp`` axis."""
    keep = [i for i, n in enumerate(info.names) if n != "pp"]
    names = tuple(info.names[i] for i in keep) or ("dp",)
    sizes = tuple(info.sizes[i] for i in keep) or (1,)
    return MeshInfo(names, sizes, tuple(n for n in info.dp if n != "pp"))


def cut_modes(
    captured: dict[bool, OpGraph], num_stages: int, stages: list[str] | None
) -> dict[bool, StageCut]:
    """The stages of each captured mode, cut at the same module paths (given, or chosen on
    the train graph by balancing its FLOPs)."""
    if stages is None:
        og = captured[True]
        cut = cut_balanced(og, num_stages)
        stages = [_block_path(og, name) for name in cut.starts[1:]]
    elif len(stages) != num_stages - 1:
        raise ValueError(
            f"stages={stages}: {num_stages} stages begin at {num_stages - 1} module paths "
            f"(the first stage begins at the model's start), not {len(stages)}"
        )
    return {mode: cut_at_modules(og, list(stages)) for mode, og in captured.items()}


def _block_path(og: OpGraph, name: str) -> str:
    info = og[og.by_name[name]]
    return f"{info.block[0]}.{info.block[1]}" if info.block else info.path


def _value_layout(plan: Plan, og: OpGraph, name: str) -> Layout:
    node = og.by_name[name]
    if og[node].kind == "getitem":
        src = plan.nodes[node.args[0].name]
        return src.strategy.outs[node.args[1]]
    return plan.nodes[name].strategy.outs[0]


class _Finished(torch.autograd.Function):
    """The loss the schedule computed; its backward scales the schedule's gradients by the
    gradient it is given."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, anchor: torch.Tensor, pm: Any) -> torch.Tensor:
        ctx.pm = pm
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.pm._scale_gradients(float(grad))
        return None, None, None


class PipelineModule(ParallelModule):
    """This rank's stages of a pipeline-parallel model and the schedule that runs them."""

    def __init__(self, *args: Any, pipe: Pipe, microbatches: int, **kwargs: Any) -> None:
        object.__setattr__(self, "_pipe", pipe)
        object.__setattr__(self, "_microbatches", microbatches)
        super().__init__(*args, **kwargs)
        self._anchor = torch.zeros((), requires_grad=True)
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # the micro-batch whose backward ends each of this rank's stages: its buckets sum
        order = [a for a in pipe.schedule.actions[pipe.coordinate] if a.kind in ("B", "W")]
        self._last_backward = {a.stage: a.microbatch for a in order}

    def _lower_programs(
        self, captured: dict[bool, OpGraph], plans: dict[bool, Plan], rank: int, device, tensors
    ) -> dict[bool, Any]:
        pipe = self._pipe
        return {
            mode: {
                s: lower(og, plans[mode], rank, device, tensors, self._state, (pipe.cuts[mode], s))
                for s in pipe.stages
            }
            for mode, og in captured.items()
        }

    # -- the step ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self._forward_only(args, kwargs)
        watch.step(self._state.step + 1)
        self._grad_sync.reset()
        params = [p for p in self.parameters() if p.requires_grad]
        stash = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        run = _Run(self, True, self._split(args, kwargs, True))
        for action in self._pipe.schedule.actions[self._pipe.coordinate]:
            run.do(action)
        run.finish()
        self._sum_tied()
        self._pending = []
        for p in params:
            before = stash[id(p)]
            part = p.grad
            if before is not None:
                p.grad = before if part is None else before.add_(part)
            self._pending.append((p, part if before is not None else None))
        self._state.step += 1
        loss = self._broadcast_loss(run.loss(), True)
        return _Finished.apply(loss, self._anchor, self)

    def _scale_gradients(self, factor: float) -> None:
        if factor == 1.0:
            return
        with torch.no_grad():
            for p, part in self._pending:
                if p.grad is None:
                    continue
                if part is None:
                    p.grad.mul_(factor)
                else:
                    p.grad.add_(part, alpha=factor - 1.0)

    def _forward_only(self, args: tuple, kwargs: dict) -> Any:
        mode = self.training
        run = _Run(self, mode, self._split(args, kwargs, mode))
        for i in range(self._microbatches):
            for s in self._pipe.stages:
                if s > 0 and self._pipe.schedule.placement[s - 1] != self._pipe.coordinate:
                    run.do(Action("RECV_F", s, i, s - 1))
                with torch.no_grad():
                    run.do(Action("F", s, i))
                if s < len(self._pipe.schedule.placement) - 1 and (
                    self._pipe.schedule.placement[s + 1] != self._pipe.coordinate
                ):
                    run.do(Action("SEND_F", s, i, s + 1))
        run.finish()
        return self._broadcast_loss(run.loss(), mode)

    def _split(self, args: tuple, kwargs: dict, mode: bool) -> list[list[Any]]:
        """Each micro-batch's local inputs: every tensor cut into ``microbatches`` along its
        first dim, each part this rank's part of the plan's input layout."""
        captured, plan = self._captured[mode], self._plans[mode]
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise ValueError(f"inputs {spec} do not match the example inputs {captured.in_spec}")
        m = self._microbatches
        parts: list[list[Any]] = [[] for _ in range(m)]
        cast = self.precision.compute is not None
        for x, name in zip(flat, captured.inputs, strict=True):
            layout = plan.inputs[name]
            if isinstance(x, torch.Tensor):
                if x.dim() == 0 or x.shape[0] != layout.shape[0] * m:
                    raise ValueError(
                        f"input {name} has shape {tuple(x.shape)}; under {m} micro-batches "
                        f"the pipeline takes the whole batch, {m} x {layout.shape}"
                    )
                chunks = x.chunk(m)
            else:
                chunks = [x] * m
            for i in range(m):
                parts[i].append(_local_input(chunks[i], layout, self._rank, name, cast))
        return parts

    def _sum_tied(self) -> None:
        """A weight held by several stages (a tied embedding and head) has one gradient: the
        sum of theirs, over the ranks at this position of the pipeline ranks that hold it."""
        cut, pipe = self._pipe.cuts[True], self._pipe
        for fqn in sorted(self.local_tensors()):
            holders = sorted({pipe.rank_of(s) for s in cut.holders(fqn)})
            t = self.local_tensors()[fqn]
            if len(holders) > 1 and isinstance(t, torch.nn.Parameter) and t.grad is not None:
                comm.all_reduce_(t.grad, holders)

    def _broadcast_loss(self, loss: torch.Tensor | None, mode: bool) -> Any:
        pipe, captured, plan = self._pipe, self._captured[mode], self._plans[mode]
        last = pipe.groups[pipe.schedule.placement[-1]]
        _, dst = plan.outputs[captured.outputs[0]]
        if loss is None:
            shape = (
                dst.shape if not dst.shape else (dst.shape[0] * self._microbatches, *dst.shape[1:])
            )
            loss = torch.empty(shape, dtype=self.precision.compute or dst.dtype)
        everyone = [
            last[0],
            *[r for r in range(torch.distributed.get_world_size()) if r != last[0]],
        ]
        return comm.broadcast_(loss.contiguous(), everyone)

    @property
    def schedule(self) -> Schedule:
        return self._pipe.schedule


class _Run:
    """One step's state: the micro-batches' inputs, each stage's saved values, what is in
    flight."""

    def __init__(self, pm: PipelineModule, mode: bool, inputs: list[list[Any]]) -> None:
        self.pm, self.mode, self.inputs = pm, mode, inputs
        self.pipe = pm._pipe
        self.cut = self.pipe.cuts[mode]
        self.og, self.plan = pm._captured[mode], pm._plans[mode]
        self.programs: dict[int, fx.GraphModule] = pm._programs[mode]
        self.last = self.cut.num_stages - 1
        self.leaves: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.outs: dict[tuple[int, int], tuple] = {}
        self.inbox: dict[tuple[str, int, int], tuple[comm.Posted, list[torch.Tensor]]] = {}
        self.grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.sent: list[comm.Posted] = []
        self.losses: list[torch.Tensor] = []

    def needs_grad(self, name: str) -> bool:
        info = self.og[self.og.by_name[name]]
        return bool(info.requires_grad) and info.dtype.is_floating_point

    def do(self, a: Action) -> None:
        getattr(self, "_" + a.kind.lower())(a)

    def _buffers(self, names: tuple[str, ...]) -> list[torch.Tensor]:
        out = []
        for name in names:
            layout = _value_layout(self.plan, self.og, name)
            dtype = self.pm.precision.compute or layout.dtype
            dtype = dtype if layout.dtype.is_floating_point else layout.dtype
            out.append(torch.empty(layout.local_shape(), dtype=dtype))
        return out

    def _post_receive(self, a: Action, names: tuple[str, ...]) -> None:
        """Buffers for ``names`` from ``a.peer``'s rank, posted; what reads them waits."""
        bufs = self._buffers(names)
        peer = self.pipe.rank_of(a.peer)
        posted = comm.post_p2p([], [(b, peer) for b in bufs])
        self.inbox[(a.kind[-1], a.stage, a.microbatch)] = (posted, bufs)

    def _recv_f(self, a: Action) -> None:
        self._post_receive(a, self.cut.receives[a.stage])

    def _f(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        if s == 0:
            received: list[torch.Tensor] = []
        elif ("F", s, i) in self.inbox:
            posted, received = self.inbox.pop(("F", s, i))
            posted.wait()
        else:  # the stage before is on this rank
            received = list(self.outs[(s - 1, i)])
        names = self.cut.receives[s]
        leaves = [
            t.detach().requires_grad_(self.needs_grad(n) and torch.is_grad_enabled())
            for t, n in zip(received, names, strict=True)
        ]
        out = self.programs[s](*self.inputs[i], *leaves)
        self.leaves[(s, i)] = leaves
        if s == self.last:
            self.losses.append(out[self.og.outputs[0]])
            self.outs[(s, i)] = out
        else:
            self.outs[(s, i)] = tuple(out)

    def _send_f(self, a: Action) -> None:
        out = self.outs[(a.stage, a.microbatch)]
        if not torch.is_grad_enabled():
            self.outs.pop((a.stage, a.microbatch))
        peer = self.pipe.rank_of(a.peer)
        self.sent.append(comm.post_p2p([(t.detach(), peer) for t in out], []))

    def _recv_b(self, a: Action) -> None:
        self._post_receive(a, tuple(n for n in self.cut.sends(a.stage) if self.needs_grad(n)))

    def _b(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        out = self.outs.pop((s, i))
        if s == self.last:
            loss = out[self.og.outputs[0]]
            tensors, grads = [loss], [torch.full_like(loss, 1.0 / self.pm._microbatches)]
        else:
            names = self.cut.sends(s)
            wanted = [t for t, n in zip(out, names, strict=True) if self.needs_grad(n)]
            if ("B", s, i) in self.inbox:
                posted, grads = self.inbox.pop(("B", s, i))
                posted.wait()
            else:  # the stage after is on this rank
                grads = self.grads_out.pop((s + 1, i))
            pairs = [(t, g) for t, g in zip(wanted, grads, strict=True) if t.requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        self.pm._grad_sync.syncing = i == self.pm._last_backward[s]
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.pm._grad_sync.syncing = True
        leaves = self.leaves.pop((s, i))
        names = self.cut.receives[s]
        self.grads_out[(s, i)] = [
            leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for leaf, n in zip(leaves, names, strict=True)
            if self.needs_grad(n)
        ]

    def _send_b(self, a: Action) -> None:
        grads = self.grads_out.pop((a.stage, a.microbatch))
        peer = self.pipe.rank_of(a.peer)
        self.sent.append(comm.post_p2p([(g, peer) for g in grads], []))

    def _reduce_grad(self, a: Action) -> None:
        """The stage's data-parallel sums ran in its last backward's buckets."""

    def finish(self) -> None:
        for posted in self.sent:
            posted.wait()
        self.sent = []

    def loss(self) -> torch.Tensor | None:
        """The model's output over the whole batch: the mean of the micro-batches' losses
        (each a mean over its part), or their outputs joined along the batch dim."""
        if not self.losses:
            return None
        parts = [x.detach() for x in self.losses]
        if parts[0].dim() == 0:
            return torch.stack(parts).mean()
        return torch.cat(parts)


def microbatch_example(example: tuple, kwargs: dict | None, m: int) -> tuple[tuple, dict | None]:
    """The first micro-batch of the example inputs: every tensor's first dim cut in ``m``."""

    def first(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0 or x.shape[0] % m:
            raise ValueError(
                f"microbatches={m}: an input of shape {tuple(x.shape)} does not split into {m} "
                "equal micro-batches along its first dim"
            )
        return x[: x.shape[0] // m]

    return pytree.tree_map(first, example), pytree.tree_map(first, kwargs)


def pipeline_plans(
    plans: dict[bool, Plan], cuts: dict[bool, StageCut], pipe_stages: list[int], ranks: tuple
) -> dict[bool, Plan]:
    """Each mode's plan as this rank runs it: on its sub-mesh's global ranks, with only the
    parameters and buffers of its stages."""
    out = {}
    for mode, plan in plans.items():
        mine = set().union(*(cuts[mode].params[s] for s in pipe_stages))
        moved = plan.on_ranks(ranks)
        out[mode] = dataclasses.replace(
            moved, params={k: v for k, v in moved.params.items() if k in mine}
        )
    return out


__all__ = [
    "Pipe",
    "PipelineModule",
    "cut_modes",
    "microbatch_example",
    "pipeline_groups",
    "pipeline_plans",
    "stage_mesh",
]
