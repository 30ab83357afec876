"""The device check, on one CUDA GPU (under 8 minutes on an H100-class card):

- transformers' Llama (8 layers, hidden 1024, 16 heads of 64, 4 key/value heads, ffn 2816,
  vocabulary 32000, sequences of 2048, 4 a step) trained 20 AdamW steps by autoshard with
  precision="bf16" on one rank, against the eager model under torch.autocast(bfloat16): the
  losses of every step within bf16's tolerance (2%, as tests/test_precision.py states it),
  and the ratio of their median step times;
- autoshard's predicted peak memory of that run against torch.cuda.max_memory_allocated
  (the goal: within 10%), and its predicted step time on the cluster calibrated here first
  (autoshard calibrate's CUDA measurement) against the measured one;
- the attention that ring and all-gather context parallelism run (ops/ring.py on one rank,
  its blocks through ops/blocks.py's fused kernels) against scaled_dot_product_attention, and
  each fused block kernel against the explicit product: time, memory, largest difference;
- the experts as one grouped product (ops/grouped.py) against transformers' grouped_mm
  experts (Mixtral's, the same weights): time, memory, largest difference, and whether it
  synchronized with the host.

Without CUDA it says so and runs nothing (the runner reports it skipped).
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch

NAME = "device"

LLAMA = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 2816,
         "vocab": 32000, "seq": 2048, "batch": 4}  # fmt: skip
QUICK = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512,
         "vocab": 1024, "seq": 256, "batch": 2}  # fmt: skip
STEPS, TIMED_FROM = 20, 5
LR = 1e-4
LOSS_RTOL = 0.02
MEMORY_GOAL = 0.10
#: bf16's resolution (2**-8 relative) after a row's sum, relative to the largest value
BF16_TOL = 3e-2


def unavailable() -> str | None:
    """Why this machine cannot run the check, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False); it runs on one GPU"
    return None


def run(quick: bool) -> dict:
    from autoshard.testing import run_ranks

    reason = unavailable()
    if reason:
        raise RuntimeError(f"device: {reason}")
    return run_ranks(_rank, 1, quick, timeout=900)[0]


def _rank(quick: bool) -> dict:
    from autoshard.cost.calibrate_cuda import cuda_spec, measure_device

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    started = time.monotonic()
    spec = cuda_spec([measure_device(device)], 1, "calibrated")
    out: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    out["calibrated"] = {
        "bf16_tflops": spec.flops["bfloat16"] / 1e12,
        "attention_efficiency": spec.attention_efficiency,
        "grouped_mm_efficiency": spec.grouped_mm_efficiency,
        "memory_bandwidth_gbs": spec.memory_bandwidth / 1e9,
        "seconds": time.monotonic() - started,
    }
    out["train"] = train_llama(device, QUICK if quick else LLAMA, STEPS, spec)
    out["attention"] = attention_kernels(device, (1, 4, 512, 64) if quick else (2, 16, 4096, 128))
    out["experts"] = experts_kernels(
        device, (8, 1024, 256, 128) if quick else (8, 16384, 1024, 2816)
    )
    out["seconds"] = time.monotonic() - started
    _check(out)
    return out


def _check(out: dict) -> None:
    """Raise where a result is wrong (not where it is slow or its prediction far)."""
    train = out["train"]
    if train["loss_worst_rel"] > LOSS_RTOL:
        raise AssertionError(f"losses differ by {train['loss_worst_rel']:.3%} > {LOSS_RTOL:.0%}")
    for name, row in {**out["attention"]["ways"], **out["attention"]["blocks"]}.items():
        if row["max_diff"] > BF16_TOL:
            raise AssertionError(f"attention {name}: differs by {row['max_diff']:.3g}")
    if out["experts"]["max_diff"] > BF16_TOL:
        raise AssertionError(f"experts differ by {out['experts']['max_diff']:.3g}")


