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
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard import comm, watch
from autoshard.graph import OpGraph, StageCut, cut_at_modules, cut_balanced
from autoshard.lower import lower, weight_readers
from autoshard.mesh import MeshInfo
from autoshard.redistribution import gather_tensor
from autoshard.runtime.offload import table_names
from autoshard.runtime.pipeline.copies import copy_shares, inner_shares, split_copies
from autoshard.runtime.pipeline.step import SavedBytes, Step
from autoshard.runtime.program import CountedLoss, ParallelModule, local_input
from autoshard.schedule import Schedule, forward_only
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
    return MeshInfo(names, sizes, tuple(n for n in info.dp if n != "pp"), info.cp)


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

    whole_batch = True  # forward cuts the global batch into micro-batches

    def __init__(self, *args: Any, pipe: Pipe, microbatches: int, **kwargs: Any) -> None:
        object.__setattr__(self, "_pipe", pipe)
        object.__setattr__(self, "_microbatches", microbatches)
        super().__init__(*args, **kwargs)
        self._anchor = torch.zeros((), requires_grad=True, device=self.device)
        #: record each action's start and end in the steps that follow (``timeline``)
        self.recording = False
        #: the last recorded step of this rank: (action, start s, end s) from the step's start
        self.timeline: list[tuple[str, float, float]] = []
        #: count the bytes autograd keeps for backward in the steps that follow (``saved_bytes``;
        #: not with ``recording``: the hooks keep every saved tensor alive as long as autograd
        #: does, which slows a split backward's retained graphs, and so the timeline)
        self.counting_saved = False
        #: in counted steps: the bytes autograd keeps for backward, per stage (``.peak``)
        self.saved_bytes = SavedBytes()
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._counted = {mode: CountedLoss.of(og) for mode, og in self._captured.items()}
        self._shares: list[float] = []
        self._copy_shares: list[list[float]] = []  # under copies: each copy's in its micro-batch
        self._inner_shares: list[dict] = []  # and of each counted loss inside the loss
        self._inner_counted: dict[bool, dict] = {}  # those losses, found once a mode
        # each weight reader's trainable tensors per stage (what a W of a split backward
        # reaches), in the order the stage's program returns the readers' outputs
        og, held = self._captured[True], self.local_tensors()
        self._weights_of = {
            s: [
                [held[f] for f in og[n].params if f in held and held[f].requires_grad]
                for n in weight_readers(og, pipe.cuts[True], s)
            ]
            for s in pipe.stages
        }
        # a split backward's sums: each tensor at the last REDUCE_GRAD among this rank's
        # stages that hold it (a weight tied between two stages of a V is one tensor here)
        reduces = [
            a.stage for a in pipe.schedule.actions[pipe.coordinate] if a.kind == "REDUCE_GRAD"
        ]
        last_at = {id(t): s for s in reduces for ws in self._weights_of[s] for t in ws}
        self._reduce_at = {
            s: list(
                {id(t): t for ws in self._weights_of[s] for t in ws if last_at[id(t)] == s}.values()
            )
            for s in reduces
        }
        # the micro-batch whose backward ends each of this rank's stages: its buckets sum
        order = [a for a in pipe.schedule.actions[pipe.coordinate] if a.kind in ("B", "W")]
        self._last_backward = {a.stage: a.microbatch for a in order}

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of a training step: the captured graph is one micro-batch's, a step
        runs every micro-batch of the global batch."""
        return super().flops_per_step * self._microbatches

    def _held_elsewhere(self, model: nn.Module) -> frozenset[str]:
        """The parameters only other pipeline ranks' stages hold. A table offloaded to the
        host is looked up in one stage alone: one read by two (a tied embedding and head,
        its gradient summed between stages on the device) is named."""
        cut, og = self._pipe.cuts[True], self._captured[True]
        canonical = {n: info.fqn for info in og.state() for n in info.names}
        glob = (self.options.offload or {}).get("embeddings")
        for fqn in table_names(model, glob) if glob else ():
            stages = cut.holders(canonical.get(fqn, fqn))
            if len(stages) > 1:
                raise ValueError(
                    f"offload['embeddings']: {fqn} is read by pipeline stages {stages} (a tied "
                    "embedding and head); an offloaded table is read by its lookups in one "
                    "stage alone: untie it or leave it on the device"
                )
        mine = set(self._pipe.stages)
        return frozenset(f for f in set(canonical.values()) if not mine & set(cut.holders(f)))

    def _each_program(self) -> Any:
        return (program for stages in self._programs.values() for program in stages.values())

    def _lower_programs(
        self, captured: dict[bool, OpGraph], plans: dict[bool, Plan], rank: int, device, tensors
    ) -> dict[bool, Any]:
        pipe = self._pipe
        return {
            mode: {
                s: lower(
                    og,
                    plans[mode],
                    rank,
                    device,
                    tensors,
                    self._state,
                    (pipe.cuts[mode], s),
                    recompute=self._recompute if mode else "none",
                    weights=mode and pipe.schedule.split_backward,
                    wrap=self._wrap(mode, s),
                )
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
        self._zero.reset()
        if self._tables is not None:
            self._tables.reset()
        params = [p for p in self.parameters() if p.requires_grad]
        stash = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        if self.counting_saved:
            self.saved_bytes.reset()
        run = Step(self, True, self._split(args, kwargs, True))
        for action in self._pipe.schedule.actions[self._pipe.coordinate]:
            run.do(action)
        run.finish()
        self._state.microbatch = 0
        if run.record is not None:
            self.timeline = run.record
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

    def _route_when_final(self, on_device: dict[str, torch.Tensor], shards: set[str]) -> None:
        """No gradient leaves for the optimizer offload while the schedule runs: a stage's
        sums land before the step has summed the stages' tied weights and before
        ``loss.backward`` scales what the schedule made (``_scale_gradients`` routes them)."""

    def _scale_gradients(self, factor: float) -> None:
        """Scale this step's part of each gradient by ``factor``; they are final then, and
        those of the optimizer offload's tensors leave for the host."""
        if factor != 1.0:
            with torch.no_grad():
                for p, part in self._pending:
                    if p.grad is None:
                        continue
                    if part is None:
                        p.grad.mul_(factor)
                    else:
                        p.grad.add_(part, alpha=factor - 1.0)
        if self._offload is not None:
            self._offload.route(p for p, _ in self._pending)

    def _forward_only(self, args: tuple, kwargs: dict) -> Any:
        mode = self.training
        run = Step(self, mode, self._split(args, kwargs, mode))
        with torch.no_grad():
            for action in forward_only(self._pipe.schedule).actions[self._pipe.coordinate]:
                run.do(action)
        run.finish()
        self._state.microbatch = 0
        return self._broadcast_loss(run.loss(), mode)

    def _split(self, args: tuple, kwargs: dict, mode: bool) -> list[list[Any]]:
        """Each micro-batch's local inputs: every tensor cut into ``microbatches`` along its
        first dim, each part this rank's part of the plan's input layout. Sets ``_shares``:
        each micro-batch's weight in the whole batch's loss (``CountedLoss``)."""
        captured, plan = self._captured[mode], self._plans[mode]
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise ValueError(f"inputs {spec} do not match the example inputs {captured.in_spec}")
        m, k = self._microbatches, self.options.copies
        whole: list[list[Any]] = [[] for _ in range(m)]
        for x, name in zip(flat, captured.inputs, strict=True):
            layout = plan.inputs[name]  # under copies, one copy's
            if isinstance(x, torch.Tensor):
                if x.dim() == 0 or x.shape[0] != layout.shape[0] * m * k:
                    shown = f"{m} x {k} copies x" if k > 1 else f"{m} x"
                    raise ValueError(
                        f"input {name} has shape {tuple(x.shape)}; under {m} micro-batches "
                        f"the pipeline takes the whole batch, {shown} {layout.shape}"
                    )
                chunks = x.chunk(m)
            else:
                chunks = [x] * m
            for i in range(m):
                whole[i].append(chunks[i])
        cast, counted = self.precision.compute is not None, self._counted[mode]
        if k > 1:
            parts, copies = split_copies(self, whole, mode, cast)
            weights = counted.weights(copies) if counted is not None else None
            self._shares, self._copy_shares = copy_shares(weights, m, k)
            self._inner_shares = inner_shares(self, copies, mode)
            return parts
        parts = [
            [
                local_input(x, plan.inputs[n], self._rank, n, cast, self.device)
                for x, n in zip(xs, captured.inputs, strict=True)
            ]
            for xs in whole
        ]
        shares = counted.weights(whole) if counted is not None else None
        self._shares = shares or [1.0 / m] * m
        return parts

    def _sum_tied(self) -> None:
        """A weight held by several stages (a tied embedding and head) has one gradient: the
        sum of theirs, over the ranks at this position of the pipeline ranks that hold it."""
        cut, pipe = self._pipe.cuts[True], self._pipe
        for fqn in sorted(self.local_tensors()):
            holders = sorted({pipe.rank_of(s) for s in cut.holders(fqn)})
            t = self.local_tensors()[fqn]
            if len(holders) > 1 and isinstance(t, torch.nn.Parameter) and t.grad is not None:
                # a shard on the host (parameter offload): summed on the device, where NCCL sums
                grad = t.grad.to(self.device)
                comm.all_reduce_(grad, holders)
                if grad is not t.grad:
                    t.grad.copy_(grad)

    def _broadcast_loss(self, loss: torch.Tensor | None, mode: bool) -> Any:
        pipe, captured, plan = self._pipe, self._captured[mode], self._plans[mode]
        last = pipe.groups[pipe.schedule.placement[-1]]
        _, dst = plan.outputs[captured.outputs[0]]
        if loss is None:
            shape = (
                dst.shape if not dst.shape else (dst.shape[0] * self._microbatches, *dst.shape[1:])
            )
            # as the last stage makes it: the captured graph's dtype (a float32 loss of a
            # model computing in bfloat16 stays float32)
            loss = torch.empty(shape, dtype=dst.dtype, device=self.device)
        everyone = [
            last[0],
            *[r for r in range(torch.distributed.get_world_size()) if r != last[0]],
        ]
        return comm.broadcast_(loss.contiguous(), everyone)

    def holders(self, fqn: str) -> int:
        """How many ranks hold the same values as this rank's ``local_tensors()[fqn]``: its
        copies in this stage's sub-mesh, times the pipeline ranks whose stages hold it (a
        tied weight's gradient is summed over them)."""
        placement = self._pipe.schedule.placement
        stages = self._pipe.cuts[True].holders(self._canonical(fqn))
        return super().holders(fqn) * len({placement[s] for s in stages})

    def checkpoint_aliases(self) -> dict[str, str]:
        """Each tied name of a parameter -> the name checkpoints save it under, for every
        stage's parameters (the same on every rank)."""
        canonical = {n: info.fqn for info in self._captured[True].state() for n in info.names}
        return {k: canonical[k] for k in self._full_keys if canonical.get(k, k) != k}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device state dict on every rank, each stage's tensors from the first
        rank that holds them (tied weights under every name); a collective of the world."""
        held = {}
        for fqn, t in self.local_tensors().items():
            t = self._whole_local(fqn, t)
            layout = self._layouts[fqn]
            whole = t if layout.num_devices == 1 else gather_tensor(t, layout)
            held[fqn] = whole.clone() if whole.data_ptr() == t.data_ptr() else whole
        everyone = comm.all_gather_object({f: (tuple(w.shape), w.dtype) for f, w in held.items()})
        owner: dict[str, int] = {}
        for r, facts in enumerate(everyone):
            for fqn in facts:
                owner.setdefault(fqn, r)
        out = {}
        world = list(range(len(everyone)))
        for fqn in sorted(owner):
            shape, dtype = everyone[owner[fqn]][fqn]
            x = (
                held[fqn].contiguous()
                if self._rank == owner[fqn]
                else torch.empty(shape, dtype=dtype, device=self.device)
            )
            out[fqn] = comm.broadcast_(x, [owner[fqn], *(r for r in world if r != owner[fqn])])
        named = {}
        for key in self._full_keys:
            name = next((n for n in self._aliases.get(key, [key]) if n in out), None)
            if name is not None:
                named[key] = out[name]
        return named

    @property
    def schedule(self) -> Schedule:
        return self._pipe.schedule


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
