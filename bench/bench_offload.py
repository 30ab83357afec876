"""Optimizer offload: the host update against torch's fused CPU AdamW, an offloaded step's
overhead measured against the cost model's prediction, and the NVMe step's reads and writes
against the disk's, in the same run.

The GPT reference model (hidden 256, 4 layers, 4 heads, vocab 512, seq 64, batch 8, float32,
AdamW) on one CPU rank of 2 threads (gloo). Host update: ``opt.step()`` of a module made with
``offload={"optimizer": 1.0}`` (its gradients already on the host, routed as backward
accumulated them: the fused CPU kernel over the flat masters chunk by chunk, each chunk's tails
copied back into the device tensors before the call returns) against
``torch.optim.AdamW(fused=True).step()`` on a plain copy of the same parameters whose own
backward of the same batch gave the same gradients; one of each a round, the order turning
around every round, wall and CPU seconds of each call, the ratio the median over rounds of the
two of a round. DeepSpeed's CPU Adam is timed beside them where ``deepspeed`` imports.
Overhead: a whole training step (forward, backward, ``opt.step()``) with and without the
offload, in turns (``bench.timing.in_turns``), and its ``opt.step()`` alone; predicted: the
estimates of the two plans on the ``cpu`` preset with both updates' numbers measured here
first (the device's AdamW by ``cost.calibrate.measure_optimizer``, the host's by
``cost.calibrate_host``). NVMe: training steps with the state in files, the bytes their reads
and writes move a second of those calls, against a file's sequential write and read there.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch

from bench.timing import in_turns, paired_ratio

NAME = "offload"

STEPS, WARMUP = 20, 3
#: rounds of the host update per training step timed: a call of a few milliseconds on 2 shared
#: cores varies by half from round to round, so its median needs many rounds
HOST_ROUNDS = 5
BATCH, THREADS = 8, 2
#: the host memory the NVMe step streams its files through, and the disk probe's file size
NVME_BUDGET_MB = 8
DISK_BYTES = 64 * 2**20
#: what the table says where ``deepspeed`` does not import
DEEPSPEED_MISSING = (
    "not installed here (`pip install deepspeed`, an sdist, with torch 2.13.0 did not finish "
    "within 10 minutes on this machine)"
)


def _model():
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("gpt", vocab=512, seq=64, layers=4, heads=4, hidden=256)
    return build(config), config.example_batch(BATCH, torch.Generator().manual_seed(1))


def _host_update(model: torch.nn.Module, batch: tuple, steps: int) -> dict[str, Any]:
    """The offloaded module's ``opt.step()`` against fused AdamW on a plain copy of the same
    parameters, each with the gradients of its own backward of the same batch (the same
    values); wall and CPU seconds of each call."""
    import autoshard
    from autoshard.runtime.offload import CHUNK_BYTES

    pm = autoshard.parallelize(copy.deepcopy(model), batch, {"dp": 1}, offload={"optimizer": 1.0})
    ours = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    plain = copy.deepcopy(model)
    theirs = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    ways = {"autoshard": ours.step, "fused AdamW": theirs.step}
    deepspeed = _deepspeed(plain)
    if deepspeed is not None:
        ways["DeepSpeed CPU Adam"] = deepspeed
    wall: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    parts: dict[str, list[float]] = {"host_update": [], "copy_back": []}
    for i in range(WARMUP + steps):  # each round: this round's gradients, then the updates
        theirs.zero_grad()
        plain(*batch).backward()  # untimed, as is the one below, which leaves them on the host
        pm(*batch).backward()
        before = pm.offload_seconds()
        for name, step in list(ways.items())[:: 1 if i % 2 == 0 else -1]:
            began, used = time.perf_counter(), time.process_time()
            step()
            if i >= WARMUP:
                wall[name].append(time.perf_counter() - began)
                cpu[name].append(time.process_time() - used)
        if i >= WARMUP:
            for k, v in pm.offload_seconds().items():
                parts[k].append(v - before[k])
    # the offloaded step but its copy back: what the host's update of the same parameters takes
    wall["update"] = [t - c for t, c in zip(wall["autoshard"], parts["copy_back"], strict=True)]
    theirs.zero_grad()  # one more round, each call profiled for what it allocates
    plain(*batch).backward()
    pm(*batch).backward()
    result = {
        "allocated": {"autoshard": _allocated(ours.step), "fused AdamW": _allocated(theirs.step)},
        "ms": {name: statistics.median(t) * 1e3 for name, t in wall.items()},
        "cpu_ms": {name: statistics.median(t) * 1e3 for name, t in cpu.items()},
        "parts_ms": {k: statistics.median(v) * 1e3 for k, v in parts.items()},
        "paired": paired_ratio(wall["autoshard"], wall["fused AdamW"]),
        "update_paired": paired_ratio(wall["update"], wall["fused AdamW"]),
        "cpu_paired": paired_ratio(cpu["autoshard"], cpu["fused AdamW"]),
        "elements": sum(p.numel() for p in plain.parameters()),
        "chunk_bytes": CHUNK_BYTES,
    }
    if deepspeed is not None:
        result["deepspeed"] = paired_ratio(wall["autoshard"], wall["DeepSpeed CPU Adam"])
    return result


def _allocated(step: Any) -> float:
    """Bytes allocated inside one call of ``step``, as torch.profiler counts them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return float(sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages()))


