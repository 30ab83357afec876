"""Optimizer offload: the host update against torch's fused CPU AdamW, and an offloaded step's
overhead measured against the cost model's prediction, in the same run.

The GPT reference model (hidden 256, 4 layers, 4 heads, vocab 512, seq 64, batch 8, float32,
AdamW) on one CPU rank of 2 threads (gloo). Host update: ``opt.step()`` of a module made with
``offload={"optimizer": 1.0}`` (its gradients already on the host: routed, stepped by the
fused CPU kernel, the masters copied back) against ``torch.optim.AdamW(fused=True).step()`` on
a plain copy of the same parameters with the same gradients; one of each a round, the order
turning around every round (``bench.timing.in_turns``), the ratio the median over rounds of the
two of a round. DeepSpeed's CPU Adam is timed beside them where ``deepspeed`` imports. Overhead:
a whole training step (forward, backward, ``opt.step()``) with and without the offload, in
turns; predicted: the plan's ``offload_s`` less the device update it takes over, on the ``cpu``
preset with this host's numbers measured first (``cost.calibrate_host``).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import warnings
from typing import Any

import torch

from bench.timing import in_turns, paired_ratio

NAME = "offload"

STEPS, WARMUP = 20, 3
BATCH, THREADS = 8, 2


def _model():
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("gpt", vocab=512, seq=64, layers=4, heads=4, hidden=256)
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


def _host_update(model: torch.nn.Module, batch: tuple, steps: int) -> dict[str, Any]:
    """The offloaded module's ``opt.step()`` against fused AdamW on the same parameters."""
    import autoshard

    pm = autoshard.parallelize(copy.deepcopy(model), batch, {"dp": 1}, offload={"optimizer": 1.0})
    ours = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    plain = [p.detach().clone().requires_grad_() for p in model.parameters()]
    theirs = torch.optim.AdamW(plain, lr=1e-4, fused=True)
    pm(*batch).backward()
    grads = {id(p): p.grad for p in plain}
    for p, q in zip(plain, model.parameters(), strict=True):
        p.grad = torch.randn_like(q)
        grads[id(p)] = p.grad

    def step_ours() -> None:
        ours.step()

    def step_theirs() -> None:
        for p in plain:
            p.grad = grads[id(p)]
        theirs.step()

    ways = {"autoshard": step_ours, "fused AdamW": step_theirs}
    deepspeed = _deepspeed(plain, grads)
    if deepspeed is not None:
        ways["DeepSpeed CPU Adam"] = deepspeed
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(WARMUP + steps):  # each round: new host gradients, then the updates timed
        pm(*batch).backward()  # untimed: it puts this round's gradients on the host
        order = dict(list(ways.items())[:: 1 if i % 2 == 0 else -1])
        got = in_turns(order, 1, 0) if i >= WARMUP else in_turns(order, 0, 1)
        for name, kept in got.items():
            times[name] += kept
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    paired = paired_ratio(times["autoshard"], times["fused AdamW"])
    result = {"ms": out, "paired": paired, "elements": sum(p.numel() for p in plain)}
    if deepspeed is not None:
        result["deepspeed"] = paired_ratio(times["autoshard"], times["DeepSpeed CPU Adam"])
    return result


