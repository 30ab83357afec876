"""``autoshard train``: the user's own model, planned and trained on the ranks torchrun starts.

``autoshard train mymodule:make --nproc-per-node 2`` (or a TOML file whose ``[train]`` table
holds the same settings, ``target`` included) starts torchrun, which runs this module's
:func:`worker` on every rank. The function returns ``(model, data)`` or ``(model, data,
loss_fn)``, or a dict with ``model``, ``dataset`` or ``batch``, and optionally ``loss_fn`` and
``optimizer`` (AdamW's keyword arguments). ``data`` is a map-style dataset of samples (each
rank reads its shard of every global batch) or one global batch, trained on again and again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

WORKER = "AUTOSHARD_TRAIN"  # the settings, as JSON, on the ranks launch() starts


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

    @classmethod
    def from_toml(cls, path: str) -> TrainConfig:
        """The ``[train]`` table of a TOML file; unknown keys are an error naming them."""
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


def user_function(target: str) -> Any:
    """``module:function`` from the current directory or the installed packages, called."""
    import importlib

    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise ValueError(f"{target!r}: expected module:function, e.g. mymodels:make")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"{target!r}: no module {err.name!r} (looked in {os.getcwd()} and the installed "
            "packages)"
        ) from err
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{target!r}: {module_name} has no function {name!r}")
    return getattr(module, name)()


def _parts(made: Any, target: str) -> dict[str, Any]:
    """The user function's result as ``model``, ``dataset`` or ``batch``, ``loss_fn``,
    ``optimizer``."""
    if isinstance(made, dict):
        parts = dict(made)
    elif isinstance(made, tuple | list) and len(made) in (2, 3):
        parts = {"model": made[0], "data": made[1], "loss_fn": made[2] if len(made) > 2 else None}
    else:
        raise ValueError(f"{target}: return (model, data[, loss_fn]) or a dict, not {made!r:.80}")
    data = parts.pop("data", None)
    if data is not None:
        batch = isinstance(data, tuple | list) and all(isinstance(t, torch.Tensor) for t in data)
        parts["batch" if batch else "dataset"] = tuple(data) if batch else data
    if not isinstance(parts.get("model"), torch.nn.Module):
        raise ValueError(f"{target}: no nn.Module under 'model'")
    if parts.get("dataset") is None and parts.get("batch") is None:
        raise ValueError(f"{target}: give a dataset or an example batch")
    return parts


def _batches(parts: dict[str, Any], pm: Any, cfg: TrainConfig) -> tuple[Any, Iterator[Any]]:
    """The loader (None for one batch) and this rank's batches, epoch after epoch."""
    from autoshard.data import loader
    from autoshard.runtime import shard_inputs

    if parts.get("dataset") is None:
        local = shard_inputs(parts["batch"], pm)
        return None, iter(lambda: local, None)
    feed = loader(parts["dataset"], pm, cfg.batch_size, seed=cfg.seed)

    def forever() -> Iterator[Any]:
        while True:
            yield from feed

    return feed, forever()


def _example(parts: dict[str, Any], cfg: TrainConfig) -> tuple:
    if parts.get("batch") is not None:
        return parts["batch"]
    from torch.utils.data import default_collate

    dataset = parts["dataset"]
    if len(dataset) < cfg.batch_size:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than --batch-size")
    return tuple(default_collate([dataset[i] for i in range(cfg.batch_size)]))


def _parallel(parts: dict[str, Any], cfg: TrainConfig) -> Any:
    from autoshard.runtime import parallelize

    world = int(os.environ.get("WORLD_SIZE", "1"))
    given = {"plan": cfg.plan} if cfg.plan else {"search": cfg.search, "cluster": cfg.cluster}
    return parallelize(
        parts["model"], _example(parts, cfg), None if cfg.plan else world, parts.get("loss_fn"),
        precision=cfg.precision, zero=cfg.zero or None, seed=cfg.seed, **given,
    )  # fmt: skip


