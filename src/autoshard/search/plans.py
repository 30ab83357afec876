"""The plan: what every op, parameter and input of one graph does on a mesh, and its JSON form.

A :class:`Plan` is what planning (semi-automatic or searched) produces and what lowering reads:
per op its strategy, the redistributions of its inputs and the gradient sums it needs; per
parameter its stored layout and its deferred gradient sum. The JSON form (``FORMAT``,
docs/search.md) stores the mesh, one space strategy per op key and the input layouts; it is for
files: within one process the Plan object is handed on as it is.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.graph import OpGraph
from autoshard.layout import NOT_SPLIT, Layout
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy, rule_for, tensor_inputs
from autoshard.precision import Precision
from autoshard.redistribution import backward_plan, gradient_sum, redistribution_plan

FORMAT = "autoshard-plan/1"

#: ZeRO stages (docs/zero.md): 0 none, 1 optimizer state, 2 and gradients, 3 and parameters
ZERO_LEVELS = (0, 1, 2, 3)


class ZeroError(ValueError):
    """A ZeRO level autoshard cannot run."""


def check_zero(zero: Any) -> int | dict[str, int]:
    """``zero`` as a plan holds it: one stage, or ``{fqn pattern: stage}`` (fnmatch patterns,
    the first that matches a parameter's name wins, unmatched parameters 0)."""
    if isinstance(zero, Mapping):
        return {str(k): _check_level(v, f"zero[{k!r}]") for k, v in zero.items()}
    return _check_level(zero, "zero")


def _check_level(level: Any, where: str) -> int:
    if isinstance(level, bool) or level not in ZERO_LEVELS:
        raise ZeroError(f"{where}={level!r}: expected a ZeRO stage, one of 0, 1, 2, 3")
    return int(level)


class PlanningError(ValueError):
    """No plan fits: names the smallest peak memory found and what would make one fit."""


@dataclass
class NodePlan:
    node: str
    target: str
    module: str
    strategy: Strategy
    configured: bool
    moves: dict[int, tuple[Layout, Layout]] = field(default_factory=dict)
    grad_reduce: dict[int, tuple[Layout, Layout]] = field(default_factory=dict)
    #: moved inputs whose move an earlier reader of the same value made (the same layouts and
    #: gradient sum): the program runs it once, and its backward sums every reader's part
    reuses: dict[int, str] = field(default_factory=dict)

    def forward_bytes(self) -> int:
        return sum(
            redistribution_plan(s, d).bytes
            for i, (s, d) in self.moves.items()
            if i not in self.reuses
        )

    def grad_source(self, i: int) -> Layout | None:
        """The partial gradient input ``i``'s move sums in its backward (``backward_plan``),
        or None: a moved input's pending sums are done by its move's backward, in one plan."""
        return self.grad_reduce[i][0] if i in self.moves and i in self.grad_reduce else None

    def backward_bytes(self, no_grad: Container[int] = ()) -> int:
        """The bytes backward moves for this op; ``no_grad``: the inputs that need no gradient,
        whose moves have no backward."""
        total = sum(
            backward_plan(s, d, self.grad_source(i)).bytes
            for i, (s, d) in self.moves.items()
            if i not in no_grad and i not in self.reuses
        )
        return total + sum(
            redistribution_plan(p, f).bytes
            for i, (p, f) in self.grad_reduce.items()
            if i not in self.moves
        )


@dataclass
class ParamPlan:
    fqn: str
    layout: Layout
    grad_partial: Layout | None = None  # deferred reduction: gradient layout before the sum
    #: the sum of an activation's gradient moved here (``Plan.summed_at_params``): summed in a
    #: bucket, never under ZeRO (the searches price the parameter as they found it)
    from_value: bool = False


@dataclass(frozen=True)
class Plan:
    """Every decision of how a captured graph runs on a mesh, made when the plan is built
    and never changed after (``dataclasses.replace`` makes a changed copy): each op's
    strategy and moves, each parameter's layout and gradient sum, ZeRO's stages, the precision
    policy; for a searched plan also its JSON and its predicted cost."""

    mesh: MeshInfo
    nodes: dict[str, NodePlan]
    params: dict[str, ParamPlan]
    inputs: dict[str, Layout]
    outputs: list[tuple[Layout, Layout]]
    warnings: list[str]
    #: the plan as JSON (docs/search.md), what ``save`` writes and ``parallelize(plan=)`` reads
    json: dict[str, Any] | None = field(default=None, compare=False)
    #: whether the automatic search chose every op's strategy (``autoshard.plan``)
    searched: bool = False
    #: the cost model's :class:`~autoshard.cost.Estimate` of it (a searched plan's)
    predicted: Any = field(default=None, compare=False)
    #: values whose readers all need the same sum of their gradient parts, by value name:
    #: (partial, whole), summed once after autograd adds the parts (Megatron's one ``f`` for
    #: the input of column-split q, k and v) instead of once per reader
    shared_reduce: dict[str, tuple[Layout, Layout]] = field(default_factory=dict)
    #: activations whose gradient sum moved to the one parameter they are looked up from,
    #: by value name: (the reader's partial gradient, its sum, the parameter's name); the
    #: parameter's gradient is summed in a bucket beside backward instead (a position
    #: embedding added to a batch-split stream)
    summed_at_params: dict[str, tuple[Layout, Layout, str]] = field(default_factory=dict)
    #: the mixed precision policy it runs under (None: the captured dtypes throughout)
    precision: Precision | None = field(default=None, compare=False)
    #: ZeRO (docs/zero.md): one stage for every parameter, or {fqn pattern: stage}
    zero: int | dict[str, int] = 0
    #: the graph this plan was made for (not part of the plan's identity)
    graph: OpGraph | None = field(default=None, repr=False, compare=False)

    @property
    def strategies(self) -> dict[str, Any]:
        """The strategies that rebuild this plan on another capture of the same model: the
        searched space strategies, else the configured ops' strategies by node name."""
        if self.json is not None:
            return dict(self.json["strategies"])
        return {n.node: n.strategy for n in self.nodes.values() if n.configured}

    def zero_level(self, fqn: str) -> int:
        """The ZeRO stage of parameter ``fqn``."""
        if isinstance(self.zero, int):
            return self.zero
        return next((v for k, v in self.zero.items() if fnmatch.fnmatchcase(fqn, k)), 0)

    def save(self, path: str | Path) -> None:
        """Write the plan's JSON (a searched plan; ``parallelize(plan=path)`` reads it)."""
        if self.json is None:
            raise ValueError("only a searched plan (autoshard.plan) has a JSON form")
        Path(path).write_text(json.dumps(self.json, indent=1) + "\n")

    def on_ranks(self, ranks: tuple[int, ...]) -> Plan:
        """The same plan run by ``ranks`` (a pipeline stage's sub-mesh of the world): every
        layout laid over them, position ``i`` of ``ranks`` doing what rank ``i`` did."""
        if tuple(ranks) == tuple(range(self.mesh.num_devices)):
            return self
        moved: dict[Layout, Layout] = {}

        def on(layout: Any) -> Any:
            if not isinstance(layout, Layout):
                return layout
            if layout not in moved:
                moved[layout] = layout.on_ranks(ranks)
            return moved[layout]

        def pair(p: tuple) -> tuple:
            return tuple(on(x) for x in p)

        def strategy(st: Strategy) -> Strategy:
            return dataclasses.replace(
                st, ins=pair(st.ins), outs=pair(st.outs), grads=pair(st.grads), space=on(st.space)
            )

        nodes = {
            k: dataclasses.replace(
                n,
                strategy=strategy(n.strategy),
                moves={i: pair(m) for i, m in n.moves.items()},
                grad_reduce={i: pair(m) for i, m in n.grad_reduce.items()},
            )
            for k, n in self.nodes.items()
        }
        params = {
            k: dataclasses.replace(p, layout=on(p.layout), grad_partial=on(p.grad_partial))
            for k, p in self.params.items()
        }
        return dataclasses.replace(
            self,
            nodes=nodes,
            params=params,
            inputs={k: on(v) for k, v in self.inputs.items()},
            outputs=[pair(o) for o in self.outputs],
            shared_reduce={k: pair(v) for k, v in self.shared_reduce.items()},
            summed_at_params={
                k: (on(a), on(b), f) for k, (a, b, f) in self.summed_at_params.items()
            },
        )

    @property
    def auto(self) -> dict[str, Any] | None:
        """The plan's JSON: the older name of :attr:`json`."""
        return self.json

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256("\n".join(self.digests()).encode()).hexdigest()[:16]

    def digests(self) -> list[str]:
        """One line per decision, what ranks compare before the first collective."""
        lines = [f"mesh {self.mesh}"]
        lines += [f"input {k} {v!r}" for k, v in self.inputs.items()]
        lines += [f"param {k} {p.layout!r} {p.grad_partial!r}" for k, p in self.params.items()]
        lines += [
            f"node {n.node} {n.target} {n.strategy.ins!r} {n.strategy.outs!r}"
            for n in self.nodes.values()
        ]
        lines += [f"shared {k} {g!r} {w!r}" for k, (g, w) in self.shared_reduce.items()]
        lines.append(f"zero {self.zero!r}")
        return lines

    def __str__(self) -> str:
        return format_plan(self)


def _kinds(steps: Any) -> str:
    return "+".join(s.kind for s in steps) or "none"


def _param_sums(plan: Plan) -> list[str]:
    """The parameters' gradient sums as the runtime runs them (``gradient_sum``): one
    all-reduce of replicas joins a bucket, or a ZeRO unit's reduce-scatter; any other plan
    runs in the parameter's hook. The bytes are the sums' without ZeRO."""
    deferred = [p for p in plan.params.values() if p.grad_partial is not None]
    if not deferred:
        return []
    runs = [
        gradient_sum(p.grad_partial, p.layout.with_dtype(p.grad_partial.dtype)) for p in deferred
    ]
    count: dict[str, int] = {}
    for p, run in zip(deferred, runs, strict=True):
        if len(run.steps) != 1 or run.steps[0].kind != "all_reduce":
            how = f"{_kinds(run.steps)} (in the hook)"
        elif plan.zero_level(p.fqn) and not p.from_value:
            how = "reduce_scatter (ZeRO unit)"
        else:
            how = "all_reduce (bucketed)"
        count[how] = count.get(how, 0) + 1
    kinds = ", ".join(f"{k} {how}" for how, k in count.items())
    sent = sum(run.bytes for run in runs)
    return [f"gradient reduction: {len(deferred)} parameters: {kinds}, {sent} bytes/rank"]


def attention_methods(plan: Plan) -> list[str]:
    """One line naming how the attention ops compute a split sequence (ring, all-gather,
    Ulysses: the rows' split moved to the heads by all-to-alls), when any does."""
    from autoshard.ops.contraction import Attention

    og = plan.graph
    if og is None:
        return []
    counts: dict[str, int] = {}
    for n in plan.nodes.values():
        node = og.by_name.get(n.node)
        rule = rule_for(node) if node is not None else None
        if not isinstance(rule, Attention):
            continue
        method = rule.method(node, n.strategy)
        if method == "local" and any(
            _splits(src, -2) and not _splits(dst, -2) and _splits(dst, -3)
            for i, (src, dst) in n.moves.items()
            if i < 3
        ):
            method = "ulysses"
        if method != "local":
            counts[method] = counts.get(method, 0) + 1
    if not counts:
        return []
    methods = ", ".join(f"{m} ({k} ops)" for m, k in counts.items())
    return [f"attention over a split sequence: {methods}"]


def _splits(layout: Layout, dim: int) -> bool:
    return any(a != NOT_SPLIT for _, a in layout.factors[dim])


def _communication(n: NodePlan) -> list[str]:
    """The communication column of an op's row: each input's move (or the earlier reader's
    it reuses), each gradient sum."""
    comm = [
        f"in{i}: {n.reuses[i]}'s"
        if i in n.reuses
        else f"in{i}: " + "+".join(s.kind for s in redistribution_plan(a, b).steps)
        for i, (a, b) in n.moves.items()
    ]
    return comm + [  # a moved input's sum runs in its move's backward (NodePlan.grad_source)
        f"in{i} grad: "
        + _kinds(
            backward_plan(*n.moves[i], g).steps if i in n.moves else redistribution_plan(g, w).steps
        )
        for i, (g, w) in n.grad_reduce.items()
        if i not in n.reuses
    ]


def format_plan(plan: Plan) -> str:
    """One row per op a strategy was given for, or that moves data: its layouts with named
    dims (``x[b@dp, s, in] weight[out@tp, in] -> [b@dp, s, out@tp]``) and communication."""
    from autoshard.search.describe import describe_op, dim_names

    og = plan.graph
    names = dim_names(og) if og is not None else {}
    rows = [("op", "module", "strategy", "in -> out", "communication", "bytes/rank fwd+bwd")]
    for n in plan.nodes.values():
        if not (n.configured or n.moves or n.grad_reduce or n.strategy.replicated_fallback):
            continue
        comm = _communication(n)
        no_grad: set[int] = set()
        if og is not None and n.node in og.by_name:
            node = og.by_name[n.node]
            layouts = describe_op(og, node, n.strategy, names)
            args = tensor_inputs(node)
            no_grad = {i for i in n.moves if not og[args[i]].requires_grad}
        else:
            ins = ",".join(str(x) for x in n.strategy.ins)
            layouts = f"{ins} -> " + ",".join(str(x) for x in n.strategy.outs if x is not None)
        mark = "*" if n.configured else ""
        rows.append(
            (
                f"{n.node}{mark}",
                n.module,
                n.strategy.describe(),
                layouts,
                "; ".join(comm) or "-",
                f"{n.forward_bytes()}+{n.backward_bytes(no_grad)}",
            )
        )
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    lines = [f"plan on mesh {plan.mesh.describe(' x ')} ({plan.mesh.num_devices} devices)"]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines += attention_methods(plan)
    lines += _param_sums(plan)
    for value, (grad, whole) in plan.shared_reduce.items():
        run = redistribution_plan(grad, whole)
        lines.append(
            f"gradient of {value}: summed once for all its readers ({_kinds(run.steps)}), "
            f"{run.bytes} bytes/rank"
        )
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append("(* chosen by the search)" if plan.searched else "(* configured by the user)")
    return "\n".join(lines)


# -- JSON -----------------------------------------------------------------------------------------


def load_plan(plan: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A plan dict from a dict or a JSON file, checked for its format."""
    where = "plan"
    if not isinstance(plan, Mapping):
        where = f"plan file {str(plan)!r}"
        try:
            plan = json.loads(Path(plan).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where} is not JSON (line {err.lineno}, column {err.colno}: {err.msg}); write "
                "one with `autoshard plan --json FILE` or plan.save(FILE)"
            ) from None
        if not isinstance(plan, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(plan).__name__}")
    if plan.get("format") != FORMAT:
        raise ValueError(
            f"{where}: field 'format' is {plan.get('format')!r}, expected {FORMAT!r} (not a plan "
            "autoshard wrote, or from another version)"
        )
    missing = [k for k in ("mesh", "strategies") if k not in plan]
    if missing:
        raise ValueError(f"{where}: no field {', '.join(map(repr, missing))}")
    return dict(plan)


def pipeline_predicted(data: dict[str, Any]) -> dict[str, Any]:
    """A plan JSON with stages, its ``predicted`` made the whole job's (the pipeline's step,
    bubble and MFU, its busiest rank's memory per device) and the stage plan's own figures
    (the whole model, one micro-batch, on one stage's sub-mesh: what the search prices a
    stage by) moved to ``pipeline.one_stage_one_microbatch``."""
    pipe, stage = data["pipeline"], data["predicted"]
    pipe["one_stage_one_microbatch"] = stage
    shown = ("step_time_s", "mfu", "bubble", "peak_memory_bytes", "offload_s", "search_s")
    data["predicted"] = {k: pipe[k] for k in shown if k in pipe}
    for tier in ("memory_bytes", "host_memory_bytes", "nvme_memory_bytes"):  # the busiest rank's
        busiest = max(pipe.get(tier, [{}]), key=lambda m: sum(m.values()))
        data["predicted"] |= {tier: {**busiest, "total": sum(busiest.values())}} if busiest else {}
    data["predicted"] |= {"dtype": stage.get("dtype", "float32"), "search": stage["search"]}
    return data


def input_layouts(og: OpGraph, plan: Mapping[str, Any]) -> dict[str, Layout]:
    """The plan's input specs as layouts of ``og``'s inputs."""
    out = {}
    for name, spec in plan.get("inputs", {}).items():
        node = og.by_name.get(name)
        if node is None or node.op != "placeholder":
            continue
        info = og[node]
        entries = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
        out[name] = Layout.from_named(info.shape, entries, plan["mesh"], dtype=info.dtype)
    return out


def staged_json(best: Any, tried: list[Any], seconds: float, opts: Any) -> dict:
    """The plan JSON of a pipeline search: the stage plan's, its ``pipeline`` section (with
    what was searched and priced, and the search's seconds) and the ``options`` it ran under."""
    data = dict(best.stage.json)
    num_devices = best.schedule.num_ranks * best.stage.mesh.num_devices
    names = ("microbatches", "pp", "recompute", "schedule")
    searched = [n for n in names if getattr(opts, n) is None]
    found = {"searched": searched, "tried": [t.as_dict() for t in tried], "search_s": seconds}
    data["pipeline"] = pipeline_json(best, num_devices) | found
    data["options"] = opts.replace(offload=data.get("offload", opts.offload)).as_json()
    return pipeline_predicted(data)


def pipeline_json(pp_plan: Any, num_devices: int) -> dict:
    """The plan JSON's ``pipeline`` section: the configuration, its predicted step, bubble
    and MFU over ``num_devices``, each pipeline rank's memory by kind and each stage's
    forward and backward seconds per micro-batch."""
    p, s, est = pp_plan.predicted, pp_plan.schedule, pp_plan.stage.predicted
    flops = est.model_flops * s.microbatches
    return {
        "pp": s.num_ranks,
        "microbatches": s.microbatches,
        "schedule": s.name,
        # stages a rank of interleaved-1f1b (make_schedule's argument; zbv's V is its own)
        "virtual_stages": s.num_stages // s.num_ranks if s.name == "interleaved-1f1b" else 1,
        "recompute": pp_plan.recompute,
        "zero": pp_plan.stage.zero,
        "mfu": flops / (p.step_time * num_devices * est.peak_flops),
        "boundary_bytes": pp_plan.boundary_bytes,
        **p.as_json(),  # step, bubble, memory by rank (and tier), each stage's seconds
    }


__all__ = [
    "pipeline_json",
    "staged_json",
    "pipeline_predicted",
    "FORMAT",
    "ZERO_LEVELS",
    "ZeroError",
    "check_zero",
    "NodePlan",
    "ParamPlan",
    "Plan",
    "PlanningError",
    "format_plan",
    "input_layouts",
    "load_plan",
]
