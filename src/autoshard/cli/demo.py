"""``autoshard demo``: the whole job on local CPU ranks, then checked against one process.

A byte-level GPT (vocabulary 256) is planned automatically for the ranks, trained on the text
in ``demo_text`` with AdamW, checkpointed halfway and resumed from the checkpoint into a model
parallelized afresh, and every loss is compared with a single-process run of the same steps
on the same batches. Rank 0 prints a metrics line every ``every`` steps: loss, tokens per
second, step time, bytes each rank sent, the memory a rank holds and at most held, and the
measured MFU against the cluster preset's peak.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DemoConfig:
    """What ``autoshard demo`` trains, where and how long."""

    ranks: int = 4
    steps: int = 200
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    batch: int = 8
    lr: float = 3e-3
    search: str = "optimal"
    every: int = 20
    seed: int = 0
    cluster: str = "cpu"


def _text() -> torch.Tensor:
    from autoshard.cli.demo_text import TEXT

    return torch.tensor(list(TEXT.encode()), dtype=torch.int64)


def batch_at(data: torch.Tensor, cfg: DemoConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``batch`` windows of the text and the next byte of each."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - cfg.seq - 1, (cfg.batch,), generator=g)
    x = torch.stack([data[s : s + cfg.seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + cfg.seq + 1] for s in starts.tolist()])
    return x, y


def build_model(cfg: DemoConfig) -> torch.nn.Module:
    from autoshard.models import build, reference_config

    torch.manual_seed(cfg.seed)
    sizes = {"vocab": 256, "seq": cfg.seq, "layers": cfg.layers, "heads": cfg.heads}
    return build(reference_config("gpt", hidden=cfg.hidden, **sizes))


def _metrics(cfg: DemoConfig, step: int, window: dict[str, float], pm: Any, opt: Any) -> str:
    from autoshard.cost import cluster_spec
    from autoshard.testing import peak_resident_bytes

    steps = window["steps"]
    seconds = window["seconds"] / steps
    peak = cluster_spec(cfg.cluster).peak_flops(torch.float32) * cfg.ranks
    held = sum(pm.state_bytes(opt).values())
    maxrss = peak_resident_bytes()
    bar = "#" * (20 * step // cfg.steps)
    return (
        f"[{bar:<20}] step {step:>4}/{cfg.steps}  loss {window['loss'] / steps:.4f}  "
        f"{cfg.batch * cfg.seq / seconds:,.0f} tokens/s  {seconds * 1e3:.1f} ms/step  "
        f"sent {window['bytes'] / steps / 1024:.1f} KiB/rank/step  "
        f"held {held / 2**20:.2f} MiB, peak RSS {maxrss / 2**20:.0f} MiB per rank  "
        f"MFU {window['flops'] / steps / seconds / peak:.1%}"
    )


def _parallel(model: torch.nn.Module, example: Any, cfg: DemoConfig) -> tuple[Any, Any]:
    from autoshard.runtime import parallelize

    pm = parallelize(model, example, cfg.ranks, search=cfg.search, cluster=cfg.cluster)
    return pm, torch.optim.AdamW(pm.parameters(), lr=cfg.lr)


def train_rank(config: dict[str, Any], directory: str) -> list[float]:
    """One rank's training (``run_ranks``): the losses of every step."""
    from autoshard import comm
    from autoshard.runtime import load, save, shard_inputs

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's, not the user's
    cfg = DemoConfig(**config)
    data = _text()
    pm, opt = _parallel(build_model(cfg), batch_at(data, cfg, 0), cfg)
    loud = pm.rank == 0
    if loud:
        print(f"plan for {cfg.ranks} ranks, searched ({cfg.search}):\n{pm.plan}\n", flush=True)
    losses: list[float] = []
    window = dict.fromkeys(("steps", "seconds", "loss", "bytes", "flops"), 0.0)
    for step in range(cfg.steps):
        if step == cfg.steps // 2:
            path = save(f"{directory}/step{step}", pm, opt, step=step)
            pm, opt = _parallel(build_model(cfg), batch_at(data, cfg, 0), cfg)
            resumed = load(path, pm, opt)["step"]
            if loud:
                print(f"saved {path} and resumed a new model from it at step {resumed}")
        start = time.perf_counter()
        with comm.counting() as sent:
            loss = pm(*shard_inputs(batch_at(data, cfg, step), pm))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        window["seconds"] += time.perf_counter() - start
        window["steps"] += 1
        window["loss"] += losses[-1]
        window["bytes"] += sum(c["bytes"] for c in sent.values())
        window["flops"] += pm.flops_per_step  # the model's, forward and backward
        if (step + 1) % cfg.every == 0 or step + 1 == cfg.steps:
            if loud:
                print(_metrics(cfg, step + 1, window, pm, opt), flush=True)
            window = dict.fromkeys(window, 0.0)
    return losses


def one_process(cfg: DemoConfig) -> list[float]:
    """The same steps on one process: the reference every rank's losses are compared with."""
    from autoshard.runtime import single_device

    data, model = _text(), build_model(cfg)
    one = single_device(model, batch_at(data, cfg, 0))
    opt = torch.optim.AdamW(one.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        loss = one(*batch_at(data, cfg, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_demo(cfg: DemoConfig) -> float:
    """Train on ``cfg.ranks`` local ranks and on one process; the largest loss difference."""
    from autoshard.testing import run_ranks

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autoshard-demo-") as directory:
        losses = run_ranks(train_rank, cfg.ranks, asdict(cfg), directory, timeout=900)[0]
    parallel_s = time.perf_counter() - start
    print(f"\n{cfg.ranks} ranks: {cfg.steps} steps in {parallel_s:.1f} s; now one process ...")
    reference = one_process(cfg)
    gaps = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    first = max(gaps[: min(10, len(gaps))])
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; largest difference from one process: "
        f"{first:.2e} in the first {min(10, len(gaps))} steps, {max(gaps):.2e} over all "
        f"{cfg.steps} (float32 sums in another order, compounded by each optimizer step)"
    )
    return max(gaps)


__all__ = ["DemoConfig", "run_demo"]