def _deepspeed(plain: torch.nn.Module) -> Any:
    """DeepSpeed's CPU Adam over a copy of the parameters, stepping the gradients ``plain``
    holds, where it builds here (else None)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:
        return None
    sources = list(plain.parameters())
    params = [p.detach().clone().requires_grad_() for p in sources]
    try:
        opt = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    except Exception:
        return None

    def step() -> None:
        for p, q in zip(params, sources, strict=True):
            p.grad = q.grad
        opt.step()

    return step


def _spec() -> Any:
    """The ``cpu`` preset with this machine's numbers measured on this process's threads, both
    updates' alike: the device's (torch.optim's AdamW as the user's runs: memory bandwidth, op
    overhead, memory passes; ``calibrate.measure_optimizer``) and the host's (fused AdamW,
    copies; ``calibrate_host.with_host``), as ``autoshard calibrate`` measures them."""
    from autoshard.cost import cluster_spec
    from autoshard.cost.calibrate import measure_optimizer
    from autoshard.cost.calibrate_host import with_host

    spec = dataclasses.replace(cluster_spec("cpu", 1), **measure_optimizer())
    # the tier is not what is timed
    return dataclasses.replace(with_host(spec), host_memory_bytes=64e9)


def _overhead(model: torch.nn.Module, batch: tuple, steps: int) -> dict[str, Any]:
    """A training step with the optimizer offloaded against the same step without, measured
    and predicted: the whole step, and its update (``opt.step()``) alone."""
    import autoshard

    spec = _spec()
    plans = {
        f: autoshard.plan(model, batch, spec, num_devices=1, zero=0, offload={"optimizer": f})
        for f in (0.0, 1.0)
    }
    mods, opts = {}, {}
    updates: dict[float, list[float]] = {0.0: [], 1.0: []}
    for f, plan in plans.items():
        mods[f] = autoshard.parallelize(copy.deepcopy(model), batch, None, plan=plan)
        opts[f] = torch.optim.AdamW(mods[f].parameters(), lr=1e-4)

    def step(f: float):
        def run() -> None:
            mods[f](*batch).backward()
            began = time.perf_counter()
            opts[f].step()
            updates[f].append(time.perf_counter() - began)
            opts[f].zero_grad()

        return run

    times = in_turns({"offloaded": step(1.0), "device": step(0.0)}, steps, WARMUP)
    measured = statistics.median(times["offloaded"]) - statistics.median(times["device"])
    base, offloaded = plans[0.0].predicted, plans[1.0].predicted
    return {
        "measured_ms": measured * 1e3,
        "predicted_ms": (offloaded.step_time - base.step_time) * 1e3,
        "predicted_steps_ms": {
            "offloaded": offloaded.step_time * 1e3,
            "device": base.step_time * 1e3,
        },
        "offloaded_ms": statistics.median(times["offloaded"]) * 1e3,
        "device_ms": statistics.median(times["device"]) * 1e3,
        "paired": paired_ratio(times["offloaded"], times["device"]),
        "update_ms": {
            "device": statistics.median(updates[0.0][WARMUP:]) * 1e3,
            "offloaded": statistics.median(updates[1.0][WARMUP:]) * 1e3,
        },
        "predicted_update_ms": {
            "device": base.optimizer * 1e3,
            "offloaded": (offloaded.optimizer + offloaded.offload_parts["host_update"]) * 1e3,
        },
        "host_adam_rate": spec.host_adam_rate,
        "host_bandwidth": spec.host_bandwidth,
        "memory_bandwidth": spec.memory_bandwidth,
        "optimizer_passes": spec.optimizer_passes,
        "parts_ms": {k: v * 1e3 for k, v in offloaded.offload_parts.items()},
    }


def _nvme(model: torch.nn.Module, batch: tuple, steps: int) -> dict[str, Any]:
    """Training steps with the optimizer's state in files: the bytes their reads and writes
    moved a second of those calls, against the disk's sequential throughput in the same
    directory (``cost.calibrate_host.file_bandwidth``: a file of ``DISK_BYTES`` written and
    fsynced, its pages dropped with ``posix_fadvise`` before it is read back)."""
    import autoshard
    from autoshard.cost.calibrate_host import file_bandwidth

    with tempfile.TemporaryDirectory(prefix="bench-nvme-") as where:
        offload = {"optimizer": 1.0, "nvme": where, "host_budget_mb": NVME_BUDGET_MB}
        pm = autoshard.parallelize(copy.deepcopy(model), batch, {"dp": 1}, offload=offload)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        times = []
        for i in range(WARMUP + steps):
            if i == WARMUP:
                before = pm.nvme_io()
            began = time.perf_counter()
            pm(*batch).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - began)
        io = {k: v - before[k] for k, v in pm.nvme_io().items()}
        del pm, opt  # its files go with it
        write, read = file_bandwidth(where, DISK_BYTES)
    return {
        "step_ms": statistics.median(times[WARMUP:]) * 1e3,
        "read_bytes": io["read_bytes"] / steps,
        "write_bytes": io["write_bytes"] / steps,
        "read_bandwidth": io["read_bytes"] / io["read_s"],
        "write_bandwidth": io["write_bytes"] / io["write_s"],
        "disk_read_bandwidth": read,
        "disk_write_bandwidth": write,
    }


def _rank(steps: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(THREADS)
    model, batch = _model()
    return {
        "host": _host_update(model, batch, steps * HOST_ROUNDS),
        "step": _overhead(model, batch, steps),
        "nvme": _nvme(model, batch, steps),
    }


def run(quick: bool) -> dict:
    import os

    from autoshard.testing import run_ranks

    steps = 5 if quick else STEPS
    before = os.getloadavg()[0]
    result = run_ranks(_rank, 1, steps, timeout=900)[0]
    # whether other processes shared the cores: under them the timings here grow up to 100x
    result["load"] = [before, os.getloadavg()[0]]
    result["steps"] = steps
    result["ratio"] = result["host"]["paired"]["median"]
    result["update_ratio"] = result["host"]["update_paired"]["median"]
    result["cpu_ratio"] = result["host"]["cpu_paired"]["median"]
    return result


def _host_lines(result: dict) -> list[str]:
    host = result["host"]
    ds = host.get("deepspeed")
    wall, cpu, update = host["paired"], host["cpu_paired"], host["update_paired"]
    ms, parts, alloc = host["ms"], host["parts_ms"], host.get("allocated", {})
    rest = ms["autoshard"] - parts["host_update"] - parts["copy_back"]
    return [
        "GPT reference model (hidden 256, 4 layers, vocab 512, seq 64, batch 8, float32, AdamW; "
        f"{host['elements'] / 1e6:.2f}M parameters in 52 tensors) on one CPU rank of {THREADS} "
        "threads. Host update: `opt.step()` under `offload={'optimizer': 1.0}` against "
        "`AdamW(fused=True).step()` on a plain copy of the same parameters with the same "
        "gradients, in turns. Each side's call is all that is timed and leaves the same: "
        "the updated parameters in the tensors the next forward reads. Ours: the user's "
        "AdamW (no gradient left in `.grad`), then one fused CPU kernel call a chunk (at "
        f"most {host['chunk_bytes'] / 2**20:g} MiB of the flat host masters) and that "
        "chunk's tails copied back into the device tensors (one `torch._foreach_copy_`; "
        "here the model is one chunk), returning when every copy is done. "
        "Theirs: the kernel over the tensors in place. Neither times the gradients' "
        "arrival: the plain copy's are in `.grad` from its own backward, ours went to the "
        "host as backward accumulated them (those copies are in backward, in the step "
        f"below). {result['steps'] * HOST_ROUNDS} rounds. Wall and CPU (`time.process_time`, all the "
        "process's threads) milliseconds, medians; each ratio is the median over rounds "
        "of the two of a round, with its 95% interval (bootstrap over rounds).",
        "",
        "Each round the offload's own clock (`pm.offload_seconds()`, `time.perf_counter` "
        "around its calls) splits our call: the host kernels "
        f"{parts['host_update']:.2f} ms, the copy back {parts['copy_back']:.2f} ms, the rest "
        f"(the user's AdamW over parameters without gradients, the hooks, the bookkeeping) "
        f"{rest:.2f} ms. The first row is our call less its copy back: the host's update of "
        "the same parameters, the comparison the bench is for. The second is the whole call. "
        "The copy back is a cost of this machine's layout, not hidden: here the device is "
        "this CPU's memory, so moving the updated parameters into the device tensors "
        f"({host['elements'] * 4 / 1e6:.1f} MB) takes the same {THREADS} cores the kernels "
        "run on and adds to the call in full (a thread of its own beside the next chunk's "
        "update was slower on these 2 cores). On a GPU it is a host-to-device copy on a side "
        "stream, beside the next chunk's update, and only the last chunk's waits; the torch "
        "kernel writes one tensor in place, so it cannot write the device's copy (GPU "
        "memory) in its own pass. The step below prices it either way (`host_update`). "
        "Bytes allocated inside one call of each (`torch.profiler`, `profile_memory`): ours "
        f"{alloc.get('autoshard', 0):.0f}, theirs {alloc.get('fused AdamW', 0):.0f}.",
        "",
        "| | autoshard ms | fused AdamW ms | ratio |",
        "|---|---:|---:|---:|",
        f"| host update (`opt.step()` less its copy back) | {ms['update']:.2f} | "
        f"{ms['fused AdamW']:.2f} | {update['median']:.2f} ({update['low']:.2f}-"
        f"{update['high']:.2f}) |",
        f"| host update and copy back (the whole `opt.step()`) | {ms['autoshard']:.2f} | "
        f"{ms['fused AdamW']:.2f} | {wall['median']:.2f} ({wall['low']:.2f}-{wall['high']:.2f}) |",
        f"| CPU time of the whole call | {host['cpu_ms']['autoshard']:.2f} | "
        f"{host['cpu_ms']['fused AdamW']:.2f} | {cpu['median']:.2f} ({cpu['low']:.2f}-"
        f"{cpu['high']:.2f}) |",
        "",
        "DeepSpeed's CPU Adam: "
        + (
            f"{ms['DeepSpeed CPU Adam']:.2f} ms, ratio of the whole call {ds['median']:.2f}."
            if ds
            else f"{DEEPSPEED_MISSING}."
        ),
    ]


def _nvme_lines(result: dict) -> list[str]:
    nvme = result["nvme"]
    gb = 1e9
    return [
        "The same model's training step with the optimizer's state in files "
        f"(`offload={{'optimizer': 1.0, 'nvme': path, 'host_budget_mb': {NVME_BUDGET_MB}}}`, "
        "a temporary directory), against the disk there: the step's reads (`os.preadv`) and "
        "writes (`os.pwrite`; the gradients' in backward and the step's write-behind) as bytes "
        "over the seconds spent in those calls, through the page cache as the offload does "
        "them; the disk's as a file of "
        f"{DISK_BYTES >> 20} MiB written and fsynced, then read back after its pages were "
        "dropped (`posix_fadvise(DONTNEED)`), so from the drive.",
        "",
        "| NVMe step ms | read MB a step | written MB a step | step reads GB/s | step writes "
        "GB/s | disk read GB/s | disk write GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {nvme['step_ms']:.1f} | {nvme['read_bytes'] / 1e6:.1f} | "
        f"{nvme['write_bytes'] / 1e6:.1f} | {nvme['read_bandwidth'] / gb:.2f} | "
        f"{nvme['write_bandwidth'] / gb:.2f} | {nvme['disk_read_bandwidth'] / gb:.2f} | "
        f"{nvme['disk_write_bandwidth'] / gb:.2f} |",
    ]


def summary(result: dict) -> str:
    step = result["step"]
    up, pred = step["update_ms"], step["predicted_update_ms"]
    steps = step["predicted_steps_ms"]
    lines = []
    if "load" in result:
        before, after = result["load"]
        lines += [
            f"The machine's load average (1 minute) was {before:.1f} before the run and "
            f"{after:.1f} after. Where it is above 2, the core count, other processes shared "
            "the cores, and the times below include waiting for them.",
            "",
        ]
    lines += [
        *_host_lines(result),
        "",
        "A training step with the optimizer offloaded against the same step without (ZeRO 0, "
        "one rank, `torch.optim.AdamW(lr=1e-4)` as a user makes it), in turns; the update is "
        "`opt.step()` alone (the device's AdamW, or the offload's host update and copies back). "
        "Predicted: the estimates' on the `cpu` preset with both updates' numbers measured "
        f"here first, on the same {THREADS} threads, as `autoshard calibrate` measures them: "
        f"the device's AdamW {step['optimizer_passes']:.1f} memory passes at "
        f"{step['memory_bandwidth'] / 1e9:.2f} GB/s (`calibrate.measure_optimizer`), the "
        f"host's fused AdamW {step['host_adam_rate'] / 1e6:.0f}M elements/s and copies "
        f"{step['host_bandwidth'] / 1e9:.2f} GB/s (`calibrate_host.with_host`).",
        "",
        "| | offloaded ms | device ms | difference ms |",
        "|---|---:|---:|---:|",
        f"| step measured | {step['offloaded_ms']:.1f} | {step['device_ms']:.1f} | "
        f"{step['measured_ms']:.1f} |",
        f"| step predicted | {steps['offloaded']:.1f} | {steps['device']:.1f} | "
        f"{step['predicted_ms']:.1f} |",
        f"| update measured | {up['offloaded']:.1f} | {up['device']:.1f} | "
        f"{up['offloaded'] - up['device']:.1f} |",
        f"| update predicted | {pred['offloaded']:.1f} | {pred['device']:.1f} | "
        f"{pred['offloaded'] - pred['device']:.1f} |",
    ]
    if "nvme" in result:
        lines += ["", *_nvme_lines(result)]
    return "\n".join(lines)
