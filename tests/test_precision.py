"""Mixed precision (docs/precision.md): a parallel run under a policy against one device under
the same policy (``single_device(precision=...)``) and against plain PyTorch (the eager model
computing in bfloat16 from its float32 parameters, stepped by ``torch.optim``), and loss
scaling for float16.

Tolerances: bfloat16 keeps 8 bits of mantissa (a relative rounding of 2**-9 per op), and a
parallel run adds its numbers in another order than one device, so gradients are compared by
their relative norm error, under 3% for every parameter at every step (a sum missing a rank's
part is off by tens of percent), and losses within 2%. Against plain PyTorch the optimizer is
SGD, whose update is a fixed combination of the gradients, so every parameter's update over the
run is held to the gradients' 3% (AdamW divides by the root of its second moment, which turns
rounding noise on gradients near 0 into whole steps: the update of GPT's fused qkv bias, whose
key part has no gradient but rounding, differs by half its norm under AdamW).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from test_runtime import batches, build, megatron

from autoshard import GradScaler, Precision, gather_tensor, parallelize, shard_inputs, single_device
from autoshard.cost import cluster_spec, estimate
from autoshard.precision import PrecisionError, precision_policy
from autoshard.testing import run_ranks

GRAD_TOLERANCE = 0.03
LOSS_RTOL = 0.02


def _full_grads(pm: Any) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, t in pm.local_tensors().items():
        if t.grad is None:
            continue
        layout = pm.layout_of(fqn)
        out[fqn] = gather_tensor(t.grad, layout) if layout.num_devices > 1 else t.grad
    return out


def _train_in_precision(name: str, mesh: Any, strategies: Any, precision: Any) -> dict:
    """5 AdamW steps of ``name`` under ``precision`` on ``mesh`` and on one device; returns
    the worst relative gradient error, the losses, the dtypes seen and the bytes summed."""
    from autoshard import comm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build(name, 0.0)
    data = batches(config, torch.float32)
    ref = single_device(copy.deepcopy(model), data[0], precision=precision)
    pm = parallelize(model, data[0], mesh, strategies, precision=precision)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    worst, losses, sent = 0.0, [], []
    for batch in data:
        loss_ref = ref(*batch)
        loss_ref.backward()
        loss = pm(*shard_inputs(batch, pm))
        with comm.counting() as counted:
            loss.backward()
        sent.append(counted.get("all_reduce", {}).get("bytes", 0))
        grads, grads_ref = _full_grads(pm), _full_grads(ref)
        assert grads.keys() == grads_ref.keys()
        for k, g_ref in grads_ref.items():
            error = float((grads[k] - g_ref).norm() / g_ref.norm().clamp_min(1e-12))
            worst = max(worst, error)
        losses.append((float(loss), float(loss_ref)))
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    # the bytes the cost model's buckets sum (bandwidth term of each, on 2 ranks its input)
    cluster = cluster_spec("cpu", pm.plan.mesh.num_devices)
    bandwidth, latency = cluster.link(False)
    steps = 2 * math.ceil(math.log2(max(2, pm.plan.mesh.num_devices)))
    predicted = estimate(pm.plan, pm._captured[True], cluster).overlapped
    return {
        "worst": worst,
        "losses": losses,
        "loss_dtype": str(loss.dtype),
        "master": sorted({str(p.dtype) for p in pm.parameters()}),
        "sent": sent,
        "numel": sum(p.numel() for p in pm.parameters()),
        "priced": sum(round((o.seconds - steps * latency) * bandwidth) for o in predicted),
    }


def _eager_in_precision(model: torch.nn.Module, batch: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The eager model's loss computed in ``dtype``: its parameters, floating buffers and inputs
    cast where read, so autograd casts the gradients back into the float32 ``.grad``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    tensors = {n: cast(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return torch.func.functional_call(model, tensors, tuple(cast(t) for t in batch))


def _train_as_pytorch(name: str, mesh: Any, strategies: Any, precision: Any) -> dict:
    """5 SGD steps (momentum 0.9) of ``name`` under ``precision`` on ``mesh`` and as plain
    PyTorch in its compute dtype; returns the worst relative error of a parameter's update
    over the run (the full state dict's), the losses and the dtypes seen."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build(name, 0.0)
    data = batches(config, torch.float32)
    eager = copy.deepcopy(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    pm = parallelize(model, data[0], mesh, strategies, precision=precision)
    compute = precision_policy(precision).compute
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, pm)]
    losses = []
    for batch in data:
        loss_eager = _eager_in_precision(eager, batch, compute)
        loss_eager.backward()
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        losses.append((float(loss), float(loss_eager)))
        for opt in opts:
            opt.step(), opt.zero_grad()
    full, full_eager = pm.full_state_dict(), eager.state_dict()
    assert full.keys() == full_eager.keys()
    worst = 0.0
    for k, v in full_eager.items():
        moved = v - start[k]
        error = float(((full[k] - start[k]) - moved).norm() / moved.norm().clamp_min(1e-12))
        worst = max(worst, error)
    return {
        "worst": worst,
        "losses": losses,
        "loss_dtype": str(loss.dtype),
        "master": sorted({str(p.dtype) for p in pm.parameters()}),
        "least_moved": min(float((v - start[k]).norm()) for k, v in full_eager.items()),
    }


def _cases(cases: list[tuple], against_pytorch: tuple = ()) -> list[dict]:
    return [_train_in_precision(*case) for case in cases] + [
        _train_as_pytorch(*case) for case in against_pytorch
    ]


