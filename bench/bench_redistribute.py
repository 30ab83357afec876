"""autoshard's redistribution against DTensor's ``redistribute``, same layouts, same run.

Each pair is a move between two DTensor placements on a 2x2 ``{"dp": 2, "tp": 2}`` mesh of 4 CPU
ranks (gloo). Both libraries start from the same local shard of the same global tensor and must
end with the same local shard of the destination; the benchmark fails if either does not.

Bytes are priced identically on both sides, because a ratio is only meaningful if the same
collective costs the same on each: autoshard's come from :func:`autoshard.comm.counting` (its
comm layer prices every call with :func:`autoshard.comm.collective_bytes`); DTensor's come from
a dispatch mode that sees each functional collective DTensor issues, with its input size and
group, priced by that same function. Both are ring-formula bytes sent per rank, not wire bytes.

Time alternates the two libraries rep by rep (which one goes first alternates too), with a
barrier before every timed call, so drift in the machine's load hits both alike; a rep's time
is the slowest rank's, since a redistribution is done only when every rank is done.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import autoshard
from autoshard import Layout, comm
from autoshard.testing import run_ranks
from bench.timing import paired_ratio

NAME = "redistribute"

MESH = {"dp": 2, "tp": 2}
WORLD_SIZE = math.prod(MESH.values())
FULL_SHAPE = (512, 1024)
QUICK_SHAPE = (64, 128)

# (src, dst) placements, one letter group per mesh dim (dp, tp): S<d> Shard(d), R, P (sum).
PAIRS: tuple[tuple[str, str], ...] = (
    ("S0,R", "R,R"),  # all-gather over one axis
    ("S0,R", "R,S1"),  # gather rows while splitting columns
    ("S1,R", "S0,R"),  # change the sharded dim on one mesh dim (an all-to-all)
    ("S0,S1", "S1,S0"),  # swap which axis splits which dim
    ("S0,S0", "S1,S1"),  # rows over both axes to columns over both axes
    ("R,S1", "S1,R"),  # the same column split, moved from tp to dp
    ("P,R", "R,R"),  # all-reduce
    ("P,S0", "S0,S0"),  # reduce into a nested row split
    ("P,S1", "S1,R"),  # reduce and move the column split to the other axis
    ("P,P", "S0,S1"),  # reduce-scatter over both axes
)

# The functional collectives DTensor issues and the ring formula that prices each; everything
# else in these namespaces that is not listed as harmless is an error, never a silent zero.
_COLLECTIVE_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
}
_NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd"}
_WATCHED_NAMESPACES = {"_c10d_functional", "_dtensor", "c10d"}


def parse_placements(text: str) -> tuple[Any, ...]:
    """``"P,S1"`` -> ``(Partial(), Shard(1))``: compact names that survive JSON."""
    out: list[Any] = []
    for item in text.split(","):
        if item == "R":
            out.append(Replicate())
        elif item == "P":
            out.append(Partial())
        elif item.startswith("S") and item[1:].isdigit():
            out.append(Shard(int(item[1:])))
        else:
            raise ValueError(f"placement {item!r} in {text!r}: use R, P or S<dim>")
    return tuple(out)


# -- counting DTensor's collectives -----------------------------------------------------------


def _group_ranks(group: Any) -> tuple[int, ...]:
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    return tuple(dist.get_process_group_ranks(group))


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective issued below it as (kind, group ranks, input bytes, bytes sent).

    DTensor runs its redistribution on plain local tensors, so its functional collectives pass
    through a dispatch mode with their real input sizes and group names; pricing them here
    with :func:`autoshard.comm.collective_bytes` puts them on autoshard's scale.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        namespace, _, op = func._schema.name.partition("::")
        if namespace in _WATCHED_NAMESPACES and op not in _NOT_COMMUNICATION:
            self.records.append(self._record(func, op, args, kwargs))
        return func(*args, **kwargs)

    @staticmethod
    def _record(
        func: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        kind = _COLLECTIVE_KINDS.get(op)
        if kind is None:
            raise RuntimeError(
                f"DTensor issued {func._schema.name}, which this benchmark does not know how to "
                "price; add it to _COLLECTIVE_KINDS rather than under-count DTensor's bytes"
            )
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args, strict=False)) | kwargs
        inputs = bound.get("input", bound.get("inputs"))
        tensors = inputs if isinstance(inputs, list | tuple) else [inputs]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        ranks = _group_ranks(bound["group_name"])
        return {
            "kind": kind,
            "op": func._schema.name,
            "ranks": ranks,
            "input_bytes": nbytes,
            "bytes": comm.collective_bytes(kind, len(ranks), nbytes),
        }


class _WarningCollector(logging.Handler):
    """DTensor explains some of its choices only in log warnings (e.g. its gloo fallback)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


