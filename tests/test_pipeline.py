"""Pipeline parallelism equals plain PyTorch: the GPT and Llama reference models cut into
stages on a ``pp`` axis, run by each schedule the runtime has, alone and with data and tensor
parallel inside the stages, trained 5 AdamW steps in float64 beside the eager model stepped by
``torch.optim``; every step's loss and every parameter compared. The user's loop is the one
device's: ``loss = pm(*batch); loss.backward(); opt.step()``. The ranks keep NCCL's
point-to-point order (``comm.strict_p2p``): an order GPUs would hang on stops the run, named
by the watchdog."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import torch
from test_runtime import megatron

import autoshard
from autoshard import comm, parallelize, shard_inputs, single_device, watch
from autoshard.graph import StageError, capture_modes, cut_at_modules, cut_balanced
from autoshard.mesh import mesh_info
from autoshard.models import build, reference_config
from autoshard.redistribution import shard_tensor
from autoshard.runtime.pipeline.module import microbatch_example, pipeline_groups
from autoshard.runtime.program import CountedLoss
from autoshard.schedule import ScheduleError
from autoshard.testing import LiveBytes, run_ranks

STEPS, BATCH, SEQ, VOCAB = 5, 8, 8, 64


def _model(name: str, layers: int = 4) -> torch.nn.Module:
    if name == "hf-llama":  # transformers' Llama, built from a config, its own loss
        import transformers
        from test_hf_gpt2 import CausalLMLoss

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            attn_implementation="sdpa",
        )  # fmt: skip
        return CausalLMLoss(transformers.LlamaForCausalLM(config)).to(torch.float64)
    torch.manual_seed(0)
    cfg = reference_config(name, layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64,
                           vocab=VOCAB, seq=SEQ)  # fmt: skip
    return build(cfg).to(torch.float64)


def _batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )  # fmt: skip
        for _ in range(STEPS)
    ]


def _labels() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and labels (the ids, a quarter of them ignored) for transformers' models."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out.append((ids, ids.masked_fill(torch.rand(BATCH, SEQ, generator=gen) < 0.25, -100)))
    return out


def _uneven_ignores() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose first half ignores many more targets than the second (padding)."""
    out = []
    for ids, targets in _batches(seed=3):
        targets = targets.clone()
        targets[: BATCH // 2, 2:] = -100
        targets[BATCH // 2 :, -1:] = -100
        out.append((ids, targets))
    return out


def _against_pytorch(
    name: str,
    mesh: dict,
    strategies: Any = None,
    clip: float | None = None,
    batches: list | None = None,
    atol: float = 1e-8,
    layers: int = 4,
    **pipeline: Any,
) -> str:
    """Train under the pipeline and eagerly (gradients clipped to ``clip`` both ways); ''
    when every loss and parameter agree (``allclose``'s tolerances; ``atol`` for a model whose
    loss is float32 whatever its parameters, as transformers' upcast logits are)."""
    model = _model(name, layers)
    ref = copy.deepcopy(model)
    batches = batches or _batches()
    captured = _capture_of(name, layers, model, batches[0], mesh, pipeline)
    pm = parallelize(model, batches[0], mesh, strategies, captured=captured, **pipeline)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, batch in enumerate(batches):
        loss = pm(*batch)
        loss.backward()
        want = ref(*batch)
        want.backward()
        if clip is not None:
            norm = autoshard.clip_grad_norm_(pm, clip)
            norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            if not torch.allclose(norm, norm_ref):
                return f"{name} {mesh} {pipeline}: step {step} norm {norm} != {norm_ref}"
        opt.step()
        opt.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad()
        if not torch.allclose(loss.detach(), want.detach(), atol=atol):
            return f"{name} {mesh} {pipeline}: step {step} loss {float(loss)} != {float(want)}"
    full, want = pm.full_state_dict(), ref.state_dict()
    if set(full) != set(want):
        return f"{name} {mesh} {pipeline}: state dict keys {sorted(set(full) ^ set(want))}"
    for key, value in want.items():
        if not torch.allclose(full[key], value, atol=atol):
            return f"{name} {mesh} {pipeline}: {key} differs"
    return ""


_CAPTURED: dict[tuple, Any] = {}


def _capture_of(name: str, layers: int, model: Any, batch: tuple, mesh: Any, given: dict) -> Any:
    """The model's capture (of one micro-batch under a ``pp`` axis), made once per rank
    process for every case of the same model and micro-batch size: the same graph whatever
    the mesh, schedule or recompute (a plan given: of its micro-batch, the same graph; a plan
    of copies or of a compute dtype of its own is captured anew by ``parallelize``)."""
    plan = given.get("plan")
    if plan is not None:
        options = plan.get("options", {})
        if options.get("copies", 1) != 1 or (options.get("precision") or {}).get("compute"):
            return None
        staged = "pipeline" in plan
        m = plan["pipeline"]["microbatches"] if staged else 1
    else:
        staged = mesh is not None and "pp" in mesh
        m = (given.get("microbatches") or mesh["pp"]) if staged else 1
    key = (name, layers, m)
    if key not in _CAPTURED:
        example = microbatch_example(batch, None, m)[0] if staged else batch
        _CAPTURED[key] = capture_modes(model, example)
    return _CAPTURED[key]


def _scaled_and_accumulated() -> str:
    """``(loss * 0.5).backward()`` halves the gradients, and two calls before a step add
    theirs, as on one device."""
    model = _model("gpt")
    ref = copy.deepcopy(model)
    a, b = _batches()[:2]
    captured = _capture_of("gpt", 4, model, a, {"pp": 2}, {"microbatches": 2})
    pm = parallelize(model, a, {"pp": 2}, microbatches=2, captured=captured)
    (pm(*a) * 0.5).backward()
    pm(*b).backward()
    (ref(*a) * 0.5).backward()
    ref(*b).backward()
    params = dict(ref.named_parameters())
    for fqn, t in pm.local_tensors().items():
        if fqn in params and t.grad is not None:
            expected = shard_tensor(params[fqn].grad, pm.layout_of(fqn), pm.rank)
            if not torch.allclose(t.grad, expected):
                return f"gradient of {fqn} differs"
    pm.eval()
    ref.eval()
    with torch.no_grad():
        if not torch.allclose(pm(*a), ref(*a)):
            return "eval loss differs"
    return ""


def _saved_under_pp_loads_under_dp(path: str) -> str:
    """A checkpoint of 2 steps under pp 2 loads under dp 2 (into other values) and the next
    3 steps equal plain PyTorch's steps 3 to 5."""
    model = _model("gpt")
    ref = copy.deepcopy(model)
    batches = _batches()
    captured = _capture_of("gpt", 4, model, batches[0], {"pp": 2}, {"microbatches": 2})
    pm = parallelize(model, batches[0], {"pp": 2}, microbatches=2, captured=captured)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for batch in batches:
        loss = ref(*batch)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        want.append(float(loss))
    for batch in batches[:2]:
        pm(*batch).backward()
        opt.step()
        opt.zero_grad()
    autoshard.save(path, pm, opt, step=2)
    torch.manual_seed(7)  # other values, all replaced by the checkpoint's
    other = build(reference_config("gpt", layers=4, hidden=32, heads=4, vocab=VOCAB, seq=SEQ))
    dp = parallelize(other.to(torch.float64), batches[0], {"dp": 2})
    opt_dp = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    autoshard.load(path, dp, opt_dp)
    for step, batch in enumerate(batches[2:], start=2):
        loss = dp(*shard_inputs(batch, dp))
        loss.backward()
        opt_dp.step()
        opt_dp.zero_grad()
        if abs(float(loss) - want[step]) > 1e-9:
            return f"after loading, step {step} loss {float(loss)} != {want[step]}"
    full = dp.full_state_dict()
    for key, value in ref.state_dict().items():
        if not torch.allclose(full[key], value):
            return f"after loading, {key} differs"
    return ""


def _dropout_masks_are_one_devices() -> str:
    """With dropout on, the pipeline draws the masks autoshard's one-device program draws for
    the same rows of the whole batch (recomputed forwards too): losses and parameters equal
    ``single_device``'s over 3 steps."""
    torch.manual_seed(0)
    cfg = reference_config("gpt", layers=4, hidden=32, heads=4, vocab=VOCAB, seq=SEQ, dropout=0.2)
    model = build(cfg).to(torch.float64)
    one = single_device(copy.deepcopy(model), _batches()[0])
    batches = _batches()[:3]
    pm = parallelize(model, batches[0], {"pp": 2}, microbatches=2, recompute="full")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, one)]
    for step, batch in enumerate(batches):
        losses = []
        for m, opt in zip((pm, one), opts, strict=True):
            loss = m(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        if abs(losses[0] - losses[1]) > 1e-9:
            return f"dropout: step {step} loss {losses[0]} != one device's {losses[1]}"
    full, want = pm.full_state_dict(), one.full_state_dict()
    bad = [k for k in want if not torch.allclose(full[k], want[k])]
    return f"dropout: {bad[:3]} differ" if bad else ""


def _first_stage_holds() -> str:
    """Bytes autograd keeps on the first stage (recorded with saved-tensor hooks): GPipe holds
    all m micro-batches, 1F1B p of them, and recompute less."""
    batch = _batches()[0]
    peak = {}
    for name, options in (("gpipe", {}), ("1f1b", {}), ("1f1b", {"recompute": "full"})):
        model, given = _model("llama"), {"microbatches": 4}
        captured = _capture_of("llama", 4, model, batch, {"pp": 2}, given)
        pm = parallelize(model, batch, {"pp": 2}, schedule=name, captured=captured,
                         **given, **options)  # fmt: skip
        pm.counting_saved = True
        pm(*batch).backward()
        peak[(name, bool(options))] = pm.saved_bytes.peak.get(0, 0)
    if torch.distributed.get_rank() != 0:
        return ""
    gpipe, one, full = peak[("gpipe", False)], peak[("1f1b", False)], peak[("1f1b", True)]
    if gpipe != 2 * one:  # m / p micro-batches
        return f"first stage keeps {gpipe} bytes under GPipe, {one} under 1F1B: not 4 to 2"
    if not 0 < full < one / 2:
        return f"full recompute keeps {full} bytes of 1F1B's {one}"
    return ""


def _flops_are_the_whole_batchs() -> str:
    """A step's model FLOPs (MFU's numerator) are the global batch's, whatever the number of
    micro-batches it is cut into."""
    batch = _batches()[0]

    def flops(mesh: dict, **given: Any) -> float:
        model = _model("llama")
        captured = _capture_of("llama", 4, model, batch, mesh, given)
        return parallelize(model, batch, mesh, captured=captured, **given).flops_per_step

    whole = flops({"dp": 2})
    for m in (2, 4):
        cut = flops({"pp": 2}, microbatches=m)
        if not math.isclose(cut, whole, rel_tol=1e-9):
            return f"{m} micro-batches: {cut} FLOPs a step, {whole} without stages"
    return ""


def _nccl_order(cases: Any, *args: Any) -> list[str]:
    """``cases(*args)`` with point-to-point groups in NCCL's order (a send waits for its
    receiver; ``comm.strict_p2p``) and every wait bounded by the watchdog, so an order that
    would hang on GPUs stops the ranks with a message naming the wait."""
    torch.set_num_threads(1)
    watch.start(180.0)
    with comm.strict_p2p():
        return cases(*args)


def _cases_world2(path: str) -> list[str]:
    out = [
        _against_pytorch("gpt", {"pp": 2}, schedule="1f1b", microbatches=4, clip=0.05),
        _against_pytorch("llama", {"pp": 2}, schedule="gpipe", microbatches=2),
        _against_pytorch(
            "gpt", {"pp": 2}, schedule="interleaved-1f1b", microbatches=2, virtual_stages=2
        ),  # fmt: skip
        _against_pytorch(
            "llama", {"pp": 2}, schedule="1f1b", microbatches=4, stages=["layers.1"]
        ),  # fmt: skip
        _against_pytorch("gpt", {"pp": 2}, schedule="1f1b", microbatches=2, recompute="full"),
        _against_pytorch(
            "llama",
            {"pp": 2},
            schedule="interleaved-1f1b",
            microbatches=2,
            virtual_stages=2,
            recompute="selective",
        ),  # fmt: skip
        _against_pytorch("llama", {"dp": 2}, recompute={"layers.[02]": "full"}),
        _against_pytorch("llama", {"pp": 2}, schedule="zb-h1", microbatches=4),
        _against_pytorch("gpt", {"pp": 2}, microbatches=2, batches=_uneven_ignores()),
        _against_pytorch("hf-llama", {"pp": 2}, microbatches=4, batches=_labels(), atol=1e-6),
        _planned("hf-llama", 2, _labels(), pp=2),
        _against_pytorch("gpt", {"pp": 2}, schedule="zbv", microbatches=2),
        _scaled_and_accumulated(),
        _saved_under_pp_loads_under_dp(path),
        _dropout_masks_are_one_devices(),
        _first_stage_holds(),
        _flops_are_the_whole_batchs(),
    ]
    return [o for o in out if o]


def _planned(name: str, world: int, batches: list | None = None, **given: Any) -> str:
    """``autoshard.plan`` with pipeline stages (``given`` fixed, the rest searched for the
    cpu preset), run from its JSON by ``parallelize(plan=...)``, against plain PyTorch."""
    batches = batches or _batches()
    plan = autoshard.plan(_model(name), batches[0], "cpu", num_devices=world, **given)
    pipe = plan.json["pipeline"]
    if pipe["pp"] * math.prod(plan.json["mesh"].values()) != world or not pipe["tried"]:
        return f"{name} {given}: a plan of {pipe['pp']} x {plan.json['mesh']}"
    atol = 1e-6 if name == "hf-llama" else 1e-8  # transformers' upcast logits: float32 loss
    plan_json = json.loads(json.dumps(plan.json))
    return _against_pytorch(name, None, batches=batches, atol=atol, plan=plan_json)


def _cases_world4() -> list[str]:
    out = [
        _planned("gpt", 4, pp=2),
        _against_pytorch("llama", {"dp": 2, "pp": 2}, search="optimal", microbatches=2),
        _against_pytorch("llama", {"dp": 2, "pp": 2}, schedule="1f1b", microbatches=4, zero=3),
        _against_pytorch("gpt", {"pp": 2, "tp": 2}, megatron("gpt"), microbatches=2),
        _against_pytorch("gpt", {"pp": 4}, schedule="1f1b", microbatches=4),
        _against_pytorch("llama", {"pp": 4}, schedule="gpipe", microbatches=4),
        _against_pytorch("llama", {"pp": 4}, schedule="zb-h1", microbatches=4, recompute="full"),
        # 8 stages on 4 ranks: looped (rank r holds r and r + 4) and a V (r and 7 - r)
        _against_pytorch(
            "gpt",
            {"pp": 4},
            schedule="interleaved-1f1b",
            virtual_stages=2,
            microbatches=4,
            layers=8,
        ),  # fmt: skip
        _against_pytorch("llama", {"pp": 4}, schedule="zbv", microbatches=4, layers=8),
        _against_pytorch(
            "gpt", {"pp": 2, "tp": 2}, megatron("gpt"), schedule="zbv", microbatches=2
        ),  # fmt: skip
        _against_pytorch(
            "llama", {"pp": 2, "tp": 2}, megatron("llama"), schedule="zb-h1", microbatches=2
        ),  # fmt: skip
        _against_pytorch(
            "gpt",
            {"pp": 2, "tp": 2},
            megatron("gpt"),
            schedule="gpipe",
            microbatches=2,
            recompute="full",
        ),  # fmt: skip
        _against_pytorch(
            "llama",
            {"pp": 2, "tp": 2},
            megatron("llama"),
            schedule="interleaved-1f1b",
            virtual_stages=2,
            microbatches=2,
            recompute="selective",
        ),  # fmt: skip
        _against_pytorch("gpt", {"dp": 2, "pp": 2}, schedule="zbv", microbatches=2, zero=2),
        _against_pytorch(
            "llama", {"dp": 2, "pp": 2}, schedule="zb-h1", microbatches=4, zero=1, clip=0.05
        ),
        _against_pytorch("llama", {"dp": 2, "pp": 2}, zero=1, microbatches=2, recompute="full"),
        _against_pytorch("gpt", {"dp": 2, "pp": 2}, zero=2, microbatches=2, clip=0.05),
    ]
    return [o for o in out if o]


def test_pipelines_of_two_ranks_train_as_pytorch(tmp_path) -> None:
    for problems in run_ranks(_nccl_order, 2, _cases_world2, str(tmp_path / "ckpt"), timeout=600):
        assert problems == []


def test_pipelines_with_data_and_tensor_parallel_train_as_pytorch() -> None:
    for problems in run_ranks(_nccl_order, 4, _cases_world4, timeout=600):
        assert problems == []


def _cases_world8() -> list[str]:
    mesh = {"dp": 2, "pp": 2, "tp": 2}
    out = [
        _against_pytorch(
            "gpt", mesh, megatron("gpt"), zero=1, schedule=name, microbatches=2, **options
        )
        for name, options in (
            ("1f1b", {"recompute": "full"}),
            ("gpipe", {}),
            ("zbv", {"recompute": "full"}),
        )
    ] + [
        _against_pytorch(
            "llama", mesh, megatron("llama"), zero=1, schedule=name, microbatches=2, **options
        )
        for name, options in (
            ("zb-h1", {}),
            ("interleaved-1f1b", {"virtual_stages": 2, "recompute": "selective"}),
        )
    ]
    return [o for o in out if o]


def test_data_pipeline_and_tensor_parallel_on_8_ranks_train_as_pytorch() -> None:
    """3D: dp 2 x pp 2 x tp 2 (Megatron's strategies inside each stage) under ZeRO 1, every
    schedule, with recompute (full, selective) and without: losses and every tensor as plain
    PyTorch's."""
    for problems in run_ranks(_nccl_order, 8, _cases_world8, timeout=900):
        assert problems == []


# -- stage cuts, without ranks ----------------------------------------------------------------


def _captured(name: str) -> Any:
    model = _model(name)
    return capture_modes(model, _batches()[0])[True]


def test_balanced_cuts_fall_between_blocks_and_tied_weights_live_on_both_ends() -> None:
    og = _captured("gpt")
    cut = cut_balanced(og, 2)
    first, last = cut.params
    assert "wpe.weight" in first and "ln_f.weight" in last
    assert cut.holders("lm_head.weight") == [0, 1]  # tied to wte: the embedding and the head
    assert {f for f in first if f.startswith("layers.")} == {
        f for f in first if f.startswith(("layers.0.", "layers.1."))
    }
    assert len(cut.receives[1]) == 1  # only the residual stream crosses
    assert cut_balanced(og, 4).num_stages == 4


def test_cut_by_hand_and_its_errors() -> None:
    og = _captured("llama")
    cut = cut_at_modules(og, ["layers.1", "layers.3"])
    assert cut.num_stages == 3
    assert any(f.startswith("layers.3.") for f in cut.params[2])
    # only the residual stream crosses; the rotary tables (slices of buffers, made before
    # the blocks) are made again on every stage that reads them, which holds the buffers
    assert [len(r) for r in cut.receives] == [0, 1, 1]
    for s in (1, 2):
        assert cut.again[s] and all(cut.stage_of[n] == 0 for n in cut.again[s])
        assert {"rope_cos", "rope_sin"} <= cut.params[s]
        assert all(cut.runs(n, s) for n in cut.again[s])
    assert not cut.again[0]
    with pytest.raises(StageError, match="no op of the model runs in module 'layers.9'"):
        cut_at_modules(og, ["layers.9"])
    with pytest.raises(StageError, match="in the order the model runs them"):
        cut_at_modules(og, ["layers.3", "layers.1"])
    with pytest.raises(StageError, match="runs of repeated blocks"):
        cut_balanced(og, 6)


def test_pipeline_groups_are_the_ranks_of_each_pp_coordinate() -> None:
    assert pipeline_groups(mesh_info({"dp": 2, "pp": 2, "tp": 2})) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert pipeline_groups(mesh_info({"pp": 4})) == ((0,), (1,), (2,), (3,))


def test_bad_pipeline_arguments_are_clear_errors() -> None:
    model = _model("gpt")
    batch = _batches()[0]
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        parallelize(model, batch, {"pp": 1}, microbatches=3)
    with pytest.raises(ValueError, match="schedule='pipedream': expected one of gpipe"):
        parallelize(model, batch, {"pp": 1}, schedule="pipedream")
    with pytest.raises(ValueError, match="schedule='zb-h1' with zero=3: a split backward"):
        parallelize(model, batch, {"pp": 1}, schedule="zb-h1", zero=3)
    plain = autoshard.plan(model, batch, "cpu", num_devices=1)
    with pytest.raises(ValueError, match="the plan given has no pipeline stages"):
        parallelize(model, batch, None, plan=plain.json, schedule="1f1b")
    staged = autoshard.plan(model, batch, "cpu", num_devices=2, pp=2, microbatches=2)
    with pytest.raises(ValueError, match="microbatches=4, but the plan given has microbatches 2"):
        parallelize(model, batch, None, plan=staged.json, microbatches=4)
    with pytest.raises(ScheduleError, match="interleaved"):  # 3 is no multiple of 2 ranks
        six = tuple(t[:6] for t in batch)
        autoshard.plan(model, six, "cpu", num_devices=2, pp=2, microbatches=3,
                       schedule="interleaved-1f1b")  # fmt: skip


# -- recompute, on one process ------------------------------------------------------------------


def _held_after_forward(pm: Any, batch: tuple) -> tuple[int, dict[str, torch.Tensor]]:
    """The bytes a step's forward leaves alive for backward (every storage made in it), and
    the step's gradients."""
    with LiveBytes() as live:
        loss = pm(*batch)
        held = live.live
    loss.backward()
    grads = {k: t.grad.clone() for k, t in pm.local_tensors().items() if t.grad is not None}
    return held, grads


def test_recompute_keeps_less_for_backward_and_changes_no_gradient() -> None:
    batch = _batches()[0]
    saved, grads = {}, {}
    for mode in ("none", "selective", "full"):
        pm = parallelize(_model("llama"), batch, 1, recompute=mode)
        saved[mode], grads[mode] = _held_after_forward(pm, batch)
    assert saved["full"] < saved["selective"] < saved["none"]
    for mode in ("selective", "full"):
        for k, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][k], g)
    with pytest.raises(ValueError, match="recompute='some': expected one of none, full"):
        parallelize(_model("gpt"), batch, 1, recompute="some")


def test_a_counted_loss_weighs_each_micro_batch_by_its_targets() -> None:
    og = _captured("gpt")
    counted = CountedLoss.of(og)
    assert counted is not None and counted.ignore_index == -100
    ids, targets = _uneven_ignores()[0]
    halves = [[ids[:4], targets[:4]], [ids[4:], targets[4:]]]
    assert counted.weights(halves) == pytest.approx([8 / 36, 28 / 36])

    class Smoothed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.head(x), y, label_smoothing=0.1)

    smoothed = capture_modes(Smoothed(), (torch.randn(4, 4), torch.tensor([0, 1, 2, 0])))[True]
    assert CountedLoss.of(smoothed) is None  # not a mean over counted targets: plain mean
