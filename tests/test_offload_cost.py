"""Offload planned (docs/parallelism/offload.md "Planning", docs/cost.md "Offload"): the host and
NVMe numbers of a cluster, what each kind of offload moves off the device and what the step waits
for it, the search that offloads only where nothing fits without, and the known answers: Llama-13B
on one 80 GB H100 plans only with the optimizer offloaded, a 1T-parameter GPT on 32 nodes of 8 H100s
fits with its state on NVMe, and nothing is offloaded where all fits."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

import autoshard
from autoshard.cost import PRESETS, ClusterSpec, cluster_spec
from autoshard.cost.breakdown import layer_breakdown
from autoshard.cost.offload import LADDER, Offload, ladder, pipelined, with_offload
from autoshard.cost.pipeline import price_pipeline
from autoshard.graph import capture
from autoshard.models import GPT, GPTConfig, Llama, LlamaConfig, build, reference_config
from autoshard.schedule import make_schedule
from autoshard.search import PlanningError, build_plan, run_search

GIB = 2**30


def _small(layers: int = 4):
    config = reference_config("gpt", vocab=64, seq=8, layers=layers, heads=2, hidden=16)
    return build(config), config.example_batch(4)


def _plan(offload, layers: int = 4, **kw):
    model, batch = _small(layers)
    return autoshard.plan(model, batch, "cpu", num_devices=2, offload=offload, **kw)


def test_presets_give_the_host_and_nvme_numbers_and_old_specs_load_without() -> None:
    h100 = PRESETS["dgx-h100"]
    assert h100.host_memory_bytes == 2000e9 and h100.host_bandwidth == 55e9
    assert h100.nvme_read_bandwidth == 8 * 7e9 and h100.nvme_write_bandwidth == 8 * 3.8e9
    for spec in PRESETS.values():
        assert min(spec.host_memory_bytes, spec.host_bandwidth, spec.host_adam_rate) > 0
        assert min(spec.nvme_bytes, spec.nvme_read_bandwidth, spec.nvme_write_bandwidth) > 0
        assert ClusterSpec.from_json(spec.to_json()).to_json() == spec.to_json()
    old = {k: v for k, v in h100.to_json().items() if not k.startswith(("host", "nvme"))}
    bare = ClusterSpec.from_json(old)
    assert bare.host_memory_bytes == 0 and ladder(bare, None) == []
    with pytest.raises(ValueError, match="gives no host_memory_bytes, host_bandwidth, host_adam"):
        run_search(_captured_small(), 2, bare.with_devices(2), offload={"optimizer": 1.0})


@functools.cache
def _captured_small():
    model, batch = _small()
    return capture(model, batch, {})


def test_optimizer_offload_moves_its_fraction_to_the_host_and_prices_the_step() -> None:
    base = _plan({}, zero=2).predicted
    plans = [_plan({"optimizer": f}, zero=2) for f in (1.0, 0.5)]
    whole, half = (p.predicted for p in plans)
    assert whole.memory["optimizer"] == 0 and whole.host["optimizer"] == base.memory["optimizer"]
    assert half.host["optimizer"] == pytest.approx(base.memory["optimizer"] / 2)
    assert half.memory["optimizer"] == pytest.approx(base.memory["optimizer"] / 2)
    assert whole.host["parameters"] == whole.host["gradients"] > 0  # the masters, their sums
    assert whole.memory["gradients"] == base.memory["gradients"] - whole.host["gradients"]
    assert whole.memory["parameters"] == base.memory["parameters"]  # the device keeps its own
    assert whole.peak_memory < half.peak_memory < base.peak_memory
    for plan in plans:
        est = plan.predicted
        assert est.offload_s == pytest.approx(sum(est.offload_parts.values())) and est.offload_s > 0
        assert est.step_time == pytest.approx(
            est.compute + est.exposed_comm + est.optimizer + est.offload_s
        )
        rows = layer_breakdown(est, plan.graph)
        assert sum(r.blocks * r.time_s for r in rows) == pytest.approx(est.step_time)
        assert sum(r.blocks * r.memory_bytes for r in rows) == pytest.approx(est.peak_memory)
    # the device's update shrinks by the fraction moved; the host's takes it at its own rate
    assert whole.optimizer < half.optimizer < base.optimizer


def test_the_host_update_and_copies_are_priced_from_the_cluster() -> None:
    cpu = cluster_spec("cpu", 2)
    est = _plan({"optimizer": 1.0}).predicted
    elements = est.host["parameters"] / 4
    update = elements / (cpu.host_adam_rate / 2)
    back = est.host["parameters"] / cpu.host_bandwidth
    assert est.offload_parts["host_update"] == pytest.approx(
        pipelined([update, back], 4 * elements)
    )
    # one chunk: the two stages one after another; many: the slower one and a chunk of the other
    assert pipelined([1.0, 2.0], 10) == 3.0
    assert pipelined([1.0, 2.0], 4 * 32 * 2**20) == pytest.approx(2.25)


def test_parameters_activations_embeddings_and_nvme_are_priced_per_tier() -> None:
    zero3 = _plan({}, zero=3).predicted
    shards = _plan({"parameters": True}, zero=3).predicted
    moved = zero3.memory["parameters"] - shards.memory["parameters"]
    assert moved > 0 and shards.host["parameters"] == pytest.approx(moved)
    # the optimizer steps the shards on the host, so their state is the host's too
    stated = zero3.memory["optimizer"] - shards.memory["optimizer"]
    assert stated > 0 and shards.host["optimizer"] == pytest.approx(stated)
    assert shards.offload_parts["parameters_forward"] >= 0
    with pytest.raises(
        ValueError, match=r"offload\['parameters'\]=True with zero=1: .* give zero=3"
    ):
        _plan({"parameters": True}, zero=1)
    base = _plan({}, layers=6).predicted
    acts = _plan({"activations": "layers.*"}, layers=6).predicted
    held = acts.host["activations"]
    assert held > 0 and acts.memory["activations"] == pytest.approx(
        base.memory["activations"] - held
    )
    table = _plan({"embeddings": "wpe"}).predicted
    assert table.host["parameters"] == 8 * 16 * 4 and table.host["optimizer"] == 2 * 8 * 16 * 4
    assert table.offload_parts["embedding_rows"] > 0
    with pytest.raises(ValueError, match="offload embeddings 'layers.*': no embedding lookup"):
        _plan({"embeddings": "layers.*"})
    with pytest.raises(ValueError, match="offload activations 'nothing': matches no module"):
        _plan({"activations": "nothing"})
    # ZeRO fixed: the two searches may otherwise pick different stages for their tiers
    files = _plan({"optimizer": 1.0, "nvme": "/tmp/state"}, zero=1).predicted
    whole = _plan({"optimizer": 1.0}, zero=1).predicted
    assert files.offloaded == Offload(optimizer=1.0, nvme="/tmp/state")
    held = files.nvme["optimizer"] + files.host["optimizer"]
    assert held == pytest.approx(whole.host["optimizer"])


def test_nothing_is_offloaded_where_everything_fits() -> None:
    model, batch = _small()
    searched = autoshard.plan(model, batch, "cpu", num_devices=2)
    plain = build_plan(_captured_small(), run_search(_captured_small(), 2, cluster_spec("cpu", 2)),
                       cluster_spec("cpu", 2))  # fmt: skip
    assert "offload" not in searched.json and searched.json["options"]["offload"] is None
    assert searched.json["predicted"]["step_time_s"] == plain.json["predicted"]["step_time_s"]
    assert searched.json["predicted"]["memory_bytes"] == plain.json["predicted"]["memory_bytes"]
    assert "host_memory_bytes" not in searched.json["predicted"]


@functools.cache
def _llama_13b():
    """Llama-13B (40 layers, two captured), float32, one sequence of 512 tokens."""
    config = LlamaConfig(vocab_size=32000, max_seq=512, num_layers=2, num_heads=40,
                         num_kv_heads=40, hidden=5120, ffn_hidden=13824)  # fmt: skip
    with torch.device("meta"):
        model = Llama(config)
    idx = torch.zeros(1, 512, dtype=torch.long, device="meta")
    return capture(model, (idx, idx.clone()), {})


def test_llama_13b_on_one_h100_plans_only_with_the_optimizer_offloaded() -> None:
    og, h100 = _llama_13b(), cluster_spec("dgx-h100", 1)
    depth = {"layers": 40}
    with pytest.raises(PlanningError, match="no plan fits in 80.00 GiB per device on 1 devices"):
        run_search(og, 1, h100, depth=depth)
    plan = build_plan(og, run_search(og, 1, h100, depth=depth, offload="auto"), h100)
    est = plan.predicted
    assert plan.json["offload"] == {"optimizer": 1.0}
    assert est.peak_memory <= 80 * GIB and est.memory["optimizer"] == 0
    elements = est.host["parameters"] / 4  # every float32 master is the host's
    assert 12.8e9 < elements < 13.1e9
    assert est.host["optimizer"] == 2 * est.host["parameters"] <= h100.host_memory_bytes
    # the host's AdamW at 1e10 elements/s and the gradients' 52 GB at 55 GB/s after backward
    # (one device: no sum, so none leaves before backward ends) are most of the step
    assert est.offload_parts["host_update"] == pytest.approx(elements / 1e10, rel=0.01)
    assert est.offload_parts["gradients_to_host"] == pytest.approx(4 * elements / 55e9, rel=0.01)
    assert 2.0 < est.step_time < 3.0, est.step_time
    assert plan.json["predicted"]["step_time_s"] == est.step_time


@functools.cache
def _gpt_1t():
    """A GPT of about 1T parameters (128 layers of hidden 25600, two captured), float32, 32
    sequences of 2048 tokens."""
    config = GPTConfig(block_size=2048, vocab_size=51200, num_layers=2, num_heads=160,
                       hidden=25600)  # fmt: skip
    with torch.device("meta"):
        model = GPT(config)
    idx = torch.zeros(32, 2048, dtype=torch.long, device="meta")
    return capture(model, (idx, idx.clone()), {})


def test_a_1t_model_on_32_nodes_of_h100_fits_with_nvme() -> None:
    og, spec = _gpt_1t(), cluster_spec("dgx-h100", 256)
    kw = dict(depth={"layers": 128}, tp=8)
    with pytest.raises(PlanningError, match="no plan fits in 80.00 GiB per device on 256"):
        run_search(og, 256, spec, **kw)
    given = {"optimizer": 1.0, "parameters": True, "nvme": "/nvme"}
    plan = build_plan(og, run_search(og, 256, spec, offload=given, **kw), spec)
    est = plan.predicted
    assert plan.zero == 3 and est.peak_memory <= 80 * GIB
    state = 16 * 12 * 25600**2 * 128 / 256  # 16 bytes a parameter, ZeRO 3 over 256
    assert sum(est.nvme.values()) > 0.9 * state
    assert sum(est.host.values()) < state / 2 and math.isfinite(est.step_time)
    # a host of 256 GB a node cannot hold the host's share: the search goes to NVMe itself
    small = dataclasses.replace(spec, host_memory_bytes=256e9)
    auto = build_plan(og, run_search(og, 256, small, offload="auto", **kw), small)
    assert auto.json["offload"]["nvme"] is True and auto.predicted.peak_memory <= 80 * GIB
    assert sum(auto.predicted.host.values()) <= 256e9 / 8
    assert LADDER.index(auto.predicted.offloaded) >= 2  # after both host rungs


def test_a_planned_offload_is_recorded_and_run() -> None:
    model, batch = _small()
    plan = autoshard.plan(model, batch, "cpu", num_devices=1, offload={"optimizer": 1.0})
    assert plan.json["options"]["offload"] == {"optimizer": 1.0}
    pm = autoshard.parallelize(model, batch, None, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(*batch).backward()
    opt.step()
    host, device = pm.state_bytes(opt, tier="host"), pm.state_bytes(opt)
    assert device["optimizer"] == 0
    # beside the predicted state, AdamW's float32 step counts: one a chunk of the flat host
    # masters, at most one a tensor
    tensors = sum(1 for p in pm.parameters() if p.requires_grad)
    assert host["optimizer"] - plan.predicted.host["optimizer"] in range(4, 4 * tensors + 1, 4)
    shards = autoshard.plan(model, batch, "cpu", num_devices=1, zero=3,
                            offload={"optimizer": 1.0, "parameters": True})  # fmt: skip
    # one device: ZeRO 3 shards nothing, so the run names what the host would hold
    with pytest.raises(ValueError, match="no parameter of this plan is under ZeRO 3"):
        autoshard.parallelize(model, batch, None, plan=shards)
    with pytest.raises(ValueError, match="not yet planned with copies"):
        autoshard.plan(model, batch, "cpu", num_devices=2, copies=2, offload={"optimizer": 1.0})
    with pytest.raises(ValueError, match="host embedding tables .* not yet planned with pipeline"):
        autoshard.plan(model, batch, "cpu", num_devices=2, pp=2, offload={"embeddings": "wte"})


def test_each_pipeline_stage_holds_its_share_of_the_offload_on_the_timeline() -> None:
    """A stage plan's offload over 2 stages of 1F1B: the device, host and NVMe tiers of each
    rank, the host's update after each stage's last backward, activations per micro-batch."""
    og, spec = _captured_small(), cluster_spec("dgx-h100", 2)
    plan = build_plan(og, run_search(og, 2, spec, zero=0), spec)
    bare = plan.predicted
    schedule = make_schedule("1f1b", 2, 4)
    plain = price_pipeline(bare, og, schedule, spec)
    assert price_pipeline(with_offload(bare, plan, og, spec, {}), og, schedule, spec) == plain
    est = with_offload(bare, plan, og, spec, {"optimizer": 1.0, "activations": "layers.*"})
    piped = price_pipeline(est, og, schedule, spec)
    for r in range(2):
        device, host = piped.memory[r], piped.host_by_rank[r]
        assert device["optimizer"] == 0 and device["parameters"] == plain.memory[r]["parameters"]
        assert host["optimizer"] == 2 * host["parameters"] > 0  # the masters and their AdamW
        assert host["activations"] > 0  # rank 0 holds 2 micro-batches' at once, rank 1 one
        held = device["activations"] + host["activations"]
        assert held == pytest.approx(plain.memory[r]["activations"])
    for kind in ("parameters", "optimizer"):  # the stages' shares make the whole
        assert sum(h[kind] for h in piped.host_by_rank) == pytest.approx(est.host[kind])
    assert piped.peak_memory < plain.peak_memory and piped.nvme["optimizer"] == 0
    # each micro-batch's activations go out in its forward and back before its backward
    sent = [a[0] - b[0] for a, b in zip(piped.stage_seconds, plain.stage_seconds, strict=True)]
    assert min(sent) >= 0 and sum(sent) == pytest.approx(est.offload_parts["activations_to_host"])
    # the host's update follows a stage's last backward: at most the whole model's update
    once = est.offload_parts["host_update"] + est.offload_parts["gradients_to_host"]
    assert 0 < piped.offload_s <= once + 4 * sum(sent) + 4 * est.offload_parts["activations_back"]
    assert piped.step_time - piped.offload_s <= plain.step_time  # the device's update is less
    as_json = piped.as_json()
    assert as_json["host_memory_bytes"] == [dict(h) for h in piped.host_by_rank]
    assert as_json["offload_s"] == piped.offload_s


@functools.cache
def _staged_plan(offload: str | None, memory_limit: float | None = None, pp: int | None = 2):
    """The small GPT (batch 8) on 4 devices of dgx-h100: 2 stages of 1F1B with 4 micro-batches
    and no recompute at ZeRO 0 (``pp`` None: without stages), ``offload`` a kind (None:
    searched, "" nothing)."""
    config = reference_config("gpt", vocab=64, seq=8, layers=4, heads=2, hidden=16)
    model, batch = build(config), config.example_batch(8)
    staged = dict(pp=2, microbatches=4, schedule="1f1b", recompute="none") if pp else {}
    given = None if offload is None else {offload: 1.0} if offload else {}
    kw = dict(zero=0, memory_limit=memory_limit, offload=given, **staged)
    return autoshard.plan(model, batch, "dgx-h100", num_devices=4, **kw)


def test_a_model_that_fits_only_in_stages_with_the_optimizer_offloaded() -> None:
    """At 80 kB a device, the small GPT (ZeRO 0) fits neither without stages (offloaded or
    not: the whole model's weights on every device) nor in 2 stages without offload (163 kB);
    the pipeline search offloads the optimizer (71 kB), as the one-program search would."""
    limit = 80e3
    with pytest.raises(PlanningError, match="nor with offload"):
        _staged_plan(None, limit, pp=None)
    with pytest.raises(PlanningError, match="no pipeline configuration fits"):
        _staged_plan("", limit)
    plan = _staged_plan(None, limit)
    data, given = plan.json, _staged_plan("optimizer", limit).json
    assert data["offload"] == data["options"]["offload"] == {"optimizer": 1.0}
    pred, pipe = data["predicted"], data["pipeline"]
    assert pred["peak_memory_bytes"] <= limit and pred["memory_bytes"]["optimizer"] == 0
    assert pred == {k: v for k, v in given["predicted"].items() if k != "search_s"} | {
        "search_s": pred["search_s"]
    }
    host = pred["host_memory_bytes"]
    assert host["total"] == max(sum(h.values()) for h in pipe["host_memory_bytes"]) > 0
    assert pred["offload_s"] == pipe["offload_s"] > 0
    assert pipe["after_schedule_s"] >= sum(pipe["offload_parts_s"].values())


def test_nothing_is_offloaded_in_stages_where_everything_fits() -> None:
    searched, nothing = _staged_plan(None).json, _staged_plan("").json
    assert "offload" not in searched and searched["options"]["offload"] is None
    assert "host_memory_bytes" not in searched["predicted"]
    assert "host_memory_bytes" not in searched["pipeline"]
    for key in ("step_time_s", "peak_memory_bytes", "memory_bytes"):
        assert searched["predicted"][key] == nothing["predicted"][key]