@contextmanager
def _dtensor_warnings() -> Iterator[_WarningCollector]:
    collector = _WarningCollector()
    logger = logging.getLogger("torch.distributed.tensor")
    logger.addHandler(collector)
    try:
        yield collector
    finally:
        logger.removeHandler(collector)


def _dtensor_plan(source: DTensor, target: DTensor) -> dict[str, Any] | None:
    """DTensor's own plan for a move (its placement trace) and what its gloo fallback costs.

    On CPU, DTensor runs a Shard(i) -> Shard(j) step on one mesh dim as an all-gather plus a
    local chunk instead of an all-to-all. Pricing that difference from DTensor's plan tells
    how much of autoshard's advantage is this backend's, not the planners'. The plan is a
    private API, so where this torch lacks it the benchmark just reports nothing here.
    """
    try:
        from torch.distributed.tensor._redistribute import (
            DTensorRedistributePlanner,
            _gen_transform_infos,
        )

        infos = _gen_transform_infos(source._spec, target._spec)
        trace = DTensorRedistributePlanner.stringify_transform_infos(
            source.device_mesh, infos, source.placements
        )
    except (ImportError, AttributeError, TypeError):
        return None
    extra = 0
    if source.device_mesh.device_type == "cpu":
        for info in infos:
            before, after = info.src_dst_placements
            if before.is_shard() and after.is_shard() and before.dim != after.dim:
                group = source.device_mesh.size(info.mesh_dim)
                nbytes = math.prod(info.logical_shape) // group * source.dtype.itemsize
                extra += comm.collective_bytes("all_gather", group, nbytes)
                extra -= comm.collective_bytes("all_to_all", group, nbytes)
    return {"trace": trace, "alltoall_fallback_extra_bytes": extra}


def _min_cost_planner() -> tuple[Callable[[], Any], Callable[[], None]] | None:
    """DTensor's optional graph-search planner and its cache reset, where this torch has them.

    Its plan cache is keyed by the two specs only, not by the planner chosen, so it is cleared
    around the min-cost run; otherwise one planner's cached plan would answer for the other.
    """
    try:
        from torch.distributed.tensor import _redistribute as internals

        enable = internals.use_min_cost_redistribution_plan
        clear = internals._gen_transform_infos.cache_clear
    except (ImportError, AttributeError):
        return None
    return enable, clear


# -- one rank ---------------------------------------------------------------------------------


def _axis_name(ranks: tuple[int, ...], mesh: Any) -> str:
    """Name a collective's group by the mesh dims it spans, so steps read like the plans."""
    if len(ranks) == WORLD_SIZE:
        return "*".join(mesh.mesh_dim_names)
    for dim, name in enumerate(mesh.mesh_dim_names):
        if tuple(dist.get_process_group_ranks(mesh.get_group(dim))) == ranks:
            return name
    return ",".join(map(str, ranks))


def _check(got: torch.Tensor, expected: torch.Tensor, who: str, pair: tuple[str, str]) -> None:
    if got.shape != expected.shape or not torch.equal(got, expected):
        detail = (
            f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
            if got.shape != expected.shape
            else f"max abs error {(got - expected).abs().max().item()}"
        )
        raise AssertionError(
            f"{who} moved ({pair[0]}) -> ({pair[1]}) wrongly on rank {dist.get_rank()}: {detail}"
        )


