"""The pipeline's pricing (cost/pipeline.py) adds up to the stage plan's estimate, holds the
micro-batches the schedule holds, and makes ``autoshard plan --pp`` fit models that do not
fit without stages; no ranks needed."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest

from autoshard.cli.main import main
from autoshard.cost import cluster_spec
from autoshard.cost import pipeline as piped
from autoshard.cost.pipeline import model_pieces, price_pipeline
from autoshard.options import Options
from autoshard.schedule import make_schedule
from autoshard.search import PlanningError, pipelined
from autoshard.search.pipelined import search_pipeline

LAYERS = 8
RECOMPUTE = ("none", "selective", "full")


@pytest.fixture(scope="module")
def stage(gpt_meta_graph):
    og = gpt_meta_graph
    spec = cluster_spec("dgx-h100", 16)
    given = {"pp": 4, "microbatches": 8, "schedule": "1f1b", "recompute": "none"}
    best, tried, _ = search_pipeline(
        lambda m: og, 4 * 8, 16, spec, Options(**given), depth={"layers": LAYERS}
    )
    assert len(tried) == 1  # all given: one configuration priced
    return og, spec, best


def test_the_pieces_add_up_to_the_estimate(stage) -> None:
    og, spec, planned = stage
    est = planned.stage.predicted
    pre, block, count, post = model_pieces(est, og)
    assert count == LAYERS
    whole = pre + block.scaled(count) + post
    assert whole.forward == pytest.approx(est.compute_forward + est.comm_forward)
    assert whole.backward == pytest.approx(est.compute_backward + est.comm_backward)
    for kind in ("parameters", "gradients", "optimizer"):
        assert whole.state[kind] == pytest.approx(est.memory[kind])
    # every pipeline rank holds its share of the state: together, the whole model's once
    p = planned.predicted
    for kind in ("parameters", "gradients", "optimizer"):
        assert sum(m[kind] for m in p.memory) == pytest.approx(est.memory[kind])
    assert sum(f for f, _ in p.stage_seconds) == pytest.approx(whole.forward)


def test_1f1b_holds_less_than_gpipe_and_recompute_less_again(stage) -> None:
    og, spec, planned = stage
    est, boundary = planned.stage.predicted, planned.boundary_bytes
    priced = {
        (name, r): price_pipeline(est, og, make_schedule(name, 4, 8), spec, r, boundary)
        for name in ("gpipe", "1f1b")
        for r in ("none", "selective", "full")
    }
    first = {k: v.memory[0]["activations"] for k, v in priced.items()}
    # GPipe's first stage holds 8 micro-batches, 1F1B's 4
    assert first[("gpipe", "none")] == pytest.approx(2 * first[("1f1b", "none")])
    assert first[("1f1b", "full")] < first[("1f1b", "selective")] < first[("1f1b", "none")]
    steps = {k: v.step_time for k, v in priced.items()}
    assert steps[("1f1b", "none")] < steps[("1f1b", "selective")] < steps[("1f1b", "full")]
    # the bubble of balanced stages at nominal costs is (p-1)/(m+p-1); here the embedding,
    # the head and the sends (of a small model: comparable to a stage's compute) add to it
    assert 3 / 11 <= priced[("1f1b", "none")].bubble < 0.5


@pytest.mark.parametrize("gib", [0.4, 0.5])
def test_searching_zero_finds_what_fixing_any_zero_stage_finds(stage, gib) -> None:
    """Where memory binds, a higher ZeRO stage can make room for less recompute or another
    schedule: the search with ZeRO free is as fast as the best with it fixed at 0, 1 or 2,
    and faster than ZeRO 0, where a slower configuration (more recompute) already fits."""
    og, spec, _ = stage
    tight = dataclasses.replace(spec, memory_bytes=gib * 2**30)

    def best(**zero: int) -> float:
        given = {"pp": 4, "microbatches": 8, **zero}
        found, _, _ = search_pipeline(
            lambda m: og, 4 * 8, 16, tight, Options(**given), depth={"layers": LAYERS}
        )
        assert found.predicted.peak_memory <= tight.memory_bytes
        return found.predicted.step_time

    fixed = {z: best(zero=z) for z in (0, 1, 2)}
    free = best()
    assert free <= min(fixed.values()) * (1 + 1e-9), (free, fixed)
    assert free < fixed[0] * 0.99, (free, fixed)


def test_a_degree_whose_compute_alone_is_slower_is_skipped_and_the_plan_stays(
    stage, monkeypatch
) -> None:
    """The search skips a pipeline degree and micro-batch count whose floor (its busiest
    rank's compute, each op spread over a stage's devices at its best efficiency:
    ``least_busiest``) is no faster than the best found. It finds the plan the search that
    prices every one finds, with fewer stage searches, and every configuration either search
    priced steps no faster than its floor."""
    og, _, _ = stage
    spec = cluster_spec("dgx-h100", 16)
    real, floors = piped.least_busiest, {}

    def searched(skips: bool) -> tuple:
        stage_searches = []

        def floor(one, graph, devices, placements, m):  # each (pp, m)'s floor, recorded
            floors[(16 // devices, m)] = real(one, graph, devices, placements, m)
            return floors[(16 // devices, m)] if skips else 0.0

        def counted(*args, **kwargs):
            stage_searches.append(args[1])
            return search(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(piped, "least_busiest", floor)
            patch.setattr(pipelined, "run_search", counted)
            found, tried, _ = search_pipeline(
                lambda m: og, 64, 16, spec, Options(), depth={"layers": LAYERS}
            )
        for t in tried:
            assert floors.get((t.pp, t.microbatches), 0.0) <= t.step_s, t
        schedule = found.schedule
        chosen = (schedule.num_ranks, schedule.microbatches, schedule.name, found.recompute)
        return (*chosen, found.stage.zero, found.predicted.step_time), found, stage_searches

    search = pipelined.run_search
    everything, every_plan, all_searches = searched(skips=False)
    pruned, plan, fewer = searched(skips=True)
    assert pruned == everything
    assert plan.stage.json["strategies"] == every_plan.stage.json["strategies"]
    assert len(fewer) < len(all_searches), (fewer, all_searches)
    assert any(f >= plan.predicted.step_time for f in floors.values()), floors


def test_recompute_leaves_the_forward_and_selective_costs_no_more_than_full(stage) -> None:
    """Recompute runs more of the forward again in backward and keeps less: it changes no
    forward, and selective (the forward of everything but the products again) costs no more
    than full (the whole forward again) on the same stage plan."""
    og, spec, planned = stage
    est, boundary = planned.stage.predicted, planned.boundary_bytes
    sched = make_schedule("interleaved-1f1b", 4, 8, 2)
    priced = {r: price_pipeline(est, og, sched, spec, r, boundary) for r in RECOMPUTE}
    forwards = {r: [f for f, _ in p.stage_seconds] for r, p in priced.items()}
    assert forwards["selective"] == forwards["none"] == forwards["full"]
    backward = {r: sum(b for _, b in p.stage_seconds) for r, p in priced.items()}
    assert backward["none"] < backward["selective"] < backward["full"]
    step = {r: p.step_time for r, p in priced.items()}
    assert step["none"] <= step["selective"] <= step["full"]


def test_a_lighter_recompute_given_is_not_priced_on_a_slower_stage_plan(stage) -> None:
    """Where full recompute fits the fastest stage plan and selective does not, selective
    given does not fit: the search does not shard the stage plan further (a slower forward)
    to fit it, a plan slower than full recompute's (nor offloaded: where nothing fits, the
    search would otherwise move the optimizer to the host)."""
    og, spec, _ = stage
    given = {"pp": 4, "microbatches": 8, "schedule": "1f1b", "zero": 0, "offload": {}}

    def search(cluster, recompute):
        found, _, _ = search_pipeline(lambda m: og, 4 * 8, 16, cluster,
                                      Options(**given, **recompute),
                                      depth={"layers": LAYERS})  # fmt: skip
        return found

    full = search(spec, {"recompute": "full"})
    selective = price_pipeline(full.stage.predicted, og, full.schedule, spec, "selective",
                               full.boundary_bytes)  # fmt: skip
    assert full.predicted.peak_memory < selective.peak_memory
    tight = dataclasses.replace(
        spec, memory_bytes=(full.predicted.peak_memory + selective.peak_memory) / 2
    )
    assert search(tight, {"recompute": "full"}).predicted.stage_seconds == (
        full.predicted.stage_seconds
    )
    with pytest.raises(PlanningError, match="recompute selective"):
        search(tight, {"recompute": "selective"})


def test_sequence_parallel_reaches_the_stage_plans(tmp_path) -> None:
    """``autoshard plan --sequence-parallel`` with stages splits the stage plan's norms and
    residuals by sequence over tp: less activation memory on every pipeline rank than the
    plan the search finds without it (a small GPT's, one sequence a micro-batch: no batch
    to split over tp, and collectives that cost more than its norms)."""
    args = ["plan", "--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "8",
            "--seq", "128", "--batch", "4", "--vocab", "512", "--devices", "4", "--tp", "2",
            "--pp", "2", "--microbatches", "4", "--schedule", "1f1b",
            "--recompute", "none"]  # fmt: skip

    def kept(*sp: str) -> list[float]:
        path = tmp_path / f"plan{len(sp)}.json"
        assert main([*args, *sp, "--json", str(path)]) == 0
        return [m["activations"] for m in json.loads(path.read_text())["pipeline"]["memory_bytes"]]

    split, whole = kept("--sequence-parallel"), kept()
    assert all(s < w for s, w in zip(split, whole, strict=True)), (split, whole)


def _untimed(text: str) -> str:
    """A plan's output, the seconds planning took left out."""
    return re.sub(r"\d+(\.\d+)? s\b", "<s>", text)


