"""Copies in the cost model and the search (docs/parallelism/copies.md): k copies of a plan
priced for one, interleaved on a compute and a communication stream."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autoshard
from autoshard.cli.main import main
from autoshard.cost import cluster_spec, estimate
from autoshard.cost.breakdown import layer_breakdown
from autoshard.cost.copies import COMM, COMPUTE, copy_chain, interleaved, with_copies
from autoshard.graph.batches import micro_batch_graphs
from autoshard.models import build, reference_config
from autoshard.search import run_search
from autoshard.search.driver import build_plan
from autoshard.search.plans import load_plan


def _model(name: str, hidden: int, batch: int):
    config = reference_config(name, layers=2, hidden=hidden, heads=4, vocab=512, seq=64)
    with torch.device("meta"):
        return build(config), config.example_batch(batch)


def _priced(graphs, copies: int, cluster, tp: int):
    """One copy's graph planned with ``tp`` (ZeRO 0) and priced as ``copies`` copies."""
    og = graphs(copies)
    built = build_plan(og, run_search(og, cluster.num_devices, cluster, tp=tp, zero=0), cluster)
    return built, og, with_copies(built.predicted, built, og, copies)


def test_interleaved_copies_hide_only_what_another_copy_can_cover() -> None:
    # each copy: a collective, then the compute that reads it
    chain = [(COMM, 1.0), (COMPUTE, 1.0)]
    assert interleaved(chain, 1) == 2.0
    # the first copy's collective has nothing beside it; the others hide behind compute
    assert interleaved(chain, 2) == 3.0
    assert interleaved(chain, 4) == 5.0
    # compute, then a collective: the last copy's collective has no compute behind it
    assert interleaved([(COMPUTE, 2.0), (COMM, 1.0)], 2) == 5.0
    # a collective longer than the compute: the stream of collectives sets the pace
    assert interleaved([(COMM, 3.0), (COMPUTE, 1.0)], 2) == 7.0
    # nothing to overlap: compute alone runs copy after copy
    assert interleaved([(COMPUTE, 1.0)], 4) == 4.0
    assert interleaved([], 2) == 0.0


def _overlapping(num_devices: int):
    """The cpu preset's 2 devices with a backend that hides all it overlaps (NCCL's own
    stream; the preset's gloo on 2 shared cores hides about none): what copies can hide is
    the timeline's, not this host's."""
    return dataclasses.replace(cluster_spec("cpu", num_devices), overlap_efficiency=1.0)


@pytest.fixture(scope="module")
def mlp_tp():
    """The MLP at 512 rows under tensor parallelism on a cpu-sized cluster that overlaps: its
    all-reduces are a large share of the communication the step waits for."""
    model, example = _model("mlp", 512, 512)
    return micro_batch_graphs(model, example), _overlapping(2)


def test_one_copy_is_the_estimate_of_today(mlp_tp) -> None:
    graphs, cluster = mlp_tp
    built, og, est = _priced(graphs, 1, cluster, tp=2)
    assert est is built.predicted
    chain = copy_chain(est, og)
    assert interleaved(chain, 1) == pytest.approx(sum(s for _, s in chain))
    inline = est.compute + est.comm_forward + est.comm_backward
    assert sum(s for _, s in chain) == pytest.approx(inline, rel=1e-12)


def test_copies_hide_the_tensor_parallel_communication(mlp_tp) -> None:
    graphs, cluster = mlp_tp
    one = _priced(graphs, 1, cluster, tp=2)[2]
    built, og, two = _priced(graphs, 2, cluster, tp=2)
    assert one.comm_forward + one.comm_backward > 0.02 * one.step_time  # communication-bound
    assert two.exposed_comm < 0.5 * one.exposed_comm
    assert two.exposed_comm < two.exposed_comm_without_copies
    assert two.step_time < one.step_time
    # each op at a copy's rows: the same work twice, at no better efficiency
    assert two.compute >= one.compute * (1 - 1e-9)
    assert two.model_flops == pytest.approx(one.model_flops)
    # parameters once, activations of every copy
    for kind in ("parameters", "gradients", "optimizer"):
        assert two.memory[kind] == one.memory[kind]
    assert two.memory["activations"] == pytest.approx(one.memory["activations"], rel=0.05)
    rows = layer_breakdown(two, og)
    assert sum(r.blocks * r.time_s for r in rows) == pytest.approx(two.step_time, rel=1e-9)
    hidden = [r for r in rows if r.layer == "in-line communication hidden by copies"]
    assert hidden and hidden[0].comm_s == pytest.approx(-two.hidden_by_copies)
    # of what the timeline hides, the backend's overlap share is hidden
    assert cluster.overlap_efficiency == 1.0
    for share in (0.5, 0.0):
        est = estimate(built, og, dataclasses.replace(cluster, overlap_efficiency=share))
        partly = with_copies(est, built, og, 2)
        assert partly.hidden_by_copies == pytest.approx(share * two.hidden_by_copies)
        assert partly.exposed_comm_without_copies == pytest.approx(two.exposed_comm_without_copies)
    assert partly.exposed_comm == pytest.approx(partly.exposed_comm_without_copies)
    assert partly.step_time > two.step_time


def test_the_search_picks_copies_where_communication_is_large() -> None:
    model, example = _model("mlp", 512, 512)
    cluster = _overlapping(2)
    plan = autoshard.plan(model, example, cluster, num_devices=2, tp=2, zero=0, copies="auto")
    pred = plan.json["predicted"]
    assert plan.json["options"]["copies"] == pred["copies"] > 1
    tried = {row["copies"]: row["step_s"] for row in pred["copies_tried"]}
    assert set(tried) == {1, 2, 4}
    assert pred["step_time_s"] == min(tried.values()) < tried[1]
    assert pred["exposed_comm_s"] < pred["exposed_comm_without_copies_s"]


