"""The pipeline search's helper process (search/helper.py): the plan and every configuration
priced are the same with it as without it, and a helper that fails, dies or sticks leaves its
jobs to the search, which neither hangs nor loses them."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.nn.functional as F

from autoshard.cost import cluster_spec
from autoshard.graph import capture
from autoshard.models import build, reference_config
from autoshard.options import Options
from autoshard.search import ahead, solvers
from autoshard.search import helper as helper_module
from autoshard.search.driver import run_search
from autoshard.search.helper import Helper
from autoshard.search.pipelined import search_pipeline

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="the helper is a fork: Linux only"
)


_TAKE = Helper.take
_STEAL = Helper.steal
_SERVE = helper_module._serve


def _searched(og, spec, monkeypatch, helper: bool):
    delivered, stolen = [], []

    def counted(self, job):
        outcome = _TAKE(self, job)
        if outcome is not None and isinstance(job[0], int):  # (pp, m, ...): not a mesh's
            delivered.append(job)
        return outcome

    def counted_steal(self):
        job = _STEAL(self)
        stolen.extend([job] if job is not None else [])
        return job

    monkeypatch.setattr(Helper, "take", counted)
    monkeypatch.setattr(Helper, "steal", counted_steal)
    best, tried, _ = search_pipeline(
        lambda m: og, 32, 16, spec, Options(), depth={"layers": 8}, helper=helper
    )
    return best, tried, delivered, stolen


def _slow_serve(jobs, run, *rest):
    """The helper, a second slower at each job than the search."""

    def slow(job):
        time.sleep(1.0)
        return run(job)

    return _SERVE(jobs, slow, *rest)


@pytest.mark.parametrize(("gib", "slow"), [(0.5, False), (80, False), (80, True)])
def test_the_helper_finds_the_plan_and_prices_what_the_search_alone_does(
    gpt_meta_graph, monkeypatch, gib, slow
) -> None:
    spec = dataclasses.replace(cluster_spec("dgx-h100", 16), memory_bytes=gib * 2**30)
    alone, tried_alone, none, _ = _searched(gpt_meta_graph, spec, monkeypatch, helper=False)
    if slow:  # the search takes the helper's later jobs off its list rather than wait
        monkeypatch.setattr(helper_module, "_serve", _slow_serve)
    helped, tried_helped, delivered, stolen = _searched(
        gpt_meta_graph, spec, monkeypatch, helper=True
    )
    assert none == []
    # the later degrees' first stage searches came from the helper or were taken off its
    # list: degrees 4 and 8 of 16 devices (8 blocks), then the best degree's last count
    assert delivered, stolen
    assert {job[0] for job in delivered + stolen} >= {4, 8}
    if slow:
        assert stolen, delivered
    assert tried_helped == tried_alone  # every configuration, its step and its memory
    for plan in (helped, alone):
        assert plan.predicted.peak_memory <= spec.memory_bytes
    assert helped.predicted == alone.predicted
    assert (helped.schedule.name, helped.schedule.num_ranks, helped.schedule.microbatches) == (
        alone.schedule.name, alone.schedule.num_ranks, alone.schedule.microbatches,
    )  # fmt: skip
    assert helped.recompute == alone.recompute
    assert helped.stage.json["strategies"] == alone.stage.json["strategies"]
    assert helped.stage.json["mesh"] == alone.stage.json["mesh"]
    assert helped.result.graph.zero == alone.result.graph.zero


def _square(job: int) -> int:
    if job == 2:
        raise ZeroDivisionError("a bug in the helper")
    if job == 3:
        raise KeyError("its own answer")
    return job * job


def test_a_helper_s_failures_come_back_as_run_here_or_as_the_job_s_own_error() -> None:
    with Helper([1, 2, 3, 4], _square, (KeyError,)) as h:
        assert h.take(5) is None  # not one of its jobs
        assert h.take(1) == ("ok", 1)
        assert h.take(2) is None  # failed there: run here, where its error shows as it would
        outcome = h.take(3)
        assert outcome[0] == "error" and isinstance(outcome[1], KeyError)
        assert h.take(4) == ("ok", 16)
        assert h.delivered == 3


def _dies(job: tuple[int, str]) -> int:
    n, go = job
    if n == 2:  # once job 1's outcome was taken (a death loses what is not sent yet)
        while not os.path.exists(go):
            time.sleep(0.01)
        os._exit(1)
    return n


def _sticks(job: int) -> int:
    if job == 2:
        time.sleep(600)
    return job


def test_a_helper_that_dies_or_sticks_is_stopped_and_its_jobs_run_here(
    monkeypatch, tmp_path
) -> None:
    go = str(tmp_path / "go")
    jobs = [(n, go) for n in (1, 2, 3)]
    with Helper(jobs, _dies) as h:
        assert h.take(jobs[0]) == ("ok", 1)
        open(go, "w").close()
        assert h.take(jobs[1]) is None and h.take(jobs[2]) is None
        assert h.proc is None  # stopped and reaped
    monkeypatch.setattr(helper_module, "PATIENCE_S", 1.0)
    began = time.perf_counter()
    with Helper([1, 2, 3], _sticks) as h:
        assert h.take(1) == ("ok", 1)
        assert h.take(2) is None and h.take(3) is None
        assert h.proc is None
    assert time.perf_counter() - began < 30


def _slow_first(job: int) -> int:
    if job == 1:
        time.sleep(0.5)
    return job * 10


def test_the_latest_offer_replaces_the_offers_not_begun() -> None:
    with Helper([1], _slow_first) as h:
        h.offer([2])  # while job 1 runs: replaced by the next offer before it begins
        h.offer([3, 4])
        assert h.take(1) == ("ok", 10)
        while 4 not in h.begun and h._receive(5.0):  # the offer's jobs begin in its order
            pass
        assert h.take(3) == ("ok", 30) and h.take(4) == ("ok", 40)
        assert h.take(2) is None  # never begun: run here
        assert 2 not in h.begun
        h.offer([3])  # taken already: offered again, run again
        while 3 not in h.got and h._receive(5.0):
            pass
        assert h.take(3) == ("ok", 30)


def _large_then_marked(job: tuple[int, str]) -> bytes:
    n, marker = job
    if n == 2:  # begun: the first outcome did not hold the helper
        open(marker, "w").close()
    return bytes(n << 20)


def test_a_large_outcome_does_not_hold_the_helper_until_it_is_taken(tmp_path) -> None:
    # an outcome past a pipe's 64 KiB waits to be read; the helper goes on to its next job
    marker = str(tmp_path / "second-begun")
    jobs = [(1, marker), (2, marker)]
    with Helper(jobs, _large_then_marked) as h:
        waited = time.perf_counter()
        while not os.path.exists(marker) and time.perf_counter() - waited < 30:
            time.sleep(0.01)
        assert os.path.exists(marker), "the helper waited for its first outcome to be read"
        assert h.take(jobs[0]) == ("ok", bytes(1 << 20))
        assert h.take(jobs[1]) == ("ok", bytes(2 << 20))


def _marked(job: tuple[int, str]) -> int:
    n, folder = job
    open(os.path.join(folder, str(n)), "w").close()
    if n == 1:
        time.sleep(0.5)
    return n * 10


def test_jobs_not_begun_are_taken_off_the_helper_s_list_to_run_here(tmp_path) -> None:
    jobs = [(n, str(tmp_path)) for n in (1, 2, 3)]
    with Helper(jobs, _marked) as h:
        while jobs[0] not in h.begun and h._receive(5.0):
            pass
        assert h.would_wait(jobs[0]) and h.would_wait(jobs[2])
        assert h.steal() == jobs[2] and h.steal() == jobs[1]  # from the last
        assert h.steal() is None  # the first is begun
        assert not h.would_wait(jobs[2]) and h.take(jobs[2]) is None  # run here
        assert h.take(jobs[0]) == ("ok", 10)
        assert h.take(jobs[1]) is None
        time.sleep(0.2)
    assert sorted(os.listdir(tmp_path)) == ["1"]  # the helper ran neither taken job


def _hf_loss(out, targets):
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))


def _llama_graph(kind: str):
    """A two-block Llama on the meta device: the reference one, or transformers' built from
    a config (captured with its loss)."""
    if kind == "reference":
        config = reference_config("llama", layers=2, hidden=512, heads=8, kv_heads=4,
                                  ffn=1536, vocab=32000, seq=512)  # fmt: skip
        with torch.device("meta"):
            model, example = build(config), config.example_batch(64)
        return capture(model, example, {}, train=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        idx = torch.zeros(64, 512, dtype=torch.long)
    return capture(model, (idx, idx), {}, loss_fn=_hf_loss, train=True)


@pytest.mark.parametrize("kind", ["reference", "transformers"])
def test_moves_priced_ahead_give_the_search_alone_s_plan(monkeypatch, kind) -> None:
    """The optimal search's helper builds the later half of the meshes' graphs without moves,
    then prices the moves of those the search ranks after the first and solves their
    relaxations; the search takes them where it builds those meshes: the same plan and the
    same table, with fewer relaxations solved in this process."""
    og = _llama_graph(kind)
    spec = cluster_spec("dgx-h100", 32)
    taken, relaxed = [], []
    solve_program = solvers.solve_program

    def counted(self, job):
        outcome = _TAKE(self, job)
        taken.extend([job] if outcome is not None else [])
        return outcome

    def counted_solve(program, c, a, integral):
        relaxed.extend([] if integral else [os.getpid()])
        return solve_program(program, c, a, integral)

    monkeypatch.setattr(Helper, "take", counted)
    monkeypatch.setattr(solvers, "solve_program", counted_solve)
    monkeypatch.setattr(ahead, "AHEAD_AFTER_S", 0.0)  # a helper however small the graphs
    monkeypatch.setattr(ahead, "helper_cores", lambda: 1)  # and however few the cores

    def searched():
        result = run_search(og, 32, spec, depth={"layers": 16} if kind == "reference" else None)
        rows = [{k: v for k, v in row.items() if k != "solve_s"} for row in result.tried]
        return result.mesh, result.graph.zero, result.solution.choice, rows

    helped = searched()
    # graphs the helper built without moves, then moves it priced, were used
    assert {job[0] for job in taken} == {"bare", "moves"}, taken
    relaxed_helped = len(relaxed)
    monkeypatch.setattr(ahead, "helper_cores", lambda: 0)
    del taken[:], relaxed[:]
    alone = searched()
    assert taken == []
    assert helped == alone
    assert relaxed_helped < len(relaxed), (relaxed_helped, len(relaxed))


def test_no_helper_where_the_user_says_so_or_inside_a_helper(monkeypatch) -> None:
    monkeypatch.setenv("AUTOSHARD_PLAN_HELPERS", "0")
    assert helper_module.helper_cores() == 0
    monkeypatch.delenv("AUTOSHARD_PLAN_HELPERS")
    assert helper_module.helper_cores() == len(os.sched_getaffinity(0)) - 1
    monkeypatch.setattr(helper_module, "_IN_HELPER", [True])
    assert helper_module.helper_cores() == 0


def test_a_helper_ends_when_its_parent_s_end_of_the_offers_closes() -> None:
    # as where the parent dies without stopping it: it holds no copy of the parent's end
    h = Helper([], _square)
    h.offers.close()
    h.proc.join(timeout=20)
    assert h.proc.exitcode is not None, "the helper outlived its parent's end of the offers"
    h.proc = None
    helper_module._LIVE[0] -= 1