def _plan_of(path) -> dict:
    """A plan JSON without the seconds its planning took."""

    def untimed(x):
        if isinstance(x, dict):
            return {k: untimed(v) for k, v in x.items() if not _timing(k)}
        return [untimed(v) for v in x] if isinstance(x, list) else x

    return untimed(json.loads(path.read_text()))


def _timing(key: str) -> bool:
    return key in ("search_s", "capture_s", "end_to_end_s", "solve_s")


def _finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_plan_with_stages_fits_what_does_not_fit_without(tmp_path, capsys) -> None:
    plan = ["plan", "--model", "gpt", "--layers", "32", "--hidden", "4096", "--heads", "32",
            "--seq", "2048", "--batch", "512", "--vocab", "51200", "--cluster", "dgx-h100",
            "--nodes", "1"]  # fmt: skip
    args = [sys.executable, "-m", "autoshard.cli", *plan]
    # without --pp: nothing fits without stages, so the stages are searched; on one core
    # (where the machine lets a process be bound to one) the same plan and output come out.
    # Both processes start first and run beside this one's checks: each uses one core.
    one_core = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    runs = {
        name: subprocess.Popen(
            [*bound, *args, "--json", str(tmp_path / f"{name}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, bound in (("ahead", []), ("alone", one_core))
    }
    try:
        assert main([*plan, "--pp", "1"]) == 3
        assert "no plan fits in 80.00 GiB" in capsys.readouterr().err
        searched, alone = (_finished(runs[name]) for name in ("ahead", "alone"))
    finally:
        for proc in runs.values():
            proc.kill()
            proc.wait()
    assert searched.returncode == 0, searched.stderr
    assert "no plan fits in 80.00 GiB" in searched.stderr and "pipeline: pp(" in searched.stdout
    assert searched.stderr.index("no plan fits") < searched.stderr.index("searching pipeline")
    assert "(microbatches, pp, recompute, schedule searched)" in searched.stdout
    assert alone.returncode == 0, alone.stderr
    assert _untimed(searched.stdout) == _untimed(alone.stdout)
    assert searched.stderr == alone.stderr
    assert _plan_of(tmp_path / "ahead.json") == _plan_of(tmp_path / "alone.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ahead.json", "alone.json"]
    staged = [*plan, "--pp", "4", "--microbatches", "64", "--recompute", "full", "--schedule",
              "1f1b", "--json", str(tmp_path / "plan.json")]  # fmt: skip
    assert main(staged) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "pipeline: pp(4) x" in out and "1f1b, 64 micro-batches" in out
    with pytest.raises(SystemExit) as exit_info:
        main([*plan, "--pp", "4", "--microbatches", "5"])
    assert exit_info.value.code == 2
    assert "--microbatches 5 does not divide the batch of 512 samples" in capsys.readouterr().err

    # the plan's pipeline played again by autoshard simulate, and drawn
    assert main(["simulate", str(tmp_path / "plan.json"), "--picture",
                 str(tmp_path / "gantt.png")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "predicted: step" in out and (tmp_path / "gantt.png").stat().st_size > 0


def test_simulate_a_named_schedule(capsys) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.3%" in out and "in flight per stage [4, 3, 2, 1]" in out


def test_pp_auto_shows_the_faster_and_a_stage_that_does_not_fit_is_named(capsys) -> None:
    small = ["plan", "--model", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16",
             "--seq", "1024", "--batch", "32", "--vocab", "32000", "--cluster", "dgx-h100",
             "--devices", "16"]  # fmt: skip
    pipeline = ["--microbatches", "8", "--schedule", "1f1b", "--recompute", "full"]
    # the model fits without stages, and runs faster so: --pp auto prices both, keeps that
    assert main([*small, "--pp", "auto", *pipeline]) == 0
    captured = capsys.readouterr()
    assert "without pipeline stages" in captured.err and "the plan without them" in captured.err
    assert "pipeline:" not in captured.out and "predicted step" in captured.out
    # 0.1 GiB a device: no pipeline rank holds its share at ZeRO 0, 1 or 2 (3 needs one
    # micro-batch); the error names the least of them, the rank and bytes
    assert main([*small, "--pp", "4", *pipeline, "--memory-gib", "0.1"]) == 3
    err = capsys.readouterr().err
    assert "no pipeline configuration fits 102.40 MiB per device (3 tried)" in err
    assert "recompute full, ZeRO 2: pipeline rank" in err
    assert "pipeline rank" in err and "optimizer" in err and "try more stages" in err
