"""The search's pruning (docs/search.md: meshes and ZeRO stages skipped by a lower bound or by
their least memory, optima read off an alike graph) against the same search with none of it:
every (mesh, ZeRO stage) built with its moves and solved. Both must choose the same plan."""

from __future__ import annotations

import math

import pytest
import torch

from autoshard.cost import cluster_spec
from autoshard.graph.capture import capture
from autoshard.models import build, reference_config
from autoshard.search import driver
from autoshard.search.pruning import bare_graph, least_memory, search_session


def _captured(name: str, batch: int, hidden: int, seq: int):
    """A two-block reference model on the meta device in bfloat16, captured (priced at 8)."""
    config = reference_config(
        name, layers=2, hidden=hidden, heads=8, kv_heads=4, vocab=4096, seq=seq
    )
    with torch.device("meta"):
        model = build(config).to(torch.bfloat16)
        example = config.example_batch(batch)
    return capture(model, example, {}, train=True)


CASES = [  # (model, batch, hidden, seq, cluster, devices, also under a limit that binds)
    ("llama", 32, 512, 256, "dgx-h100", 8, False),
    ("gpt", 16, 1024, 512, "dgx-h100", 8, True),
    ("llama", 8, 512, 256, "cpu", 8, False),
]
DEPTH = {"layers": 8}


def _exhaustive(monkeypatch) -> None:
    """The driver with no pruning: every stage of every mesh built, with its moves, and
    solved afresh (no optimum read off another graph)."""

    def every_graph(og, shapes, levels, cluster, depth, step_share, limit):
        graphs = [bare_graph(og, m, cluster, depth, z, step_share) for m in shapes for z in levels]
        return graphs, [0.0] * len(graphs)

    def built(graphs, k, past, row, build, limit=math.inf, relax=False, solved=()):
        graphs[k] = build(graphs[k])
        return graphs[k]

    monkeypatch.setattr(driver, "bare_graphs", every_graph)
    monkeypatch.setattr(driver, "whole_within", built)
    monkeypatch.setattr(driver, "solved_alike", lambda solved, graph, room: None)


def _plan(result) -> tuple:
    """The mesh, the ZeRO stage and the optimum's price (of optima alike in price, the
    solver may return either)."""
    sol = result.solution
    return (*result.mesh.sizes, result.graph.zero, sol.seconds, sol.memory)


def _limits(og, devices: int, cluster, binding: bool) -> list[float | None]:
    """The device's memory, and where ``binding`` a limit that some stages of some meshes do
    not fit in (the integer programs under it take seconds: one case has it)."""
    if not binding:
        return [None]
    shapes = driver.mesh_shapes(devices, cluster)
    with search_session():
        floors = sorted(least_memory(bare_graph(og, m, cluster, DEPTH, 3, 1.0)) for m in shapes)
    return [None, floors[len(floors) // 2] * 1.05]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-b{c[1]}-h{c[2]}-{c[4]}")
def test_the_pruned_search_chooses_the_exhaustive_searchs_plan(case, monkeypatch) -> None:
    name, batch, hidden, seq, preset, devices, binding = case
    og = _captured(name, batch, hidden, seq)
    cluster = cluster_spec(preset, devices)
    skipped = 0
    for limit in _limits(og, devices, cluster, binding):
        pruned = driver.run_search(og, devices, cluster, memory_limit=limit, depth=DEPTH)
        with monkeypatch.context() as patched:
            _exhaustive(patched)
            every = driver.run_search(og, devices, cluster, memory_limit=limit, depth=DEPTH)
        where = f"{name} on {devices} {preset}, limit {limit}"
        assert _plan(pruned) == pytest.approx(_plan(every), rel=1e-9), where
        # every stage the exhaustive search solved and the pruned one skipped is slower than
        # what there was to beat, or fits nothing
        solved = {(tuple(r["mesh"].values()), r["zero"]): r for r in every.tried}
        best = every.solution.seconds
        for row in pruned.tried:
            if "skipped" not in row:
                continue
            skipped += 1
            other = solved[(tuple(row["mesh"].values()), row["zero"])]
            if "step_s" in other:
                assert other["step_s"] > best * (1 + driver.FINALIST_MARGIN) * (1 - 1e-9), where
                assert row["skipped"] == "bound" and row["bound_s"] <= other["step_s"] * (
                    1 + 1e-6
                ), (where, row, other)
            else:
                assert other.get("fits") is False, (where, row, other)
        assert len(every.tried) == len(pruned.tried), where
    assert skipped >= 2 or not binding, skipped  # under the limit, the pruning was at work
