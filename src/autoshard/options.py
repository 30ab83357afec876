"""The options of a parallel training job: one immutable value holding every choice.

``parallelize``, ``autoshard.plan``, ``autoshard plan`` and ``autoshard train`` fill an
:class:`Options` from their keywords and flags, check it once here, and hand it whole to the
one-program and pipeline paths, the search and the plan JSON (docs/options.md). A choice a
path cannot honour is an error naming it, never a value dropped on the way.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.mesh import MeshInfo, mesh_info
from autoshard.precision import Precision, precision_policy
from autoshard.schedule import SCHEDULES

SEARCHES = ("optimal", "recursive", "propagate")
ATTENTION_METHODS = ("allgather", "ulysses", "ring")
RECOMPUTE_MODES = ("none", "full", "selective")
REPLICAS = ("broadcast", "check", "none")
#: what ``offload=`` may move to the host (``nvme``: where the optimizer's host part and ZeRO
#: 3's host shards are kept in files, ``host_budget_mb``: the host memory that streams them)
OFFLOADS = ("optimizer", "parameters", "embeddings", "activations", "nvme", "host_budget_mb")
#: the host memory the NVMe tier streams through where ``host_budget_mb`` is not given
HOST_BUDGET_MB = 64.0
#: DDP's default bucket size: the gradient sums that overlap backward
BUCKET_CAP_MB = 25.0
#: the stages a rank of ``interleaved-1f1b`` where none is given: the pipeline search's pick
INTERLEAVED_STAGES = 2
#: the options a run takes from the plan it is given where its own leave them out: those that
#: shape the plan (a run's precision is its own choice: a plan runs under any)
RUN_AS_PLANNED = ("attention", "sequence_parallel", "offload")


class FrozenDict(dict):
    """A dict that cannot change after it is made (an option's mapping): reads, ``==``,
    JSON and pickling as a dict's."""

    def _frozen(self, *_: Any, **__: Any) -> None:
        raise TypeError("an option's mapping cannot change; make new Options with replace()")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen  # type: ignore[assignment]
    __ior__ = _frozen  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return FrozenDict, (dict(self),)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(repr(sorted(self.items(), key=repr)))


def _frozen(value: Any) -> Any:
    if isinstance(value, FrozenDict) or not isinstance(value, Mapping):
        return value
    return FrozenDict(value)


@dataclass(frozen=True)
class Options:
    """Every choice of how a model is planned and run. Defaults are what the search or the
    runtime would pick; ``None`` means "not given" (searched, or the plan's)."""

    #: {"dp": 2, "tp": 2}, "dp=2,tp=2", a device count (its shape searched) or None (the plan's)
    mesh: Any = None
    #: {module path or glob: strategy} (docs/strategies.md)
    strategies: Mapping[str, Any] | None = None
    #: {input name: Layout} for inputs not split by batch
    input_layouts: Mapping[str, Any] | None = None
    #: "optimal", "recursive" or "propagate": plan automatically
    search: str | None = None
    #: the cluster the search prices: a preset name, a JSON file or a ClusterSpec (None: cpu)
    cluster: Any = None
    #: a Plan, its JSON or a file of it; sets the mesh (and the pipeline's configuration)
    plan: Any = None
    #: bytes a device may hold; a plan over it, searched or made from strategies, is an error
    #: (default: the cluster's memory)
    memory_limit: float | None = None
    #: the tensor-parallel degree of the meshes searched
    tp: int | None = None
    #: the context-parallel degree of the meshes searched (a mesh's ``cp`` axes give it)
    cp: int | None = None
    #: whether a searched tensor-parallel group may span nodes
    tp_across_nodes: bool = False
    #: "fp32", "bf16", "fp16" or a Precision: the dtype the model computes in and gradients are
    #: summed in (docs/precision.md)
    precision: Any = None
    #: ZeRO stage 0-3 over each parameter's data-parallel replicas, or {fqn pattern: stage}
    #: (None: the plan's, else searched or 0; docs/zero.md)
    zero: int | Mapping[str, int] | None = None
    #: ZeRO 3: drop gathered parameters after forward and gather them again in backward
    reshard_after_forward: bool = True
    #: "broadcast" the first rank's part of each parameter and buffer to the ranks holding the
    #: same part, "check" that they are equal (naming the rank that differs), or "none"
    replicas: str = "broadcast"
    #: the size of the buckets whose gradient sums overlap backward
    bucket_cap_mb: float = BUCKET_CAP_MB
    #: a model built on meta: a checkpoint, "reset" or a function of a module (docs/meta.md)
    init: Any = None
    #: the seed of dropout's counter-based masks
    seed: int = 0
    #: the longest wait in a collective; then every rank stops, naming the ranks that never
    #: arrived (docs/failures.md; None: the process group's own timeout, naming none)
    timeout_s: float | None = None
    #: the device this rank computes on: "cpu", "cuda", "cuda:1" or a torch.device (None:
    #: ``cuda:LOCAL_RANK`` under a NCCL process group, else the CPU; docs/devices.md)
    device: Any = None
    #: pipeline ranks (``autoshard.plan``; ``parallelize`` reads the mesh's ``pp`` axis)
    pp: int | None = None
    #: "gpipe", "1f1b" (``parallelize``'s default), "interleaved-1f1b", "zb-h1" or "zbv"
    schedule: str | None = None
    #: micro-batches a step (default: the pp size, or searched)
    microbatches: int | None = None
    #: module paths where stages 2, 3, ... begin (default: balanced between blocks)
    stages: tuple[str, ...] | None = None
    #: stages a rank of interleaved-1f1b (default INTERLEAVED_STAGES, as the search picks)
    virtual_stages: int | None = None
    #: which repeated blocks backward runs again instead of keeping their activations:
    #: "none", "full", "selective" or {module glob: mode} (docs/parallelism/pipeline.md)
    recompute: str | Mapping[str, str] | None = None
    #: how attention computes its query rows split by sequence: "allgather" (the default),
    #: "ulysses" or "ring" (docs/parallelism/sequence.md)
    attention: str | None = None
    #: Megatron's sequence parallelism: values pending a sum over tensor-parallel axes are
    #: reduce-scattered by sequence, so what runs between the tensor-parallel linears runs on
    #: a block of the sequence
    sequence_parallel: bool = False
    #: multi-copy parallelism: each rank's batch cut by its batch dim into this many copies,
    #: interleaved so one copy's collectives overlap another's compute (docs/parallelism/copies.md)
    copies: int = 1
    #: what lives on the host rather than the device (docs/parallelism/offload.md; None: searched,
    #: offloading only where nothing fits without; {} offloads nothing): {"optimizer": f},
    #: the fraction f (0-1, True for 1) of each tensor the optimizer steps whose master
    #: weights, optimizer state and update are the host's; "parameters": True, ZeRO 3's
    #: shards between uses; "embeddings": a module glob of nn.Embedding tables looked up and
    #: sparsely updated there; "activations": a module glob whose blocks' saved tensors wait
    #: on the host for backward; "nvme": a directory where the optimizer's host part (and
    #: with "parameters" the shards, their optimizer state too) is kept in files (True in a
    #: plan: on NVMe, the path the run's), streamed through
    #: "host_budget_mb" of host memory
    offload: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("mesh", "strategies", "input_layouts", "zero", "recompute", "offload"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if isinstance(self.device, str):
            object.__setattr__(self, "device", _device(self.device))
        if isinstance(self.stages, Sequence) and not isinstance(self.stages, str):
            object.__setattr__(self, "stages", tuple(self.stages))
        bad = _problems(self)
        if bad:
            raise ValueError("; ".join(bad))
        if self.offload is not None:
            object.__setattr__(self, "offload", FrozenDict(_offload_values(self.offload)))

    @classmethod
    def from_call(cls, given: Mapping[str, Any], base: Options | None = None) -> Options:
        """Options from a function's keywords (``locals()`` of ``parallelize`` or ``plan``):
        the fields named there; ``base`` fills those left at their defaults. A keyword that
        differs from both its default and ``base``'s value is an error naming both."""
        names = [f.name for f in dataclasses.fields(cls) if f.name in given]
        values = {n: given[n] for n in names}
        if base is None:
            return cls(**values)
        defaults = cls()
        clash = [
            n
            for n, v in values.items()
            if v != getattr(defaults, n)
            and v != getattr(base, n)
            and getattr(base, n) != getattr(defaults, n)
        ]
        if clash:
            raise ValueError(
                "options= and keywords disagree on "
                + ", ".join(f"{n} ({getattr(base, n)!r} against {values[n]!r})" for n in clash)
            )
        changed = {n: v for n, v in values.items() if v != getattr(defaults, n)}
        return dataclasses.replace(base, **changed)

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    def planned_under(self, recorded: Mapping[str, Any], source: str) -> Options:
        """These options with those a plan was made under (its JSON's ``options``) where
        they were left out: the run keeps the plan's attention and sequence parallelism; one
        given that differs from the plan's is an error naming both."""
        ours = self.as_json()
        taken = {}
        for name in RUN_AS_PLANNED:
            if recorded.get(name) is None or recorded[name] == ours[name]:
                continue
            if ours[name] not in (None, False):
                raise ValueError(
                    f"{name}={ours[name]!r}, but {source} was made with {name} "
                    f"{recorded[name]!r}; leave it out or plan again"
                )
            taken[name] = recorded[name]
        return self.replace(**taken) if taken else self

    def search_keywords(self) -> dict[str, Any]:
        """What the search (``search.run_search``) takes of these options."""
        return {
            "search": self.search or SEARCHES[0],
            "memory_limit": self.memory_limit,
            "tp_across_nodes": self.tp_across_nodes,
            "zero": self.zero if isinstance(self.zero, int) else None,
            "cp": self.cp or 1,
            "attention": self.attention,
            "sequence_parallel": self.sequence_parallel,
            "precision": None if self.precision is None else self.policy,
            "tp": self.tp,
            "offload": self.offload,
        }

    def with_mesh_pp(self) -> Options:
        """These options with ``pp`` the mesh's ``pp`` axis, where it has one (a mesh and a
        ``pp`` that disagree are an error naming both)."""
        if self.mesh is None or isinstance(self.mesh, int):
            return self
        info = mesh_info(self.mesh)
        axis = info.size_of(["pp"]) if "pp" in info.names else None
        if self.pp is not None and self.pp != (axis or 1):
            raise ValueError(f"pp={self.pp}, but the mesh {info.describe()} has pp {axis or 1}")
        return self if axis is None else self.replace(pp=axis)

    def for_search(self) -> Options:
        """These options as ``autoshard.plan`` searches under them: one ZeRO stage, and the
        mesh's ``pp`` and context-parallel degree fixed where it has those axes."""
        if self.zero is not None and not isinstance(self.zero, int):
            raise ValueError(
                "plan: zero= is one stage for the search (0-3); give per-parameter "
                "stages to parallelize"
            )
        if self.offload and self.copies != 1:  # its estimate does not price it
            raise ValueError(f"offload={dict(self.offload)}: not yet planned with copies")
        opts = self.with_mesh_pp()
        info = mesh_info(opts.mesh) if opts.mesh is not None else None
        if info is not None and info.cp and opts.cp is None:
            opts = opts.replace(cp=math.prod(info.sizes[info.names.index(a)] for a in info.cp))
        return opts

    @property
    def stage_mesh(self) -> MeshInfo | None:
        """A pipeline stage's sub-mesh where the mesh fixes one: its axes but ``pp``."""
        if self.mesh is None or isinstance(self.mesh, int):
            return None
        info = mesh_info(self.mesh)
        kept = {n: s for n, s in zip(info.names, info.sizes, strict=True) if n != "pp"}
        return mesh_info(kept or {"dp": 1})

    @property
    def staged(self) -> bool:
        """Whether a pipeline keyword was given (any of them makes pipeline stages)."""
        keys = (self.pp, self.schedule, self.microbatches, self.stages, self.virtual_stages)
        return any(v is not None for v in keys)

    @property
    def stages_a_rank(self) -> int:
        """Virtual stages a pipeline rank: the given ones, else what the search would pick."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return INTERLEAVED_STAGES if self.schedule == "interleaved-1f1b" else 1

    @property
    def policy(self) -> Precision:
        """The precision policy (not yet resolved against a model's dtype)."""
        return precision_policy(self.precision)

    def as_json(self) -> dict[str, Any]:
        """The options that shape a plan, as the plan JSON's ``options`` section records
        them (what the runtime alone reads, a seed or a timeout, is not a plan's)."""
        precision = None
        if self.precision is not None:  # as named or given; the master weights are the model's
            precision = {k: v for k, v in self.policy.as_dict().items() if k != "master"}
        return {
            "search": self.search,
            "memory_limit": self.memory_limit,
            "tp": self.tp,
            "cp": self.cp,
            "tp_across_nodes": self.tp_across_nodes,
            "precision": precision,
            "zero": dict(self.zero) if isinstance(self.zero, Mapping) else self.zero,
            "pp": self.pp,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "stages": list(self.stages) if self.stages is not None else None,
            "virtual_stages": self.virtual_stages,
            "recompute": dict(self.recompute)
            if isinstance(self.recompute, Mapping)
            else self.recompute,
            "attention": self.attention,
            "sequence_parallel": self.sequence_parallel,
            "copies": self.copies,
            "offload": dict(self.offload) if self.offload is not None else None,
        }


def _problems(o: Options) -> list[str]:
    """Every option out of range, each naming itself, its value and what it may be."""
    bad = [f"search={o.search!r}: expected one of {', '.join(SEARCHES)}"] * (
        o.search is not None and o.search not in SEARCHES
    )
    if o.search is not None and o.plan is not None:
        bad.append("search= and plan=: give search= or plan=, not both")
    bad += _number_problems(o)
    choices = {
        "schedule": (o.schedule, SCHEDULES),
        "attention": (o.attention, ATTENTION_METHODS),
        "replicas": (o.replicas, REPLICAS),
    }
    bad += [
        f"{n}={v!r}: expected one of {', '.join(c)}"
        for n, (v, c) in choices.items()
        if v is not None and v not in c
    ]
    modes = o.recompute.values() if isinstance(o.recompute, Mapping) else [o.recompute]
    bad += [
        f"recompute={o.recompute!r}: expected one of {', '.join(RECOMPUTE_MODES)} "
        "or a mapping of module globs to them"
    ] * any(m is not None and m not in RECOMPUTE_MODES for m in modes)
    levels = o.zero.values() if isinstance(o.zero, Mapping) else [o.zero]
    bad += [f"zero={o.zero!r}: expected 0-3 or a mapping of parameter patterns to them"] * any(
        z is not None and (isinstance(z, bool) or z not in (0, 1, 2, 3)) for z in levels
    )
    if o.virtual_stages not in (None, 1) and o.schedule not in (None, "interleaved-1f1b"):
        bad.append(
            f"virtual_stages={o.virtual_stages} with schedule={o.schedule!r} "
            ": stages a rank are interleaved-1f1b's"
        )
    if o.stages is not None and not all(isinstance(s, str) for s in o.stages):
        bad.append(f"stages={o.stages!r}: expected the module paths where stages 2, 3, ... begin")
    if o.device is not None and (
        not isinstance(o.device, torch.device) or o.device.type not in ("cpu", "cuda")
    ):
        shown = str(o.device) if isinstance(o.device, torch.device) else o.device
        bad.append(f"device={shown!r}: expected 'cpu', 'cuda', 'cuda:N' or a torch.device")
    precision_policy(o.precision)  # its own error names what it expected
    return bad + _offload_problems(o.offload) + _host_problems(o)


def _offload_problems(offload: Any) -> list[str]:
    """What is wrong with ``offload=``: not a mapping, a key it does not know, a fraction out
    of range, a glob or path that is not a string, NVMe without an optimizer to keep there."""
    if offload is None:
        return []
    if not isinstance(offload, Mapping):
        return [f"offload={offload!r}: expected a mapping such as {{'optimizer': 1.0}}"]
    bad = [
        f"offload[{key!r}]: unknown; expected one of {', '.join(OFFLOADS)}"
        for key in offload
        if key not in OFFLOADS
    ]
    fraction = offload.get("optimizer", 0.0)
    if not (isinstance(fraction, int | float) and 0 <= fraction <= 1):
        bad.append(
            f"offload['optimizer']={fraction!r}: expected a fraction from 0 to 1, or True or False"
        )
    for key, what in (("activations", "a module glob"), ("nvme", "a directory path")):
        value = offload.get(key)
        planned = key == "nvme" and isinstance(value, bool)  # a plan's: where the run says
        if (
            value is not None
            and not planned
            and not (isinstance(value, str | os.PathLike) and str(value))
        ):
            bad.append(f"offload[{key!r}]={value!r}: expected {what}")
    budget = offload.get("host_budget_mb")
    if budget is not None and not (
        isinstance(budget, int | float) and not isinstance(budget, bool) and budget > 0
    ):
        bad.append(f"offload['host_budget_mb']={budget!r}: expected a positive number of MiB")
    if (offload.get("nvme") or budget is not None) and not (fraction or offload.get("parameters")):
        bad.append(
            "offload['nvme'] keeps the optimizer's host part in files: give "
            "offload['optimizer'] a fraction too (or 'parameters': True, ZeRO 3's shards in "
            "files), and host_budget_mb only with nvme"
        )
    elif budget is not None and not offload.get("nvme"):
        bad.append("offload['host_budget_mb'] bounds the NVMe tier's host memory: give 'nvme'")
    return bad


def _host_problems(o: Options) -> list[str]:
    """What is wrong with ``offload``'s ``parameters`` (a bool, True only under ZeRO 3) and
    ``embeddings`` (a module glob)."""
    offload = o.offload if isinstance(o.offload, Mapping) else {}
    bad = []
    params = offload.get("parameters", False)
    levels = o.zero.values() if isinstance(o.zero, Mapping) else [o.zero]
    if not isinstance(params, bool):
        bad.append(f"offload['parameters']={params!r}: expected True or False")
    elif params and o.zero is not None and 3 not in levels:  # None: the plan's, checked there
        bad.append(
            f"offload['parameters']=True with zero={o.zero!r}: parameters live on the host as "
            "ZeRO 3's shards; give zero=3"
        )
    glob = offload.get("embeddings")
    if glob is not None and not (isinstance(glob, str) and glob):
        bad.append(f"offload['embeddings']={glob!r}: expected a glob of nn.Embedding module paths")
    return bad


def _offload_values(offload: Mapping[str, Any]) -> dict[str, Any]:
    """``offload`` as runs read it: the fraction a float (True the whole of it), the globs
    and the path strings, ``parameters`` as given, the budget a float."""
    out: dict[str, Any] = {}
    for key, value in offload.items():
        if key == "optimizer":
            out[key] = 1.0 if value is True else float(value)
        elif key in ("activations", "nvme", "embeddings") and not isinstance(value, bool):
            out[key] = str(value) if value is not None else None
        elif key in ("parameters", "nvme"):
            out[key] = value
        else:
            out[key] = None if value is None else float(value)
    return out


def _device(name: str) -> Any:
    """A device's name as a torch.device (one torch cannot read stays as given: an error)."""
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        return name


def _number_problems(o: Options) -> list[str]:
    """The numbers, counts and flags of the wrong type or out of range."""
    bad: list[str] = []
    positive = {
        "memory_limit": o.memory_limit,
        "timeout_s": o.timeout_s,
        "bucket_cap_mb": o.bucket_cap_mb,
    }
    bad += [
        f"{n}={v!r}: expected a positive number"
        for n, v in positive.items()
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0)
    ]
    counts = {
        "tp": o.tp,
        "cp": o.cp,
        "pp": o.pp,
        "microbatches": o.microbatches,
        "virtual_stages": o.virtual_stages,
        "copies": o.copies,
    }
    bad += [
        f"{n}={v!r}: expected a positive int"
        for n, v in counts.items()
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1)
    ]
    flags = {
        "tp_across_nodes": o.tp_across_nodes,
        "sequence_parallel": o.sequence_parallel,
        "reshard_after_forward": o.reshard_after_forward,
    }
    bad += [
        f"{n}={v!r}: expected True or False" for n, v in flags.items() if not isinstance(v, bool)
    ]
    if isinstance(o.seed, bool) or not isinstance(o.seed, int):
        bad.append(f"seed={o.seed!r}: expected an int")
    return bad


__all__ = [
    "ATTENTION_METHODS",
    "BUCKET_CAP_MB",
    "INTERLEAVED_STAGES",
    "OFFLOADS",
    "RECOMPUTE_MODES",
    "REPLICAS",
    "RUN_AS_PLANNED",
    "SEARCHES",
    "FrozenDict",
    "Options",
]
