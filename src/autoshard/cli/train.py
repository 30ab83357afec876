"""``autoshard train``: the user's own model, planned and trained on the ranks torchrun starts.

``autoshard train mymodule:make --nproc-per-node 2`` (or a TOML file whose ``[train]`` table
holds the same settings, ``target`` included) starts torchrun, which runs this module's
:func:`worker` on every rank, on what the function returns (``user_fn``): each rank reads its
shard of every global batch of a dataset, or trains on one batch again and again.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from autoshard.cli.metrics_log import open_log
from autoshard.options import Options
from autoshard.plan_text import human_bytes

WORKER = "AUTOSHARD_TRAIN"  # the settings, as JSON, on the ranks launch() starts

#: the types a setting may have, by the names in its annotation (a TOML value is checked
#: against them)
_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "None": (type(None),),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What ``autoshard train`` trains and how (the CLI's flags, or a TOML ``[train]`` table)."""

    target: str
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-3
    search: str = "optimal"
    plan: str | None = None
    zero: int = 0
    precision: str = "fp32"
    clip: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    log: str = "autoshard-train.jsonl"
    log_every: int = 10
    seed: int = 0
    cluster: str = "cpu"
    picture: str | None = None
    timeout: float = 600.0
    pp: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    tp: int | None = None
    cp: int | None = None
    attention: str | None = None
    ep: int | None = None
    sequence_parallel: bool = False
    copies: int = 1
    restart: bool = False
    servers: int = 0
    staleness: int | None = None

    def options(self, per_node: int | None = None) -> Options:
        """The options a rank parallelizes the model with (stages, where a pipeline setting
        is given, searched as ``autoshard plan --pp`` searches them; the parallel degrees
        given fixed, the others searched). ``per_node``: the ranks of a node (default:
        torchrun's ``LOCAL_WORLD_SIZE``), the size of the ``cpu`` preset's nodes."""
        planned = {"plan": self.plan} if self.plan else {"search": self.search}
        named = ("precision", "seed", "copies", "attention", "sequence_parallel")
        named += ("pp", "microbatches", "schedule", "virtual_stages", "recompute")
        if not self.ep:  # with experts over ep, the mesh holds tp and cp (mesh())
            named += ("tp", "cp")
        return Options(
            cluster=self.run_cluster(per_node),
            zero=self.zero or None,
            timeout_s=self.timeout,
            **planned,
            **{name: getattr(self, name) for name in named},
        )

    def run_cluster(self, per_node: int | None = None) -> Any:
        """The cluster the search prices: the preset or spec named; the ``cpu`` preset with
        nodes of this run's ranks (its processes share one machine, however many)."""
        if self.cluster != "cpu":
            return self.cluster
        from autoshard.cost.cluster import PRESETS

        per_node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return dataclasses.replace(PRESETS["cpu"], devices_per_node=per_node)

    def mesh(self, world: int) -> Any:
        """What ``parallelize`` is given for the mesh: the device count (its shape searched),
        or with ``ep`` the mesh itself, the data-parallel axis taking the devices the given
        degrees leave (the pipeline's axis outermost where ``pp`` is given). Degrees whose
        product does not divide the ranks are an error naming them."""
        given = {n: getattr(self, n) for n in ("pp", "ep", "cp", "tp") if getattr(self, n)}
        if world % math.prod(given.values()):
            named = " ".join(f"--{n} {k}" for n, k in given.items())
            raise ValueError(
                f"{named}: the ranks must be a multiple of {math.prod(given.values())}; "
                f"this run has {world}"
            )
        if not self.ep:
            return world
        axes = {"pp": self.pp or 1, "dp": 1, "ep": self.ep, "cp": self.cp or 1, "tp": self.tp or 1}
        axes["dp"] = world // math.prod(axes.values())
        return {n: k for n, k in axes.items() if k > 1 or n == "ep"}

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kinds = sum((_KINDS[name] for name in str(field.type).split(" | ")), ())
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                wanted = " or ".join("none" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"train setting {field.name} = {value!r}: expected {wanted}")
        positive = ("steps", "batch_size", "log_every", "timeout", "lr")
        bad = [f"{n} = {getattr(self, n)!r}" for n in positive if getattr(self, n) <= 0]
        counts = ("checkpoint_every", "servers", "staleness")
        bad += [f"{n} = {getattr(self, n)}" for n in counts if (getattr(self, n) or 0) < 0]
        # the degrees the mesh of ``ep`` reads; the options check the others' ranges
        bad += [
            f"{n} = {getattr(self, n)}" for n in ("tp", "cp", "ep") if (getattr(self, n) or 1) < 1
        ]
        if bad:
            raise ValueError(
                f"train settings out of range: {', '.join(bad)} (steps, batch_size, log_every, "
                "timeout and lr are positive; checkpoint_every, servers and staleness are 0 or "
                "more; tp, cp and ep are 1 or more)"
            )

    @classmethod
    def from_toml(cls, path: str) -> TrainConfig:
        """The ``[train]`` table of a TOML file; unknown keys are an error naming them."""
        import tomllib  # here: its import compiles its patterns, which `autoshard plan` skips

        try:
            table = tomllib.loads(Path(path).read_text()).get("train", {})
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path}: not TOML ({err})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{path}: [train] has unknown keys {unknown}; known: {sorted(known)}")
        if "target" not in table:
            raise ValueError(f"{path}: [train] needs target = 'module:function'")
        return cls(**table)