# -- helpers that run on any device (tests run them on CPU) ----------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """The most device memory ``fn`` allocates beyond what was allocated before (CUDA)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def next_token_loss(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    )


def llama(sizes: dict) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
        intermediate_size=sizes["ffn"], num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=sizes["seq"], use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches(sizes: dict, steps: int, device: torch.device) -> list[tuple]:
    gen = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], sizes["seq"] + 1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(sizes["vocab"], shape, generator=gen).to(device)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _steps(step: Callable[[tuple], torch.Tensor], data: list, device: torch.device) -> dict:
    losses, times = [], []
    for batch in data:
        sync(device)
        start = time.perf_counter()
        losses.append(float(step(batch)))
        times.append(time.perf_counter() - start)
    return {"losses": losses, "step_s": statistics.median(times[TIMED_FROM:] or times)}


def eager(model: torch.nn.Module, data: list, device: torch.device) -> dict:
    """The model as PyTorch trains it in bf16: float32 parameters, autocast, AdamW."""
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(batch: tuple) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = next_token_loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    out = _steps(step, data, device)
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return out


def autoshard_run(model: torch.nn.Module, data: list, device: torch.device, spec) -> dict:
    """The same under autoshard on one rank, precision="bf16"; its predictions on ``spec``."""
    from autoshard import parallelize, shard_inputs
    from autoshard.cost import estimate

    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = model.to(device)
    pm = parallelize(model, data[0], {"dp": 1}, loss_fn=next_token_loss, precision="bf16")
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)

    def step(batch: tuple) -> torch.Tensor:
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    out = _steps(step, data, device)
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    predicted = estimate(pm.plan, pm.captured[True], spec)
    out["predicted_peak_bytes"] = predicted.peak_memory
    out["predicted_step_s"] = predicted.step_time
    return out


def train_llama(device: torch.device, sizes: dict, steps: int, spec) -> dict:
    """autoshard's bf16 run and PyTorch's autocast run of the same model and data, one after
    the other (each alone on the device: its memory is its own)."""
    model = llama(sizes)
    data = batches(sizes, steps, device)
    ours = autoshard_run(copy.deepcopy(model), data, device, spec)
    gc.collect()  # autoshard's module and optimizer gone before PyTorch's run is measured
    if device.type == "cuda":
        torch.cuda.empty_cache()
    theirs = eager(model, data, device)
    pairs = zip(ours["losses"], theirs["losses"], strict=True)
    out = {"sizes": sizes, "steps": steps, "autoshard": ours, "pytorch": theirs}
    out["loss_worst_rel"] = max(abs(a - b) / abs(b) for a, b in pairs)
    out["step_ratio"] = ours["step_s"] / theirs["step_s"]
    out["step_predicted_over_measured"] = ours["predicted_step_s"] / ours["step_s"]
    if "peak_bytes" in ours:
        error = ours["predicted_peak_bytes"] / ours["peak_bytes"] - 1
        out["memory_error"], out["memory_within_goal"] = error, abs(error) <= MEMORY_GOAL
    return out


# -- kernels -----------------------------------------------------------------------------------


def _compare(way: Callable, inputs: list, grad: torch.Tensor, device, want=None) -> dict:
    """A way's forward and backward: time, memory, and its largest difference from ``want``
    (output and input gradients)."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def both() -> list[torch.Tensor]:
        out = way(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    got = both()
    row = {"ms": timed(both, device) * 1e3, "peak_bytes": peak_bytes(both, device)}
    if want is not None:
        row["max_diff"] = max(_diff(a, b) for a, b in zip(got, want, strict=True))
    return row | {"result": got}


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest value of ``want``: bf16's rounding is relative."""
    want = want.float()
    finite = torch.isfinite(want)  # a row no key reaches: -inf in both log-sum-exps
    scale = float(want[finite].abs().max().clamp_min(1e-6))
    return float((got.float() - want)[finite].abs().max()) / scale