def _finished(local: torch.Tensor) -> torch.Tensor:
    """A plain, completed tensor: an async functional-collective result is waited on, so no
    timing can stop before DTensor's communication has actually finished."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local


def _measure_pair(
    pair: tuple[str, str], mesh: Any, full: torch.Tensor, reps: int, warmup: int
) -> dict[str, Any]:
    src_placements, dst_placements = parse_placements(pair[0]), parse_placements(pair[1])
    src = Layout.from_placements(src_placements, mesh, full.shape, dtype=full.dtype)
    dst = Layout.from_placements(dst_placements, mesh, full.shape, dtype=full.dtype)
    for layout, placements in ((src, src_placements), (dst, dst_placements)):
        back = layout.to_placements(mesh)
        if back != placements:
            raise AssertionError(f"{layout}.to_placements gives {back}, not {placements}")
    plan = autoshard.redistribution_plan(src, dst)
    rank = dist.get_rank()
    local = autoshard.shard_tensor(full, src)
    expected = autoshard.shard_tensor(full, dst)
    source = DTensor.from_local(
        local, mesh, src_placements, run_check=False, shape=full.shape, stride=full.stride()
    )

    def run_autoshard() -> torch.Tensor:
        return autoshard.redistribute(local, src, dst)

    def run_dtensor() -> torch.Tensor:
        return _finished(source.redistribute(mesh, dst_placements).to_local())

    # Untimed first calls: correctness, bytes, and the one-off costs (process groups, plan
    # caches) that should not land in the timed reps.
    with comm.counting() as counted:
        _check(run_autoshard(), expected, "autoshard", pair)
    recorder = CollectiveRecorder()
    with recorder:
        _check(run_dtensor(), expected, "DTensor", pair)
    min_cost = None
    planner = _min_cost_planner()
    if planner is not None:
        enable, clear = planner
        clear()
        min_cost_recorder = CollectiveRecorder()
        try:
            with enable(), min_cost_recorder:
                _check(run_dtensor(), expected, "DTensor (min-cost planner)", pair)
        finally:
            clear()
        min_cost = _describe_records(min_cost_recorder.records, mesh)

    sides: dict[str, Callable[[], torch.Tensor]] = {
        "autoshard": run_autoshard,
        "dtensor": run_dtensor,
    }
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            out = sides[name]()
            seconds[name].append(time.perf_counter() - start)
            _check(out, expected, name, pair)

    return {
        "pair": list(pair),
        "src_layout": str(src),
        "dst_layout": str(dst),
        "autoshard": {
            "steps": [f"{s.kind}[{','.join(s.axes)}]" for s in plan.steps],
            "plan_bytes": plan.bytes,
            "planned_bytes": plan.bytes_on(rank),
            "bytes": sum(c["bytes"] for c in counted.values()),
            "calls": sum(c["calls"] for c in counted.values()),
            "seconds": seconds["autoshard"],
        },
        "dtensor": _describe_records(recorder.records, mesh) | {"seconds": seconds["dtensor"]},
        "dtensor_min_cost": min_cost,
        "dtensor_plan": _dtensor_plan(source, source.redistribute(mesh, dst_placements)),
    }


def _describe_records(records: list[dict[str, Any]], mesh: Any) -> dict[str, Any]:
    return {
        "steps": [f"{r['kind']}[{_axis_name(r['ranks'], mesh)}]" for r in records],
        "bytes": sum(r["bytes"] for r in records),
        "calls": len(records),
    }


def _rank_main(shape: tuple[int, int], reps: int, warmup: int) -> dict[str, Any]:
    # Four ranks share few cores: one intra-op thread each keeps them from fighting.
    torch.set_num_threads(1)
    mesh = autoshard.init_mesh(MESH)
    # Small integers as floats: every sum is exact in any order, so "equal" can mean equal.
    generator = torch.Generator().manual_seed(0)
    full = torch.randint(-8, 8, shape, generator=generator).to(torch.float32)
    with _dtensor_warnings() as warnings:
        pairs = [_measure_pair(pair, mesh, full, reps, warmup) for pair in PAIRS]
    return {"pairs": pairs, "dtensor_warnings": warnings.messages}


# -- the benchmark ----------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _merge_side(rows: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """One library's numbers for a pair, from every rank's view of it."""
    per_rep = [
        max(times)  # a rep ends when its slowest rank does
        for times in zip(*(row[side]["seconds"] for row in rows), strict=True)
    ]
    merged = {
        "steps": rows[0][side]["steps"],
        "bytes_by_rank": [row[side]["bytes"] for row in rows],
        "calls_by_rank": [row[side]["calls"] for row in rows],
        "ms_median": round(statistics.median(per_rep) * 1e3, 4),
        "ms_per_rep": [round(t * 1e3, 4) for t in per_rep],
    }
    if side == "autoshard":
        merged["plan_bytes"] = rows[0][side]["plan_bytes"]
        merged["planned_bytes_by_rank"] = [row[side]["planned_bytes"] for row in rows]
    return merged


def run(quick: bool) -> dict[str, Any]:
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    reps, warmup = (6, 2) if quick else (100, 5)
    per_rank = run_ranks(_rank_main, WORLD_SIZE, shape, reps, warmup, timeout=600.0)
    pairs = []
    for index, pair in enumerate(PAIRS):
        rows = [r["pairs"][index] for r in per_rank]
        a, d = _merge_side(rows, "autoshard"), _merge_side(rows, "dtensor")
        # paired: each rep's autoshard time over the DTensor time of the same rep
        paired = paired_ratio(a["ms_per_rep"], d["ms_per_rep"])
        min_cost = rows[0]["dtensor_min_cost"]
        pairs.append(
            {
                "src": pair[0],
                "dst": pair[1],
                "src_layout": rows[0]["src_layout"],
                "dst_layout": rows[0]["dst_layout"],
                "autoshard": a,
                "dtensor": d,
                "dtensor_min_cost": None
                if min_cost is None
                else {
                    "steps": min_cost["steps"],
                    "bytes_by_rank": [row["dtensor_min_cost"]["bytes"] for row in rows],
                },
                "dtensor_plan": rows[0]["dtensor_plan"],
                "bytes_ratio": _ratio(max(a["bytes_by_rank"]), max(d["bytes_by_rank"])),
                "total_bytes_ratio": _ratio(sum(a["bytes_by_rank"]), sum(d["bytes_by_rank"])),
                "time_ratio": paired["median"],
                "time": paired,
            }
        )
    return {
        "config": {
            "shape": list(shape),
            "dtype": "float32",
            "mesh": MESH,
            "world_size": WORLD_SIZE,
            "backend": "gloo",
            "threads_per_rank": 1,
            "reps": reps,
            "warmup": warmup,
        },
        "pairs": pairs,
        "dtensor_warnings": per_rank[0]["dtensor_warnings"],
    }


# -- the summary ------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _steps(steps: Sequence[str]) -> str:
    return " → ".join(f"`{s}`" for s in steps) or "(none)"


def _interval(pair: dict[str, Any]) -> str:
    """The time ratio's 95% interval (results from before it was measured have none)."""
    t = pair.get("time")
    return f"{t['low']:.2f}-{t['high']:.2f}" if t else "n/a"