def _batches(parts: dict[str, Any], pm: Any, cfg: TrainConfig) -> tuple[Any, Iterator[Any]]:
    """The loader (None for one batch) and this rank's batches, epoch after epoch."""
    from autoshard.data import loader
    from autoshard.runtime import shard_inputs

    if parts.get("dataset") is None:
        return None, itertools.repeat(shard_inputs(parts["batch"], pm))
    feed = loader(parts["dataset"], pm, cfg.batch_size, seed=cfg.seed)
    return feed, itertools.chain.from_iterable(itertools.repeat(feed))


def _parallel(parts: dict[str, Any], example: tuple, cfg: TrainConfig) -> Any:
    from autoshard.runtime import parallelize

    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = None if cfg.plan else cfg.mesh(world)
    return parallelize(
        parts["model"], example, mesh, loss_fn=parts.get("loss_fn"), options=cfg.options()
    )


def _work(example: tuple, pm: Any, cfg: TrainConfig) -> tuple[float, str, int]:
    """The model FLOPs of a step (forward and backward of the global batch), what a
    throughput counts (tokens: the first integer input of two or more dims, else samples)
    and how many of them a step has."""
    flops = pm.flops_per_step
    inputs = example.values() if isinstance(example, dict) else example
    ids = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if ids is not None and not ids.is_floating_point():
        return flops, "tokens", ids.numel()
    return flops, "samples", cfg.batch_size


_CLEAR = "\r\033[K"  # back to the start of the terminal's line, and clear it


