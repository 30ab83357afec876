"""A search's caches and the way it prices belong to that search (``search.state``): nothing
it learnt is left in a module once it ends, and searches in two threads at once plan what
each plans alone."""

from __future__ import annotations

import gc
import sys
import threading
import types

import torch

import autoshard
from autoshard import memo
from autoshard.cost import cluster_spec, collectives
from autoshard.graph import capture
from autoshard.layout import Layout
from autoshard.models import build, reference_config
from autoshard.options import Options
from autoshard.schedule import simulate
from autoshard.search import options, pipelined, pricing, pruning, solvers, state


def _model(name: str) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = build(reference_config(name, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128,
                                   vocab=128, seq=32))  # fmt: skip
    ids = torch.randint(0, 128, (8, 32))
    return model, (ids, ids)


def _planned(name: str, captured: dict | None = None, **kw) -> tuple:
    model, batch = _model(name)
    made = autoshard.plan(model, batch, "dgx-h100", num_devices=8, captured=captured, **kw)
    return made.mesh.as_dict(), made.json["strategies"], made.predicted.step_time


def _module_state() -> dict[str, object]:
    """Every non-empty container a module of the search's caches holds (constants aside)."""
    held = {}
    for module in (options, pricing, pruning, solvers, state):
        for name, value in vars(module).items():
            if name.isupper() or name.startswith("__") or isinstance(value, types.ModuleType):
                continue
            if isinstance(value, dict | list | set) and value:
                held[f"{module.__name__}.{name}"] = value
    return held


def test_nothing_a_search_learnt_stays_in_a_module() -> None:
    _planned("gpt", sequence_parallel=True, precision="bf16")
    gc.collect()  # (solvers' and the program's caches are weak: a graph's, gone with it)
    assert _module_state() == {}
    assert state.state().caches == {}  # outside a search: a state of its own, empty
    assert state.state().context["sequence_parallel"] is False


def _memoized() -> dict[str, int]:
    """How many answers each memoized function of autoshard's modules keeps outside a search
    (an ``lru_cache``, or a ``memo.per_search`` function's cache for the runtime)."""
    held = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("autoshard") or module is None:
            continue
        for attr, value in vars(module).items():
            if getattr(value, "__module__", None) != name:
                continue  # (imported: another module's, or torch's)
            for cached in (value, getattr(value, "outside", None)):
                if hasattr(cached, "cache_info") and cached.cache_info().currsize:
                    held[f"{name}.{attr}"] = cached.cache_info().currsize
    return held


def test_the_lower_layers_keep_nothing_a_search_priced() -> None:
    """The prices, redistribution plans and grids the cost model works out for a search are
    kept in the search's scope (``memo``) and go with it; the search fills no cache of a
    module, and none is open once it returns."""
    assert collectives.transition.__module__ == "autoshard.cost.collectives"  # loaded
    before = _memoized()
    _planned("llama", zero=1)
    _planned("gpt", sequence_parallel=True, precision="bf16")
    # what runs before (a run's redistributions keep their own cache) stays as it was
    assert _memoized() == before
    assert memo._OPEN.get() is None
    with memo.scope() as caches:  # inside one: the answers are the scope's
        src = Layout.replicated((8, 4), 4)
        dst = Layout.from_strategy((8, 4), (4, 1), 4)
        collectives.transition(src, dst, cluster_spec("dgx-h100", 4))
        assert caches
    assert _memoized() == before


def test_a_pipeline_search_keeps_its_schedules_to_itself() -> None:
    """The schedules a pipeline search prices and the order their ranks run in (found once a
    schedule) are the search's: none is left in a module, cached or held, once it ends."""
    model, batch = _model("gpt")
    graph = capture(model, tuple(x[:2] for x in batch), train=True)  # a micro-batch's rows
    given = Options(pp=2, microbatches=4, schedule="1f1b", recompute="none")
    best, _, _ = pipelined.search_pipeline(lambda m: graph, 8, 4, cluster_spec("dgx-h100", 4),
                                           given)  # fmt: skip
    assert "replay" in best.schedule.found  # played once, kept with the schedule
    for module in (pipelined, simulate):
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(value, types.ModuleType):
                continue
            assert not (isinstance(value, dict | list | set) and value), f"{name} holds {value}"
            assert not hasattr(value, "cache_info"), f"{module.__name__}.{name} is memoized"


def test_searches_in_two_threads_plan_what_each_plans_alone() -> None:
    """(Captured first: torch's tracing keeps its modes per process, not per thread.)"""
    kinds = (("gpt", {"sequence_parallel": True}), ("llama", {"zero": 1}))
    graphs = [autoshard.capture_modes(*_model(name)) for name, _ in kinds]
    alone = [_planned(name, graphs[k], **kw) for k, (name, kw) in enumerate(kinds)]
    together: list = [None, None]

    def run(k: int) -> None:
        together[k] = _planned(kinds[k][0], graphs[k], **kinds[k][1])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