def _geomean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v]
    return math.exp(sum(map(math.log, kept)) / len(kept)) if kept else None


def summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    pairs = result["pairs"]
    lines = [
        f"f32 tensor {cfg['shape'][0]}x{cfg['shape'][1]} on a {cfg['mesh']} mesh of "
        f"{cfg['world_size']} CPU ranks ({cfg['backend']}, {cfg['threads_per_rank']} thread per "
        f"rank). Placements are DTensor's, (dp, tp). Bytes: sent per rank by the ring formulas "
        "of `autoshard.comm.collective_bytes` for both libraries, max over ranks (the total over "
        f"ranks is in the total column). Time: median over {cfg['reps']} reps "
        f"(after {cfg['warmup']} warm-up) of the slowest rank, barrier before each call, the "
        "two libraries taking turns with the order turned around every rep. Ratios are "
        "autoshard / DTensor: below 1, autoshard moves less or is faster; the time ratio is "
        "the median of each rep's ratio, with its 95% interval (bootstrap over reps).",
        "",
        "| src → dst | autoshard steps | DTensor steps | autoshard B/rank | DTensor B/rank "
        "| bytes ratio | total ratio | autoshard ms | DTensor ms | time ratio | 95% interval |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pairs:
        a, d = p["autoshard"], p["dtensor"]
        lines.append(
            f"| ({p['src']}) → ({p['dst']}) | {_steps(a['steps'])} | {_steps(d['steps'])} "
            f"| {_fmt_bytes(max(a['bytes_by_rank']))} | {_fmt_bytes(max(d['bytes_by_rank']))} "
            f"| {_fmt_ratio(p['bytes_ratio'])} | {_fmt_ratio(p['total_bytes_ratio'])} "
            f"| {a['ms_median']:.3f} | {d['ms_median']:.3f} | {_fmt_ratio(p['time_ratio'])} "
            f"| {_interval(p)} |"
        )
    lines.append("")
    gb, gt = _geomean([p["bytes_ratio"] for p in pairs]), _geomean([p["time_ratio"] for p in pairs])
    lines.append(f"Geometric means of the ratios: bytes {_fmt_ratio(gb)}, time {_fmt_ratio(gt)}.")
    more = [p for p in pairs if (p["bytes_ratio"] or 0) > 1]
    slower = [p for p in pairs if (p["time_ratio"] or 0) > 1]
    lines.append("")
    lines.append(
        "- autoshard moves more bytes per rank than DTensor on: "
        + (", ".join(f"({p['src']}) → ({p['dst']})" for p in more) or "no pair")
        + "."
    )
    lines.append(
        "- autoshard is slower than DTensor on: "
        + (
            ", ".join(
                f"({p['src']}) → ({p['dst']}) ({p['time_ratio']:.2f}x, interval {_interval(p)})"
                for p in slower
            )
            or "no pair"
        )
        + "."
    )
    mismatched = [
        p
        for p in pairs
        if p["autoshard"]["bytes_by_rank"] != p["autoshard"]["planned_bytes_by_rank"]
    ]
    lines.append(
        "- autoshard's counted bytes equal `plan.bytes_on(rank)` on every rank"
        + (
            "."
            if not mismatched
            else " except on: " + ", ".join(f"({p['src']}) → ({p['dst']})" for p in mismatched)
        )
    )
    uneven = [p for p in pairs if len(set(p["autoshard"]["bytes_by_rank"])) > 1]
    if uneven:
        lines.append(
            "- Pairwise exchanges (`permute`) leave the ranks that are their own swap partner "
            "idle, so autoshard's total is below its max times the world size on: "
            + ", ".join(f"({p['src']}) → ({p['dst']})" for p in uneven)
            + "."
        )
    with_min_cost = [p for p in pairs if p.get("dtensor_min_cost")]
    if with_min_cost:
        differ = [
            p
            for p in with_min_cost
            if max(p["dtensor_min_cost"]["bytes_by_rank"]) != max(p["dtensor"]["bytes_by_rank"])
        ]
        lines.append(
            "- DTensor's optional min-cost planner (`use_min_cost_redistribution_plan`) moves "
            + (
                "the same bytes per rank as its default planner on every pair."
                if not differ
                else "different bytes per rank on: "
                + ", ".join(
                    f"({p['src']}) → ({p['dst']}) "
                    f"{_fmt_bytes(max(p['dtensor_min_cost']['bytes_by_rank']))}"
                    for p in differ
                )
                + "."
            )
        )
    fallback = [
        p for p in pairs if (p.get("dtensor_plan") or {}).get("alltoall_fallback_extra_bytes")
    ]
    if fallback:
        described = []
        for p in fallback:
            fair = (
                max(p["dtensor"]["bytes_by_rank"])
                - p["dtensor_plan"]["alltoall_fallback_extra_bytes"]
            )
            ratio = _ratio(max(p["autoshard"]["bytes_by_rank"]), fair)
            described.append(
                f"({p['src']}) → ({p['dst']}) {_fmt_bytes(fair)}/rank, ratio {_fmt_ratio(ratio)}"
            )
        lines.append(
            "- On CPU, DTensor runs each Shard(i) → Shard(j) step of its plan on one mesh dim as "
            "an all-gather plus a chunk (the fallback its warning below names). With an "
            "all-to-all there (e.g. NCCL), its plan would move: " + "; ".join(described) + "."
        )
    for message in result.get("dtensor_warnings", []):
        first_line = message.strip().splitlines()[0]
        lines.append(f"- DTensor warned: “{first_line}”")
    return "\n".join(lines)