def _deepspeed(plain: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> Any:
    """DeepSpeed's CPU Adam over a copy of the parameters, where it builds here (else None)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:
        return None
    params = [p.detach().clone().requires_grad_() for p in plain]
    for p, q in zip(params, plain, strict=True):
        p.grad = grads[id(q)]
    try:
        opt = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
        opt.step()
    except Exception:
        return None
    return opt.step


def _overhead(model: torch.nn.Module, batch: tuple, steps: int) -> dict[str, Any]:
    """A training step with the optimizer offloaded against the same step without, measured
    and predicted."""
    import autoshard
    from autoshard.cost import cluster_spec
    from autoshard.cost.calibrate_host import with_host

    spec = with_host(cluster_spec("cpu", 1))
    spec = dataclasses.replace(spec, host_memory_bytes=64e9)  # the tier is not what is timed
    plans = {
        f: autoshard.plan(model, batch, spec, num_devices=1, zero=0, offload={"optimizer": f})
        for f in (0.0, 1.0)
    }
    mods, opts = {}, {}
    for f, plan in plans.items():
        mods[f] = autoshard.parallelize(copy.deepcopy(model), batch, None, plan=plan)
        opts[f] = torch.optim.AdamW(mods[f].parameters(), lr=1e-4)

    def step(f: float):
        def run() -> None:
            mods[f](*batch).backward()
            opts[f].step()
            opts[f].zero_grad()

        return run

    times = in_turns({"offloaded": step(1.0), "device": step(0.0)}, steps, WARMUP)
    measured = statistics.median(times["offloaded"]) - statistics.median(times["device"])
    base, offloaded = plans[0.0].predicted, plans[1.0].predicted
    return {
        "measured_ms": measured * 1e3,
        "predicted_ms": (offloaded.step_time - base.step_time) * 1e3,
        "offloaded_ms": statistics.median(times["offloaded"]) * 1e3,
        "device_ms": statistics.median(times["device"]) * 1e3,
        "paired": paired_ratio(times["offloaded"], times["device"]),
        "host_adam_rate": spec.host_adam_rate,
        "host_bandwidth": spec.host_bandwidth,
        "parts_ms": {k: v * 1e3 for k, v in offloaded.offload_parts.items()},
    }


def _rank(steps: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(THREADS)
    model, batch = _model()
    return {"host": _host_update(model, batch, steps), "step": _overhead(model, batch, steps)}


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    steps = 5 if quick else STEPS
    result = run_ranks(_rank, 1, steps, timeout=900)[0]
    result["steps"] = steps
    result["ratio"] = result["host"]["paired"]["median"]
    return result


def summary(result: dict) -> str:
    host, step = result["host"], result["step"]
    interval = f"{host['paired']['low']:.2f}-{host['paired']['high']:.2f}"
    ds = host.get("deepspeed")
    lines = [
        "GPT reference model (hidden 256, 4 layers, vocab 512, seq 64, batch 8, float32, AdamW; "
        f"{host['elements'] / 1e6:.2f}M parameters) on one CPU rank of {THREADS} threads. Host "
        "update: `opt.step()` under `offload={'optimizer': 1.0}` (gradients on the host, the "
        "fused CPU kernel, the masters copied back) against `AdamW(fused=True).step()` on the "
        f"same parameters, in turns, {result['steps']} rounds; the ratio is the median over "
        "rounds of the two of a round, with its 95% interval (bootstrap over rounds).",
        "",
        "| autoshard host step ms | fused AdamW ms | ratio | 95% interval | DeepSpeed CPU Adam |",
        "|---:|---:|---:|---:|---|",
        f"| {host['ms']['autoshard']:.2f} | {host['ms']['fused AdamW']:.2f} | "
        f"{host['paired']['median']:.2f} | {interval} | "
        + (
            f"{host['ms']['DeepSpeed CPU Adam']:.2f} ms, ratio {ds['median']:.2f} |"
            if ds
            else "not installed here |"
        ),
        "",
        "A training step with the optimizer offloaded against the same step without (ZeRO 0, "
        "one rank), in turns; predicted: the estimate's difference on the `cpu` preset with "
        f"this host's numbers measured first (fused CPU AdamW {step['host_adam_rate'] / 1e6:.0f}"
        f"M elements/s, copies {step['host_bandwidth'] / 1e9:.2f} GB/s).",
        "",
        "| offloaded step ms | device step ms | overhead measured ms | overhead predicted ms |",
        "|---:|---:|---:|---:|",
        f"| {step['offloaded_ms']:.1f} | {step['device_ms']:.1f} | {step['measured_ms']:.1f} | "
        f"{step['predicted_ms']:.1f} |",
    ]
    return "\n".join(lines)