class _Log:
    """Rank 0's metrics: a JSONL line per step, a printed line every ``every`` steps (with a
    progress bar on a terminal, redrawn every step), and TensorBoard scalars when it is
    installed."""

    def __init__(self, cfg: TrainConfig, loud: bool) -> None:
        self.loud, self.every, self.board = loud, cfg.log_every, None
        self.bar = loud and sys.stdout.isatty()
        self.path, self.file = Path(cfg.log), None  # opened by ``start``
        if loud:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.board = SummaryWriter(str(Path(cfg.log).with_suffix("")) + "-tensorboard")
            except ImportError:
                pass

    def start(self, step: int) -> None:
        """Open the JSONL log for a run that begins after ``step`` (``open_log``)."""
        if self.loud:
            self.file = open_log(self.path, step)
            if step:
                self.say(f"metrics log {self.path} continues after step {step}")

    def say(self, text: str) -> None:
        if self.loud:
            print(f"{_CLEAR if self.bar else ''}autoshard train: {text}", flush=True)

    def step(self, record: dict[str, Any], total: int) -> None:
        if not self.loud:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            rate = f"{record['unit']}_per_s"
            for key in ("loss", "step_s", rate, "mfu", "bytes_sent", "memory_bytes"):
                self.board.add_scalar(key, record[key], record["step"])
        unit = record["unit"]
        line = (
            f"step {record['step']}/{total} loss {record['loss']:.6f} "
            f"{record['step_s'] * 1e3:.1f} ms/step {record[unit + '_per_s']:,.1f} {unit}/s "
            f"MFU {record['mfu']:.1%} memory {human_bytes(record['memory_bytes'])}/rank "
            f"(peak RSS {record['peak_rss_bytes'] / 2**20:.0f} MiB) "
            f"sent {record['bytes_sent'] / 1024:.1f} KiB/rank"
        )
        if record["step"] % self.every == 0 or record["step"] == total:
            self.say(line)
        elif self.bar:
            done = 24 * record["step"] // total
            print(f"{_CLEAR}[{'#' * done:<24}] {line}", end="", flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def worker(cfg: TrainConfig) -> None:
    """One rank's run: plan, resume from the newest whole checkpoint, train, log, checkpoint."""
    from autoshard import comm, watch
    from autoshard.cli.user_fn import parts_of, train_example, user_function
    from autoshard.cost import cluster_spec
    from autoshard.runtime import clip_grad_norm_, save
    from autoshard.supervisor import record_step
    from autoshard.testing import peak_resident_bytes

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(cfg.seed)  # the same model on every rank, and from run to run
    parts = parts_of(user_function(cfg.target), cfg.target)
    if cfg.servers:
        _parameter_servers(cfg, parts)
        return
    example = train_example(parts, cfg.batch_size)
    pm = _parallel(parts, example, cfg)
    opt = torch.optim.AdamW(pm.parameters(), lr=cfg.lr, **parts.get("optimizer", {}))
    feed, batches = _batches(parts, pm, cfg)
    log = _Log(cfg, pm.rank == 0)
    for line in _described(pm):
        log.say(line)
    start = _resume(cfg, pm, opt, feed, log)
    log.start(start)
    flops, unit, per_step = _work(example, pm, cfg)
    # the cluster's peak of one device, in the dtype the model computes in, for each rank
    dtype = pm.precision.compute or torch.float32
    peak = cluster_spec(cfg.cluster).peak_flops(dtype) * int(os.environ.get("WORLD_SIZE", "1"))
    for step in range(start, cfg.steps):
        watch.step(step + 1)
        watch.doing("reading its batch")
        batch = next(batches)
        began = time.perf_counter()
        with comm.counting() as sent:
            loss = pm(**batch) if isinstance(batch, dict) else pm(*batch)
            loss.backward()
            norm = clip_grad_norm_(pm, cfg.clip) if cfg.clip else None
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - began
        record = {
            "step": step + 1,
            "loss": loss.item(),
            "step_s": seconds,
            "unit": unit,
            f"{unit}_per_s": per_step / seconds,
            "mfu": flops / seconds / peak,
            "memory_bytes": sum(pm.state_bytes(opt).values()),
            "peak_rss_bytes": peak_resident_bytes(),
            "bytes_sent": sum(c["bytes"] for c in sent.values()),
            "grad_norm": None if norm is None else float(norm),
        }
        log.step(record, cfg.steps)
        if pm.rank == 0:
            record_step(step + 1)
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            watch.doing("saving a checkpoint")
            save(Path(cfg.checkpoint_dir) / f"step{step + 1}", pm, opt, step=step + 1, loader=feed)
    _finish(cfg, pm, log)


def _parameter_servers(cfg: TrainConfig, parts: dict[str, Any]) -> None:
    """``--servers S``: the first S ranks hold the model's tables by rows, the others train
    on their part of each global batch (``autoshard.ps``); the first worker prints the loss
    every ``log_every`` steps and the rows it moved."""
    from autoshard import ps

    config = ps.PSConfig(
        cfg.servers, staleness=cfg.staleness, dense_lr=cfg.lr, timeout_s=cfg.timeout
    )
    data = parts["batch"] if parts.get("dataset") is None else parts["dataset"]
    workers = int(os.environ.get("WORLD_SIZE", "1")) - cfg.servers
    loud = int(os.environ.get("RANK", "0")) == cfg.servers
    began = [time.perf_counter()]  # the last step's end

    def on_step(step: int, loss: float) -> None:
        seconds, began[0] = time.perf_counter() - began[0], time.perf_counter()
        if loud and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
            print(
                f"autoshard train: step {step + 1}/{cfg.steps} loss {loss:.6f} "
                f"{seconds * 1e3:.1f} ms/step",
                flush=True,
            )

    result = ps.train(
        lambda: parts["model"],
        ps.split_batches(data, cfg.batch_size, workers),
        cfg.steps,
        config,
        on_step,
    )
    if loud:
        moved = sum(result["pulled_bytes"]) / max(len(result["pulled_bytes"]), 1)
        print(
            f"autoshard train: {cfg.servers} server(s), {workers} worker(s); worker 0 pulled "
            f"and pushed {moved / 1024:.1f} KiB of rows a step",
            flush=True,
        )


def _finish(cfg: TrainConfig, pm: Any, log: _Log) -> None:
    """The log closed, every rank waited for, the metrics drawn (``--picture``)."""
    from autoshard import comm, watch

    log.close()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        watch.doing("finishing")
        comm.barrier()  # a rank still training is waited for here, and named if it never ends
    if cfg.picture and pm.rank == 0:
        from autoshard.pictures import metrics_picture

        log.say(f"picture of the metrics: {metrics_picture(cfg.log, cfg.picture)}")


def _described(pm: Any) -> list[str]:
    """The plan this run trains under: its mesh, ZeRO stage and pipeline schedule, then how
    its experts are spread and how attention computes over a split sequence, where it has
    them."""
    from autoshard.plan_text import experts
    from autoshard.search.plans import attention_methods

    mesh = pm.plan.mesh.describe()
    if pm.whole_batch:  # pipeline stages, each on the mesh above
        s = pm.schedule
        mesh = f"pp({s.num_ranks}) x {mesh}, {s.name}, {s.microbatches} micro-batches"
    zero = pm.plan.zero  # the stage run: the one given, else the searched plan's
    zero = zero if isinstance(zero, int) else max(dict(zero).values(), default=0)
    units = pm.zero_units
    if zero and not any(fqn in units for fqn in pm.plan.params):
        zero = f"{zero} (nothing to shard under this plan)"
    head = f"plan over {os.environ.get('WORLD_SIZE', 1)} rank(s): {mesh}, ZeRO {zero}"
    try:
        return [head, *experts(pm.plan), *attention_methods(pm.plan)]
    except (AttributeError, KeyError):  # a stage's plan without its whole graph
        return [head]


def _resume(cfg: TrainConfig, pm: Any, opt: Any, feed: Any, log: _Log) -> int:
    """The step to start from: the newest whole checkpoint's, else 0 (``runtime.resume``)."""
    from autoshard.runtime import resume

    if not cfg.checkpoint_dir:
        return 0
    if cfg.restart:
        log.say(f"--restart: training from step 1, not from {cfg.checkpoint_dir}")
        return 0
    step, failed = resume(cfg.checkpoint_dir, pm, opt, feed, log.say)
    if not step:
        check_checkpoints(cfg, failed)  # damaged ones and no whole one: not from step 1
    return step


def check_checkpoints(cfg: TrainConfig, failed: list[str] | tuple = ()) -> None:
    """A checkpoint directory whose checkpoints are all damaged does not restart the run
    from step 1 unasked: a ValueError naming each and why (``failed``: those that failed to
    load, and why), unless ``restart`` starts over on purpose."""
    from autoshard.runtime import unresumable

    listed = (
        [] if not cfg.checkpoint_dir or cfg.restart else unresumable(cfg.checkpoint_dir, failed)
    )
    if listed:
        raise ValueError(
            f"--checkpoint-dir {cfg.checkpoint_dir} has no whole checkpoint to resume from: "
            f"{'; '.join(listed)}; --restart trains from step 1 over them"
        )


def launch(cfg: TrainConfig, nproc: int, torchrun_args: list[str]) -> int:
    """:func:`worker` on ``nproc`` ranks of this node under torchrun (``supervisor``), its
    report beside the metrics log. The settings travel in the environment as JSON: torchrun
    would read the options of ours that look like its own (``--log``) as its own."""
    from autoshard.supervisor import supervise

    def stopped(step: str) -> str:
        return f"autoshard train: stopped at step {step}; {_last_checkpoint(cfg)}"

    settings = {WORKER: json.dumps(dataclasses.asdict(cfg))}
    report = Path(cfg.log).parent / "autoshard-torchrun.log"
    return supervise("autoshard.cli.train", nproc, torchrun_args, settings, report, stopped)


def _last_checkpoint(cfg: TrainConfig) -> str:
    """Where a stopped run can go on from: its newest whole checkpoint."""
    if not cfg.checkpoint_dir:
        return "no checkpoints were asked for (--checkpoint-dir)"
    from autoshard.runtime import latest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = latest(cfg.checkpoint_dir)
    return f"the last checkpoint is {found}" if found else "no checkpoint was written"


__all__ = ["TrainConfig", "check_checkpoints", "launch", "worker"]

if __name__ == "__main__":  # a rank torchrun started (launch)
    from autoshard.supervisor import run_rank

    cfg = TrainConfig(**json.loads(os.environ[WORKER]))
    sys.exit(run_rank(lambda: worker(cfg)))