def attention_kernels(device: torch.device, shape: tuple[int, ...]) -> dict:
    """The causal attention of ``shape`` (batch, heads, sequence, head dim) in bf16: torch's
    ``scaled_dot_product_attention``, the ring's op and the all-gather method's op on one rank;
    and every fused block kernel against the explicit product at a block's size."""
    from autoshard.ops import blocks, ring

    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(*shape, generator=gen).to(device, torch.bfloat16) for _ in "qkvg")
    sdpa = _compare(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), [q, k, v], g, device)  # fmt: skip
    want = sdpa.pop("result")
    ways = {
        "ring (one rank)": lambda q, k, v: ring.ring_attention(q, k, v, None, [0], 0, None, True),
        "all-gather rows (one rank)": lambda q, k, v: ring.causal_rows_attention(q, k, v, [0], 0),
    }
    rows = {name: _compare(way, [q, k, v], g, device, want) for name, way in ways.items()}
    for row in rows.values():
        row.pop("result")
    return {"shape": list(shape), "kernel": blocks.kernel(q, k, None), "sdpa": sdpa,
            "ways": rows, "blocks": block_kernels(device)}  # fmt: skip


def block_kernels(device: torch.device) -> dict:
    """Each fused kernel a block may run here, against the explicit product in float32:
    output, log-sum-exp and gradients, a diagonal (causal) block and a whole one."""
    from autoshard.ops import blocks

    gen = torch.Generator().manual_seed(2)
    q, k, v, g = (torch.randn(2, 4, 256, 64, generator=gen).to(device, torch.bfloat16)
                  for _ in "qkvg")  # fmt: skip
    keep = torch.rand(256, 256, generator=gen).to(device) > 0.3
    keep[:, 0] = True
    names = {blocks.kernel(q, k, None), blocks.kernel(q, k, keep)} - {"explicit"}
    out = {}
    for name in sorted(names):
        mask = keep if name in ("efficient", "flash_cpu") else None
        worst = 0.0
        for diagonal in (False, True):
            fused = _block(name, q, k, v, g, diagonal, mask)
            explicit = _block("explicit", q, k, v, g, diagonal, mask)
            worst = max([worst, *(_diff(a, b) for a, b in zip(fused, explicit, strict=True))])
        out[name] = {"max_diff": worst, "mask": mask is not None}
    return out


def _block(name: str, q, k, v, g, diagonal: bool, mask) -> list[torch.Tensor]:
    from autoshard.ops import blocks

    rows, cols, acc = slice(0, q.shape[-2]), slice(0, k.shape[-2]), torch.float32
    out, lse = blocks.pair_forward(q, k, v, 0.125, diagonal, mask, cols, rows, acc, name)
    grads = blocks.pair_backward(
        g, q, k, v, out.to(q.dtype), lse, 0.125, diagonal, mask, cols, rows, acc, name
    )
    return [out, lse, *grads]


