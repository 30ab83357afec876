"""Copies in the search (docs/parallelism/copies.md): the plan of ``k`` copies is the plan of
one copy's graph (the batch's rows cut to ``batch / k``, as a pipeline's stage plan is one
micro-batch's), priced as ``k`` copies interleaved (``cost.copies``); ``copies="auto"``
searches each of ``COPIES`` that divides the batch and keeps the fastest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from autoshard.cost import ClusterSpec
from autoshard.cost.breakdown import breakdown_rows
from autoshard.cost.copies import with_copies
from autoshard.graph import OpGraph
from autoshard.search.driver import run_search, size_text
from autoshard.search.plans import Plan, PlanningError
from autoshard.search.result_plan import SearchResult, build_plan

#: the copies ``copies="auto"`` tries
COPIES = (1, 2, 4)


def copies_tried(batch: int, copies: int | str) -> list[int]:
    """The copies to search: the one given, or those of ``COPIES`` that divide the batch."""
    if copies == "auto":
        return [k for k in COPIES if batch % k == 0]
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies={copies!r}: expected a positive int or 'auto'")
    if batch % copies:
        raise PlanningError(
            f"copies={copies}: the batch of {batch} rows does not cut into {copies} copies"
        )
    return [copies]


def batch_of(og: OpGraph) -> int:
    """The batch copies cut: dim 0 of the graph's first input of one or more dims."""
    shapes = [i.out_shapes[0] for i in og if i.kind == "input" and i.out_shapes[0]]
    if not shapes:
        raise PlanningError("copies: the model takes no input with a batch dim to cut")
    return shapes[0][0]


def search_copies(
    micro: Callable[[int], OpGraph],
    batch: int,
    copies: int | str,
    search: Callable[[OpGraph, int], SearchResult],
    cluster: ClusterSpec,
    memory_limit: float | None = None,
) -> tuple[SearchResult, Plan]:
    """The fastest plan that fits over the copies tried (fewer copies where as fast):
    ``micro(k)`` the graph of one of ``k`` copies, ``search(graph, k)`` its search (what runs
    once a step weighted ``1 / k``, as a pipeline's micro-batch weighs it). Copies are tried
    only beside a plan that waits for in-line communication, which they alone can hide.
    Returns the chosen search result and its plan, whose ``predicted`` prices every copy."""
    limit = memory_limit or cluster.memory_bytes
    best: tuple[float, SearchResult, Plan] | None = None
    tried: list[dict[str, Any]] = []
    for k in copies_tried(batch, copies):
        og = micro(k)
        result = search(og, k)
        built = priced(build_plan(og, result, cluster), og, k, result.graph.depth)
        est = built.predicted
        fits = est.peak_memory <= limit
        tried.append(
            {
                "copies": k,
                "step_s": est.step_time,
                "exposed_comm_s": est.exposed_comm,
                "peak_memory_bytes": est.peak_memory,
                "fits": fits,
            }
        )
        if fits and (best is None or est.step_time < best[0] * (1 - 1e-9)):
            best = (est.step_time, result, built)
        if k == 1 and copies == "auto" and est.comm_forward + est.comm_backward <= 0.0:
            break
    if best is None:
        needs = ", ".join(f"{r['copies']}: {size_text(r['peak_memory_bytes'])}" for r in tried)
        raise PlanningError(
            f"copies={copies}: no plan fits in {size_text(limit)} a device (copies: {needs}); "
            "every copy keeps its activations until backward"
        )
    _, result, built = best
    if copies == "auto":
        built.json["predicted"]["copies_tried"] = tried
    return result, built


def priced(built: Plan, og: OpGraph, copies: int, depth: Mapping[str, int] | None) -> Plan:
    """``built``, the plan of one copy's graph ``og``, priced as ``copies`` copies: its
    prediction and the JSON's (``copies``, the exposed communication with the copies
    interleaved and one after another)."""
    pred = built.json["predicted"]
    pred["copies"] = copies
    pred["exposed_comm_s"] = pred["exposed_comm_without_copies_s"] = built.predicted.exposed_comm
    if copies == 1:
        return built
    est = with_copies(built.predicted, built, og, copies, depth)
    pred["exposed_comm_s"] = est.exposed_comm
    pred["exposed_comm_without_copies_s"] = est.exposed_comm_without_copies
    pred["step_time_s"], pred["mfu"] = est.step_time, est.mfu
    pred["peak_memory_bytes"] = est.peak_memory
    pred["memory_bytes"] = est.as_dict()["memory_bytes"]
    pred["layers"] = breakdown_rows(est, og)
    return dataclasses.replace(built, predicted=est)


def searched_with(
    num_devices: int, cluster: ClusterSpec, **keywords: Any
) -> Callable[[OpGraph, int], SearchResult]:
    """``run_search`` of a graph, its other arguments fixed (the search ``search_copies``
    runs on each copy's graph)."""

    def search(graph: OpGraph, copies: int = 1) -> SearchResult:
        return run_search(graph, num_devices, cluster, step_share=1 / copies, **keywords)

    return search


__all__ = ["COPIES", "batch_of", "copies_tried", "priced", "search_copies", "searched_with"]