def _check(outcome: dict, compute: str) -> None:
    assert outcome["worst"] < GRAD_TOLERANCE, outcome["worst"]
    for loss, loss_ref in outcome["losses"]:
        assert loss == pytest.approx(loss_ref, rel=LOSS_RTOL)
    assert outcome["loss_dtype"] == f"torch.{compute}"
    assert outcome["master"] == ["torch.float32"]  # what the optimizer steps


def test_bf16_data_parallel_equals_one_device_under_the_same_policy() -> None:
    """... and GPT (tied embeddings) equals plain PyTorch computing in bfloat16."""
    cases = [
        ("gpt", {"dp": 2}, None, "bf16"),
        ("llama", {"dp": 2}, None, "bf16"),
        ("llama", {"dp": 2}, None, Precision(torch.bfloat16, reduce=torch.bfloat16)),
    ]
    as_pytorch = [("gpt", {"dp": 2}, None, "bf16")]
    gpt, llama, llama_bf16_sums, gpt_as_pytorch = run_ranks(
        _cases, 2, cases, as_pytorch, timeout=300
    )[0]
    for outcome in (gpt, llama, llama_bf16_sums, gpt_as_pytorch):
        _check(outcome, "bfloat16")
    assert gpt_as_pytorch["least_moved"] > 0  # no parameter stood still: each error counts
    # the gradient sums travel in float32 (the master weights' dtype) unless told bfloat16;
    # on 2 ranks an all-reduce sends its input's bytes
    grad_bytes = llama["numel"] * 4
    assert all(grad_bytes <= s < grad_bytes + 64 for s in llama["sent"]), llama["sent"]
    assert all(grad_bytes // 2 <= s < grad_bytes // 2 + 64 for s in llama_bf16_sums["sent"])
    # and the cost model prices the buckets in the dtype they travel in
    assert llama["priced"] == grad_bytes and llama_bf16_sums["priced"] == grad_bytes // 2


def test_bf16_data_and_tensor_parallel_equals_one_device() -> None:
    cases = [("llama", {"dp": 2, "tp": 2}, megatron("llama"), "bf16")]
    for per_rank in run_ranks(_cases, 4, cases, timeout=300):
        _check(per_rank[0], "bfloat16")


def _fp16_with_loss_scaling() -> dict:
    """GPT in float16 on dp 2 with a GradScaler against one device with its own: equal steps;
    then an inf in rank 1's gradient skips the step on both ranks and halves the scale."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("gpt", 0.0)
    data = batches(config, torch.float32)
    ref = single_device(copy.deepcopy(model), data[0], precision="fp16")
    pm = parallelize(model, data[0], {"dp": 2}, precision="fp16")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, pm)]
    scalers = [GradScaler(init_scale=2.0**10, growth_interval=2), GradScaler(2.0**10, 2.0, 0.5, 2)]
    worst = 0.0
    for batch in data[:4]:
        for m, opt, scaler, local in zip(
            (ref, pm), opts, scalers, (batch, shard_inputs(batch, pm)), strict=True
        ):
            scaler.scale(m(*local)).backward()
            scaler.unscale_(opt)
        grads, grads_ref = _full_grads(pm), _full_grads(ref)
        for k, g_ref in grads_ref.items():
            error = float((grads[k] - g_ref).norm() / g_ref.norm().clamp_min(1e-12))
            worst = max(worst, error)
        for opt, scaler in zip(opts, scalers, strict=True):
            scaler.step(opt), scaler.update(), opt.zero_grad()
    scales = [s.get_scale() for s in scalers]
    before = pm.full_state_dict()
    scaler = scalers[1]
    scaler.scale(pm(*shard_inputs(data[4], pm))).backward()
    if dist.get_rank() == 1:
        next(p for p in pm.parameters()).grad.view(-1)[0] = float("inf")
    stepped = scaler.step(opts[1]) is not None
    scaler.update()
    after = pm.full_state_dict()
    unchanged = all(torch.equal(after[k], before[k]) for k in before)
    return {
        "worst": worst,
        "scales": scales,
        "stepped": stepped,
        "unchanged": unchanged,
        "scale": scaler.get_scale(),
    }


def test_fp16_loss_scaling_skips_an_overflow_on_every_rank() -> None:
    for outcome in run_ranks(_fp16_with_loss_scaling, 2, timeout=300):
        assert outcome["worst"] < GRAD_TOLERANCE, outcome["worst"]
        # 4 clean steps with growth every 2: the scale doubled twice, the same both ways
        assert outcome["scales"] == [2.0**12, 2.0**12]
        assert not outcome["stepped"] and outcome["unchanged"]
        assert outcome["scale"] == 2.0**11


def test_a_policy_names_what_is_wrong() -> None:
    assert precision_policy("bf16") == Precision(torch.bfloat16)
    assert precision_policy({"compute": "bf16", "reduce": "bf16"}).reduce == torch.bfloat16
    with pytest.raises(PrecisionError, match="precision='bf17': expected one of fp32, bf16"):
        precision_policy("bf17")
    with pytest.raises(PrecisionError, match="compute=torch.int32: not a floating dtype"):
        Precision(torch.int32)
    with pytest.raises(PrecisionError, match="no field 'params'"):
        precision_policy({"params": "fp32"})
    # the master weights are the model's own: resolved from it, and a different one refused
    model = torch.nn.Linear(2, 2)
    assert precision_policy("bf16").resolve(model).master == torch.float32
    assert precision_policy("fp32").resolve(model).master is None  # no policy: the model's
    with pytest.raises(PrecisionError, match="master=torch.float64: the model's parameters"):
        Precision(torch.bfloat16, master=torch.float64).resolve(model)
    with pytest.raises(ValueError, match="growth_factor"):
        GradScaler(growth_factor=0.5)