class _Log:
    """Rank 0's metrics: a JSONL line per step, a printed line every ``every`` steps, and
    TensorBoard scalars when it is installed."""

    def __init__(self, cfg: TrainConfig, loud: bool) -> None:
        self.loud, self.every, self.board = loud, cfg.log_every, None
        self.file = open(cfg.log, "a") if loud else None  # noqa: SIM115 (closed in close())
        if loud:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.board = SummaryWriter(str(Path(cfg.log).with_suffix("")) + "-tensorboard")
            except ImportError:
                pass

    def say(self, text: str) -> None:
        if self.loud:
            print(f"autoshard train: {text}", flush=True)

    def step(self, record: dict[str, Any], total: int) -> None:
        if not self.loud:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            for key in ("loss", "step_s", "samples_per_s", "bytes_sent"):
                self.board.add_scalar(key, record[key], record["step"])
        if record["step"] % self.every == 0 or record["step"] == total:
            self.say(
                f"step {record['step']}/{total} loss {record['loss']:.6f} "
                f"{record['step_s'] * 1e3:.1f} ms {record['samples_per_s']:.1f} samples/s "
                f"sent {record['bytes_sent'] / 1024:.1f} KiB/rank"
            )

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def worker(cfg: TrainConfig) -> None:
    """One rank's run: plan, resume from the latest checkpoint, train, log, checkpoint."""
    from autoshard import comm
    from autoshard.runtime import clip_grad_norm_, latest, load, save

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(cfg.seed)  # the same model on every rank, and from run to run
    parts = _parts(user_function(cfg.target), cfg.target)
    pm = _parallel(parts, cfg)
    opt = torch.optim.AdamW(pm.parameters(), lr=cfg.lr, **parts.get("optimizer", {}))
    feed, batches = _batches(parts, pm, cfg)
    log, start = _Log(cfg, pm.rank == 0), 0
    log.say(f"plan over {os.environ.get('WORLD_SIZE', 1)} rank(s): {pm.plan.mesh.describe()}")
    found = latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if found is not None:
        start = load(found, pm, opt, loader=feed)["step"]
        log.say(f"resumed from {found} at step {start}")
    for step in range(start, cfg.steps):
        began = time.perf_counter()
        with comm.counting() as sent:
            loss = pm(*next(batches))
            loss.backward()
            norm = clip_grad_norm_(pm, cfg.clip) if cfg.clip else None
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - began
        record = {
            "step": step + 1, "loss": loss.item(), "step_s": seconds,
            "samples_per_s": cfg.batch_size / seconds,
            "bytes_sent": sum(c["bytes"] for c in sent.values()),
            "grad_norm": None if norm is None else float(norm),
        }  # fmt: skip
        log.step(record, cfg.steps)
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save(Path(cfg.checkpoint_dir) / f"step{step + 1}", pm, opt, step=step + 1, loader=feed)
    log.close()
    if cfg.picture and pm.rank == 0:
        from autoshard.pictures import metrics_picture

        log.say(f"picture of the metrics: {metrics_picture(cfg.log, cfg.picture)}")


#: torchrun's own log lines (its banner, its notes on the ranks it watches)
_TORCHRUN_LOG = re.compile(r"^[DIWE]\d{4} [\d:.]+ +\d+ .*torch/distributed/(run|elastic)/")
#: the line after which torchrun only tells how the ranks failed (its traceback, its summary)
_TORCHRUN_FAILED = re.compile(r"torch/distributed/elastic/.*failed \(exitcode")


def launch(cfg: TrainConfig, nproc: int, torchrun_args: list[str]) -> int:
    """Run :func:`worker` on ``nproc`` ranks of this node under torchrun. The settings travel
    in the environment as JSON: torchrun would read the options of ours that look like its
    own (``--log``) as its own. The ranks' output comes through as it is, torchrun's own
    log is left out; when a rank fails, what torchrun reports goes to a file named in one
    line (unless a rank has already said what went wrong in one)."""
    import subprocess

    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        *torchrun_args, "-m", "autoshard.cli.train",
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", **os.environ, WORKER: json.dumps(dataclasses.asdict(cfg))}
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as proc:
        report, told = _relay(proc.stderr)
    if proc.returncode and report:
        path = Path(cfg.log).parent / "autoshard-torchrun.log"  # beside the metrics
        path.write_text("".join(report))
        if not told:
            print(
                f"autoshard: error: training stopped, a rank exited with code "
                f"{proc.returncode} (its output is above; torchrun's report: {path})",
                file=sys.stderr,
            )
    return proc.returncode


def _relay(stream: Any) -> tuple[list[str], bool]:
    """Copy the ranks' lines of torchrun's stderr to ours; return torchrun's failure report
    and whether a rank printed an ``autoshard: error:`` line."""
    report: list[str] = []
    told = False
    for line in stream:
        if report or _TORCHRUN_FAILED.search(line):
            report.append(line)
        elif not _TORCHRUN_LOG.match(line):
            told = told or "autoshard: error:" in line
            sys.stderr.write(line)
            sys.stderr.flush()
    return report, told


__all__ = ["TrainConfig", "launch", "worker"]

if __name__ == "__main__":  # a rank torchrun started (launch)
    worker(TrainConfig(**json.loads(os.environ[WORKER])))
