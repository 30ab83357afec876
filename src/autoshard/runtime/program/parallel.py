"""``autoshard.parallelize``: a single-device model in, this rank's part of the parallel model out.

pm = autoshard.parallelize(model, (x, y), {"dp": 2, "tp": 2}, strategies={...})
loss = pm(*autoshard.shard_inputs((x, y), pm))   # the global loss, on every rank
loss.backward(); opt.step()                        # any elementwise torch.optim optimizer
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard import watch
from autoshard.devices import rank_device
from autoshard.graph import OpGraph
from autoshard.layout import Layout, LayoutError
from autoshard.lower import RunState, attr_name, check_recompute, lower
from autoshard.options import Options
from autoshard.redistribution import gather_tensor, redistribute, shard_tensor
from autoshard.runtime.offload import (
    HostTier,
    activation_offload,
    embedding_offload,
    optimizer_offload,
)
from autoshard.runtime.program.copies import check_copies, run_copies
from autoshard.runtime.program.grad_sync import GradSync
from autoshard.runtime.program.inputs import local_input, part_of
from autoshard.runtime.program.offloaded import OffloadedState
from autoshard.runtime.program.replicas import replica_group, sync_replicas
from autoshard.runtime.program.zero_plan import build_zero
from autoshard.runtime.state import fill
from autoshard.search import Plan


class ParallelModule(OffloadedState, nn.Module):
    """This rank's part of the model: parameter shards and the lowered programs (train, eval)."""

    #: whether forward takes the whole global batch (a pipeline's) rather than this rank's part
    whole_batch = False
    #: under copies: the train graph's nodes whose value is the copies' mean (``copy_means``)
    copy_means: frozenset[str] = frozenset()

    def __init__(
        self,
        model: nn.Module,
        captured: dict[bool, OpGraph],
        plans: dict[bool, Plan],
        rank: int,
        options: Options,
    ) -> None:
        """``options`` as ``parallelize`` made them (``options.precision`` resolved for
        ``model``): the runtime reads its seed, replicas, buckets, precision, ZeRO 3's
        resharding, init and recompute."""
        super().__init__()
        #: the device this rank computes on, where its shards and every tensor it makes live
        self.device = rank_device(options.device)
        #: every choice this module was made with (``autoshard.options.Options``)
        self.options = options = options.replace(device=self.device)
        self._recompute = check_recompute(options.recompute or "none")
        self.precision = precision = options.policy
        # the plans as this module runs them: copies under its precision policy
        plans = {mode: dataclasses.replace(p, precision=precision) for mode, p in plans.items()}
        self.plan, self._plans = plans[True], plans
        self._captured = captured
        self._rank = rank
        self._state = RunState(seed=options.seed)
        self._grad_sync = GradSync(rank, options.bucket_cap_mb, self.precision.reduce)
        self._full_keys = list(model.state_dict().keys())
        self._aliases = captured[True].aliases
        tensors, device = self._local_state(model, captured)
        real = {fqn: t for fqn, t in tensors.items() if not t.is_meta}
        layouts = {fqn: self._layouts[fqn] for fqn in real if fqn in self._layouts}
        sync_replicas(real, layouts, rank, options.replicas)
        self._zero, fetchers, shards = self._sharded(model, tensors, options, device)
        for fqn, shard in shards.items():  # the optimizer steps the shards
            self.register_parameter(attr_name(fqn), shard)
        self._make_real(tensors, set(shards), device)
        for fqn, p in self.plan.params.items():
            summed = p.grad_partial is not None and tensors[fqn].requires_grad
            if summed and fqn not in shards and not self._on_host(tensors[fqn]):
                self._grad_sync.watch(tensors[fqn], p.grad_partial, p.layout)
        order = captured[True].gradient_order
        self._grad_sync.arrange([tensors[fqn] for fqn in order if fqn in tensors])
        tensors |= fetchers
        self.activation_offload = activation_offload(options.offload, device, self._resident)
        self._programs = self._lower_programs(captured, plans, rank, device, tensors)
        for program in self._each_program() if self._tables else ():
            self._tables.rewrite(program, attr_name)
        self._offload = None  # placed after init fills the weights its master copies start from
        if options.init is not None:
            fill(self, model, options.init, options.seed)
        if options.copies > 1:
            check_copies(self._programs[True], options.copies, captured[True].mutations)
        # the host tier's parameters are stepped where they are, by the user's optimizer (but
        # ZeRO 3's with NVMe: the offload keeps them in its files)
        on_device = {k: t for k, t in self.local_tensors().items() if not self._on_host(t)}
        hosted = (self._host, shards)
        self._offload = optimizer_offload(options.offload, on_device, device, self._rank, *hosted)
        if self._offload is not None:
            self._route_when_final(on_device, set(shards))

    def _route_when_final(self, on_device: dict[str, torch.Tensor], shards: set[str]) -> None:
        """Each final gradient of the optimizer offload's tensors leaves for the host at once:
        a unit's or a bucket's sum as it lands, an unsummed one as backward accumulates it."""
        self._zero.summed = self._grad_sync.summed = self._offload.route
        unsummed = (t for fqn, t in on_device.items() if fqn not in shards)
        self._offload.route_when_accumulated(t for t in unsummed if not self._grad_sync.sums(t))

    def _sharded(
        self, model: nn.Module, tensors: dict[str, torch.Tensor], options: Options, device: Any
    ) -> tuple[Any, dict[str, Any], dict[str, nn.Parameter]]:
        """The host tier (embedding tables made host parameters in ``tensors``, ZeRO 3's
        shards under parameter offload), then ZeRO's units, fetchers and shards."""
        offload = options.offload or {}
        hosted = offload.get("parameters") or offload.get("embeddings")
        self._host = HostTier(device) if hosted else None
        self._tables = embedding_offload(
            model,
            self.plan,
            tensors,
            offload.get("embeddings"),
            self._host,
            self._rank,
            self._held_elsewhere(model),
        )
        tables = set(self._tables.tables) if self._tables else set()
        for fqn in tables:  # ZeRO and the buckets leave them: their lookups sum their rows
            self.register_parameter(attr_name(fqn), tensors[fqn])
        zero, fetchers, shards = build_zero(
            self._captured[True],
            self.plan,
            {fqn: t for fqn, t in tensors.items() if fqn not in tables},
            self._rank,
            self.precision.reduce,
            options.reshard_after_forward,
            device,
            self._host,
        )
        if offload.get("parameters") and not any(map(self._on_host, shards.values())):
            raise ValueError(
                "offload['parameters']=True: no parameter of this plan is under ZeRO 3 on rank "
                f"{self._rank} (zero={options.zero!r}): the host holds ZeRO 3's shards, made over "
                "data-parallel replicas; give zero=3 on a mesh with a data-parallel axis"
            )
        return zero, fetchers, shards

    def _lower_programs(
        self,
        captured: dict[bool, OpGraph],
        plans: dict[bool, Plan],
        rank: int,
        device: torch.device,
        tensors: dict[str, Any],
    ) -> dict[bool, Any]:
        """The programs this rank runs, by mode (train, eval)."""
        return {
            mode: lower(
                captured[mode],
                plans[mode],
                rank,
                device,
                tensors,
                self._state,
                recompute=self._recompute if mode else "none",
                wrap=self._wrap(mode, 0),
            )
            for mode in captured
        }

    def _held_elsewhere(self, model: nn.Module) -> frozenset[str]:
        """Parameters of the model this rank's programs do not read (a pipeline's other
        stages')."""
        return frozenset()

    def _each_program(self) -> Iterator[Any]:
        """Every GraphModule this rank runs (train, eval)."""
        return iter(self._programs.values())

    def _resident(self) -> Iterator[torch.Tensor]:
        """What the activation offload leaves on the device: parameters and buffers."""
        return itertools.chain(self.parameters(), self.buffers())

    def _wrap(self, mode: bool, program: int) -> Any:
        """What the lowering of a train ``program`` wraps the offloaded blocks in."""
        offload = self.activation_offload
        return offload.wrap(program) if mode and offload is not None else None

    def _local_state(
        self, model: nn.Module, captured: dict[bool, OpGraph]
    ) -> tuple[dict[str, torch.Tensor], torch.device]:
        """This rank's local tensor of every parameter and buffer, registered on the module:
        cut from the model wherever it was built, then moved to the rank's device (a shard
        at a time: the whole model is never there)."""
        device = self.device
        self._layouts: dict[str, Layout] = {}
        values = dict(model.named_parameters(remove_duplicate=False))
        values |= dict(model.named_buffers(remove_duplicate=False))
        # Tensors export lifted out of the code (an empty KV cache): not part of the state.
        constants = {fqn: t for og in captured.values() for fqn, t in og.constants.items()}
        values |= constants
        tensors: dict[str, torch.Tensor] = {}
        for fqn, p in self.plan.params.items():
            if fqn not in constants:
                self._layouts[fqn] = p.layout
            full = values[fqn].detach()
            local = (  # a meta tensor gets its memory once ZeRO has cut it (_make_real)
                shard_tensor(full, p.layout, self._rank).to(device, non_blocking=True)
                if not full.is_meta
                else torch.empty(p.layout.local_shape(), dtype=full.dtype, device="meta")
            )
            if isinstance(values[fqn], nn.Parameter):
                tensors[fqn] = nn.Parameter(local, requires_grad=values[fqn].requires_grad)
                self.register_parameter(attr_name(fqn), tensors[fqn])
            else:
                tensors[fqn] = local
                self.register_buffer(attr_name(fqn), local, persistent=fqn not in constants)
        return tensors, device

    def _make_real(
        self, tensors: dict[str, torch.Tensor], sharded: set[str], device: torch.device
    ) -> None:
        """Memory for the local tensors still on the meta device (a model built there), left
        unset: ``init`` fills them."""
        for fqn, t in tensors.items():
            if not t.is_meta or fqn in sharded:
                continue
            empty = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, nn.Parameter):
                tensors[fqn] = nn.Parameter(empty, requires_grad=t.requires_grad)
                self.register_parameter(attr_name(fqn), tensors[fqn])
            else:
                tensors[fqn] = empty
                self.register_buffer(attr_name(fqn), empty)

    # -- running ----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mode = self.training
        if mode:
            watch.step(self._state.step + 1)
            self._grad_sync.reset()
            self._zero.reset()
            if self._tables is not None:
                self._tables.reset()
        captured, plan = self._captured[mode], self._plans[mode]
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise ValueError(f"inputs {spec} do not match the example inputs {captured.in_spec}")
        cast = self.precision.compute is not None
        if self.options.copies > 1:
            results = run_copies(self, flat, mode, local_input)
        else:
            local = [
                local_input(x, plan.inputs[name], self._rank, name, cast, self.device)
                for x, name in zip(flat, captured.inputs, strict=True)
            ]
            with self._zero.saving():
                results = self._programs[mode](*local)
        with torch.no_grad():
            for i, fqn in captured.mutations.items():
                # Through .data: the step's autograd graph saved the old buffer (batch norm's
                # running stats), and its backward does not read the values, only the version.
                getattr(self, attr_name(fqn)).data.copy_(results[i])
        if mode:
            self._state.step += 1
        outputs = [results[i] for i in captured.outputs]
        return pytree.tree_unflatten(outputs, captured.out_spec)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the data-parallel gradient sums of the backwards inside (micro-batches of
        gradient accumulation); the first backward after it sums the accumulated gradients."""
        before = self._grad_sync.syncing
        self._grad_sync.syncing = False
        try:
            with self._zero.paused():
                yield
        finally:
            self._grad_sync.syncing = before

    @property
    def rank(self) -> int:
        """This rank in the plan's mesh."""
        return self._rank

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of a training step over the example batch's global size: every matrix
        product forward and backward, as torch's FlopCounterMode counts them on one device
        (the numerator of MFU)."""
        return sum(info.flops for info in self._captured[True].ops()) * self.options.copies

    @property
    def input_names(self) -> list[str]:
        """The model's tensor inputs, in order (the keys of ``plan.inputs``)."""
        return list(self._captured[True].inputs)

    # -- the faces a pipeline's executor steps through (runtime.pipeline) -----------------------

    @property
    def captured(self) -> dict[bool, OpGraph]:
        """The captured graphs, by mode (train, eval)."""
        return self._captured

    @property
    def plans(self) -> dict[bool, Plan]:
        """The plans this module runs, by mode (train, eval), under its precision."""
        return self._plans

    @property
    def programs(self) -> dict[bool, Any]:
        """What this rank runs, by mode: a GraphModule (a pipeline's: one a stage)."""
        return self._programs

    @property
    def grad_sync(self) -> GradSync:
        """The gradient buckets whose sums overlap backward."""
        return self._grad_sync

    @property
    def zero_units(self) -> Any:
        """ZeRO's shards and units (``runtime.program.zero.Zero``)."""
        return self._zero

    def program(self, train: bool = True) -> torch.fx.GraphModule:
        """The GraphModule this rank runs (``print(pm.program().code)``)."""
        return self._programs[train]

    # -- state ------------------------------------------------------------------------------------

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by name: the plan's local tensors, or for a
        parameter under ZeRO this rank's rows of it (what the optimizer steps)."""
        return {fqn: getattr(self, attr_name(fqn)) for fqn in self._layouts}

    def holders(self, fqn: str) -> int:
        """How many ranks hold the same values as this rank's ``local_tensors()[fqn]``."""
        fqn = self._canonical(fqn)
        copies = len(replica_group(self._layouts[fqn], self._rank))
        return copies // self._zero.group_size(fqn)

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def run_state(self) -> RunState:
        """The step counter the dropout masks are keyed by (checkpoints save it)."""
        return self._state

    def checkpoint_parts(self) -> dict[str, tuple[torch.Tensor, tuple, tuple[int, ...], Any]]:
        """Each saved tensor by name: (this rank's tensor, its global indices per dim, the
        global shape, its rows of dim 0 under ZeRO or None); ``autoshard.save`` writes them."""
        out = {}
        for fqn, t in self.local_tensors().items():
            if not any(n in self._full_keys for n in self._aliases.get(fqn, [fqn])):
                continue  # a non-persistent buffer
            layout = self._layouts[fqn]
            rows = self._zero.rows(fqn) if fqn in self._zero else None
            out[fqn] = (t, layout.local_index(self._rank), tuple(layout.shape), rows)
        return out

    def checkpoint_aliases(self) -> dict[str, str]:
        """Each tied name of a parameter -> the name checkpoints save it under."""
        return {k: self._canonical(k) for k in self._full_keys if self._canonical(k) != k}

    def _whole_local(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        """The plan's local tensor of ``fqn`` (gathered from ZeRO's rows; a collective)."""
        return self._zero.unsharded(fqn) if fqn in self._zero else t.detach()

    def layout_of(self, fqn: str) -> Layout:
        return self._layouts[self._canonical(fqn)]

    def _canonical(self, fqn: str) -> str:
        for name in self._aliases.get(fqn, [fqn]):
            if name in self._layouts:
                return name
        raise KeyError(f"{fqn} is not a parameter or buffer of the model")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device state dict (tied weights under every name); a collective."""
        full = {}
        for fqn, t in self.local_tensors().items():
            t = self._whole_local(fqn, t)
            layout = self._layouts[fqn]
            whole = t if layout.num_devices == 1 else gather_tensor(t, layout)
            # a copy: a replicated layout's gather is the local tensor itself
            full[fqn] = whole.clone() if whole.data_ptr() == t.data_ptr() else whole
        return {key: full[self._canonical(key)] for key in self._full_keys}

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Shard a single-device state dict (as ``model.state_dict()`` gives) onto this rank."""
        self.load_state_dict(state_dict, strict=False)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> None:
        """Load what ``state_dict`` gives (as ``torch.distributed.checkpoint.load`` fills it:
        DTensors, of any placements on the ranks of the plan) or single-device tensors, onto
        this rank's shards. ``strict``: a key the model does not have is an error too; a
        missing one always is (``load_full_state_dict`` ignores extra keys). A collective."""
        if strict and (extra := sorted(set(state_dict) - set(self._full_keys))):
            raise KeyError(f"state dict has keys the model does not: {extra}")
        with torch.no_grad():
            for fqn, t in self.local_tensors().items():
                names = self._aliases.get(fqn, [fqn])
                if not any(n in self._full_keys for n in names):
                    continue  # non-persistent buffers and constants are not in state dicts
                key = next((n for n in names if n in state_dict), None)
                if key is None:
                    raise KeyError(f"state dict has no entry for {fqn} (or its tied names)")
                layout = self._layouts[fqn].with_dtype(t.dtype)
                part = part_of(state_dict[key], layout, key, self._rank)
                target = self.in_memory(t)  # a shard in files: written back by ``loaded``
                target.copy_(self._zero.rows_of(fqn, part) if fqn in self._zero else part)
        self.loaded()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Sharded, for ``torch.distributed.checkpoint``: the model's keys (tied ones too) as
        DTensors on the mesh, none of them partial (a value is never a pending sum: one is
        summed first); a layout DTensor cannot express is gathered first. A collective."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate

        mesh = self.plan.mesh
        device_type = next(iter(self.local_tensors().values())).device.type
        device_mesh = init_device_mesh(device_type, mesh.sizes, mesh_dim_names=mesh.names)
        values: dict[str, Any] = {}
        for fqn, t in self.local_tensors().items():
            if not any(n in self._full_keys for n in self._aliases.get(fqn, [fqn])):
                continue  # a non-persistent buffer or a constant
            layout = self._layouts[fqn].with_dtype(t.dtype)
            with torch.no_grad():
                t = self._whole_local(fqn, t)
                if layout.partial:  # summed: DCP takes no pending sums
                    whole = layout.without_partial()
                    t, layout = redistribute(t, layout, whole), whole
                try:
                    placements = layout.to_placements(device_mesh)
                    value = DTensor.from_local(t, device_mesh, placements, run_check=False)
                except LayoutError:
                    full = gather_tensor(t, layout)
                    value = DTensor.from_local(full, device_mesh, [Replicate()] * len(mesh.sizes))
            values[fqn] = value
        return {key: values[self._canonical(key)] for key in self._full_keys}


__all__ = ["ParallelModule"]