def test_the_search_picks_no_copies_where_a_copy_s_rows_lose_efficiency() -> None:
    # 512 tokens through tp 8 on H100s: half of them per product falls down the efficiency
    # curve by more than the all-reduces copies could hide
    model, example = _model("llama", 2048, 8)
    plan = autoshard.plan(model, example, "dgx-h100", num_devices=8, tp=8, copies="auto")
    pred = plan.json["predicted"]
    assert plan.json["options"]["copies"] == pred["copies"] == 1
    tried = {row["copies"]: row["step_s"] for row in pred["copies_tried"]}
    assert tried[1] < tried[2] and tried[1] < tried[4]
    assert pred["step_time_s"] == tried[1]


def test_copies_given_are_kept_and_round_trip_through_the_plan_json(tmp_path) -> None:
    model, example = _model("mlp", 256, 16)
    plan = autoshard.plan(model, example, "cpu", num_devices=2, tp=2, copies=2)
    assert plan.json["options"]["copies"] == plan.json["predicted"]["copies"] == 2
    assert plan.predicted.copies == 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.json))
    loaded = load_plan(str(path))
    assert loaded["options"]["copies"] == 2 and loaded["predicted"]["copies"] == 2
    assert loaded["predicted"]["step_time_s"] == pytest.approx(plan.predicted.step_time)
    with pytest.raises(ValueError, match="16 rows does not cut into 3 copies"):
        autoshard.plan(model, example, "cpu", num_devices=2, copies=3)
    with pytest.raises(ValueError, match="copies=0"):
        autoshard.plan(model, example, "cpu", num_devices=2, copies=0)
    # one copy: the plan of today, no copies field
    today = autoshard.plan(model, example, "cpu", num_devices=2, tp=2)
    again = autoshard.plan(model, example, "cpu", num_devices=2, tp=2, copies=1)
    assert "copies" not in today.json["predicted"]
    assert again.json["strategies"] == today.json["strategies"]
    assert again.predicted.step_time == today.predicted.step_time


def test_plan_command_with_copies_shows_the_exposed_communication(tmp_path, capsys) -> None:
    out, cluster = tmp_path / "plan.json", tmp_path / "cluster.json"
    cluster.write_text(json.dumps(_overlapping(2).to_json()))
    argv = ["plan", "--model", "mlp", "--hidden", "512", "--batch", "512"]
    argv += ["--cluster", str(cluster)]
    argv += ["--devices", "2", "--tp", "2", "--zero", "0", "--precision", "fp32"]
    assert main([*argv, "--copies", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["options"]["copies"] == 2 and data["predicted"]["copies"] == 2
    pred = data["predicted"]
    line = next(x for x in text.splitlines() if x.startswith("copies 2:"))
    assert f"exposed communication {pred['exposed_comm_s'] * 1e3:.3f} ms" in line
    assert f"{pred['exposed_comm_without_copies_s'] * 1e3:.3f} ms without copies" in line
    assert "in-line communication hidden by copies" in text
    assert main([*argv, "--copies", "3"]) == 3
    assert "does not cut into 3 copies" in capsys.readouterr().err


def test_train_command_passes_copies_to_the_run() -> None:
    from autoshard.cli.args import build_parser
    from autoshard.cli.train import TrainConfig

    commands = ("demo", "redistribute", "plan", "simulate", "train", "calibrate")
    parser = build_parser(dict.fromkeys(commands, lambda args: 0))
    args = parser.parse_args(["train", "usermodel:make", "--copies", "2"])
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    cfg = TrainConfig(**{n: getattr(args, n) for n in names})
    assert cfg.options(per_node=2).copies == 2
    assert TrainConfig(target="m:f").options(per_node=2).copies == 1
    with pytest.raises(ValueError, match="copies=0"):
        dataclasses.replace(cfg, copies=0).options(per_node=2)


def test_a_pipeline_stage_s_copies_hide_its_collectives(mlp_tp) -> None:
    from autoshard.cost.pipeline import model_pieces

    graphs, cluster = mlp_tp
    built, og, two = _priced(graphs, 2, cluster, tp=2)
    serial = dataclasses.replace(two, overlap_efficiency=0.0)  # the same copies, none hidden
    pieces = model_pieces(two, og)
    flat = model_pieces(serial, og)
    count = pieces[2]
    inline = [p.forward + p.backward for p in (pieces[0], pieces[1], pieces[3])]
    alone = [p.forward + p.backward for p in (flat[0], flat[1], flat[3])]
    assert all(a <= b + 1e-12 for a, b in zip(inline, alone, strict=True))
    hidden = sum(w * (b - a) for w, a, b in zip((1, count, 1), inline, alone, strict=True))
    # each pass and piece its own timeline: at most what the whole step's hides
    assert 0 < hidden <= two.hidden_by_copies * (1 + 1e-9)
    # and through the pipeline search: copies inside each micro-batch
    model, example = _model("mlp", 512, 512)
    plan = autoshard.plan(
        model, example, cluster_spec("cpu", 4), num_devices=4, tp=2, pp=2, microbatches=4,
        schedule="1f1b", recompute="none", zero=0, copies=2,
    )  # fmt: skip
    assert plan.json["options"]["copies"] == 2 and plan.predicted.copies == 2
    with pytest.raises(ValueError, match="copies=3 x microbatches=4 does not divide"):
        autoshard.plan(model, example, "cpu", num_devices=4, pp=2, microbatches=4, copies=3)