def experts_kernels(device: torch.device, shape: tuple[int, ...]) -> dict:
    """``shape`` (experts, tokens, hidden, ffn), two experts a token, in bf16: autoshard's
    experts op against transformers' Mixtral experts under ``grouped_mm``, the same weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from autoshard.ops.experts import experts_math
    from autoshard.ops.grouped import grouped_kernel

    experts, tokens, hidden, ffn = shape
    config = MixtralConfig(hidden_size=hidden, intermediate_size=ffn,
                           num_local_experts=experts, num_experts_per_tok=2)  # fmt: skip
    config._experts_implementation = "grouped_mm"
    theirs = MixtralExperts(config).to(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for p in theirs.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / hidden**0.5)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    index = torch.rand(tokens, experts, generator=gen).topk(2, dim=-1).indices.to(device)
    weight = torch.rand(tokens, 2, generator=gen).to(device, torch.bfloat16)
    g = torch.randn_like(x)
    gate_up, down = theirs.gate_up_proj, theirs.down_proj

    def reference(x, w, gu, d):
        return MixtralExperts.forward(_with(theirs, gu, d), x, index, w)

    def ours(x, w, gu, d):
        return experts_math(x, index, w, gu, d, config.hidden_act)

    inputs = [x, weight, gate_up.detach(), down.detach()]
    ref = _compare(reference, inputs, g, device)
    want = ref.pop("result")
    mine = _compare(ours, inputs, g, device, want)
    mine.pop("result")
    return {"shape": list(shape), "kernel": grouped_kernel(x, gate_up, down),
            "transformers": ref, "autoshard": mine, "max_diff": mine["max_diff"],
            "host_sync": _syncs(lambda: ours(*inputs), device)}  # fmt: skip


def _with(module: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor):
    """``module`` reading ``gate_up`` and ``down`` (leaves whose gradients are wanted)."""
    other = copy.copy(module)
    other._parameters = dict(module._parameters, gate_up_proj=gate_up, down_proj=down)
    return other


def _syncs(fn: Callable[[], object], device: torch.device) -> bool | None:
    """Whether ``fn`` waits on the device from the host (CUDA's sync debug mode)."""
    if device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def summary(result: dict) -> str:
    train, att, exp = result["train"], result["attention"], result["experts"]
    mib = 2**20
    ours, theirs = train["autoshard"], train["pytorch"]
    lines = [
        f"On {result['device']} (torch {result['torch']}), {result['seconds']:.0f} s in all.",
        "",
        f"transformers' Llama {train['sizes']}, {train['steps']} steps, bf16: autoshard "
        f"{ours['step_s'] * 1e3:.1f} ms a step, PyTorch autocast {theirs['step_s'] * 1e3:.1f} ms "
        f"(ratio {train['step_ratio']:.2f}); losses within {train['loss_worst_rel']:.2%}.",
        f"Peak memory: predicted {ours['predicted_peak_bytes'] / mib:.0f} MiB, measured "
        f"{ours['peak_bytes'] / mib:.0f} MiB ({train['memory_error']:+.1%}; goal 10%); "
        f"PyTorch's {theirs['peak_bytes'] / mib:.0f} MiB.",
        f"Step on the calibrated cluster: predicted {ours['predicted_step_s'] * 1e3:.1f} ms, "
        f"measured {ours['step_s'] * 1e3:.1f} ms ({train['step_predicted_over_measured']:.2f}x).",
        "",
        f"| causal attention {att['shape']} bf16 ({att['kernel']}) | ms fwd+bwd | peak MiB | "
        "max diff |",
        "|---|---:|---:|---:|",
        f"| scaled_dot_product_attention | {att['sdpa']['ms']:.2f} | "
        f"{att['sdpa']['peak_bytes'] / mib:.0f} | |",
    ]
    for name, row in att["ways"].items():
        lines.append(f"| {name} | {row['ms']:.2f} | {row['peak_bytes'] / mib:.0f} | "
                     f"{row['max_diff']:.3g} |")  # fmt: skip
    blocks = ", ".join(f"{k} {v['max_diff']:.3g}" for k, v in att["blocks"].items())
    lines += ["", f"Block kernels against the explicit product (max diff): {blocks}.", ""]
    lines += [
        f"| experts {exp['shape']} bf16 | ms fwd+bwd | peak MiB | max diff |",
        "|---|---:|---:|---:|",
        f"| transformers grouped_mm | {exp['transformers']['ms']:.2f} | "
        f"{exp['transformers']['peak_bytes'] / mib:.0f} | |",
        f"| autoshard ({exp['kernel']}) | {exp['autoshard']['ms']:.2f} | "
        f"{exp['autoshard']['peak_bytes'] / mib:.0f} | {exp['max_diff']:.3g} |",
        "",
        f"The experts op waited on the device from the host: {exp['host_sync']}.",
    ]
    return "\n".join(lines)
