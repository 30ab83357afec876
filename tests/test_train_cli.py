"""``autoshard train``'s surface (README, docs/failures.md): a signal to the launcher stops
torchrun and every rank, and a killed launcher takes them with it; every mistake found
before the ranks start is one line and status 2; a directory of damaged checkpoints is not a
silent start from step 1; the parallel degrees and layouts given on the command line train
as plain PyTorch does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_examples import _free_port

MODULE = """
import os
from pathlib import Path

import torch
from autoshard.models import build, reference_config


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i].sum(0, keepdim=True).sin()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def make():
    if "RANK" in os.environ:  # a rank: its pid and its parent's (torchrun)
        text = f"{os.getpid()} {os.getppid()}"
        (Path(os.environ["PIDS"]) / os.environ["RANK"]).write_text(text)
    return Net(), Data()


def llama():
    return reference(), CONFIG.example_batch(4)


def moe():
    return reference("moe"), MOE.example_batch(4)


def reference(name="llama"):
    return build(MOE if name == "moe" else CONFIG)


SHAPE = dict(layers=2, hidden=32, heads=4, kv_heads=None, ffn=None, vocab=64, seq=16)
CONFIG = reference_config("llama", **SHAPE, experts=None, top_k=None)
MOE = reference_config("moe", **SHAPE, experts=4, top_k=2)
"""


def _command(tmp_path: Path, *argv: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PIDS": str(tmp_path)}
    (tmp_path / "usermodel.py").write_text(MODULE)
    command = [sys.executable, "-m", "autoshard.cli", "train", *argv]
    command += ["--master-port", str(_free_port()), "--log", str(tmp_path / "log.jsonl")]
    return command, env


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    command, env = _command(tmp_path, *argv)
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_launcher_leaves_no_rank_running(tmp_path) -> None:
    """Ctrl-C (SIGINT), SIGTERM or SIGHUP to ``autoshard train`` a few steps in: one line saying at
    which step it stopped and where its last checkpoint is, status 128 + the signal, and
    torchrun and both ranks gone within 30 s. SIGKILL of the launcher (no handler runs):
    torchrun and the ranks notice it is gone and end within 30 s. The four runs are launched
    side by side, each stopped by its signal once its checkpoint of step 5 is written."""
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        (tmp_path / sig.name).mkdir()
        runs[sig] = _stoppable(tmp_path / sig.name)
    stopped = {}
    deadline = time.time() + 300
    while len(stopped) < len(runs) and time.time() < deadline:
        for sig, (directory, proc) in runs.items():
            if sig in stopped:
                continue
            assert proc.poll() is None, (sig, proc.communicate())
            if (directory / "ckpt" / "step5").is_dir():
                pids = [int(p) for r in "01" for p in (directory / r).read_text().split()]
                assert all(_alive(p) for p in pids), sig
                proc.send_signal(sig)
                stopped[sig] = (time.time(), pids)
        time.sleep(0.2)
    assert len(stopped) == len(runs), (
        f"no checkpoint of step 5 in 300 s: {set(runs) - set(stopped)}"
    )
    for sig, (directory, proc) in runs.items():
        _stopped_whole(sig, directory, proc, *stopped[sig])


def _stoppable(directory: Path) -> tuple[Path, subprocess.Popen]:
    """``autoshard train`` on 2 ranks for many steps, a checkpoint every 5, started."""
    argv = ["usermodel:make", "--nproc-per-node", "2", "--steps", "100000", "--batch-size", "8"]
    argv += ["--checkpoint-dir", str(directory / "ckpt"), "--checkpoint-every", "5"]
    command, env = _command(directory, *argv)
    pipe = subprocess.PIPE
    proc = subprocess.Popen(command, cwd=directory, env=env, stdout=pipe, stderr=pipe, text=True)
    return directory, proc


def _stopped_whole(sig, directory: Path, proc: subprocess.Popen, when: float, pids: list) -> None:
    """The launcher stopped by ``sig`` at ``when``: every process of its run gone within 30 s,
    and (but for SIGKILL) its one line and status."""
    out, err = proc.communicate(timeout=60)
    while any(_alive(p) for p in pids) and time.time() - when < 30:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], (sig, pids, err)
    if sig == signal.SIGKILL:
        return
    assert proc.returncode == 128 + sig, (sig, err)
    assert "Traceback" not in err and "torch" not in err, (sig, err)
    last = out.strip().splitlines()[-1]
    step = int(last.split("stopped at step ")[1].split(";")[0])
    log = directory / "log.jsonl"
    assert step >= 5 and step >= len(log.read_text().splitlines()) - 1, (sig, out)
    assert last.startswith("autoshard train: stopped at step "), (sig, out)
    assert "; the last checkpoint is " + str(directory / "ckpt" / "step") in last, (sig, out)
    assert not (directory / "autoshard-torchrun.log").exists(), sig


def _fails_before_any_rank(monkeypatch, capsys, *argv: str) -> str:
    """The one line ``autoshard train`` exits with, status 2, torchrun never started."""
    from autoshard.cli import train
    from autoshard.cli.main import main

    def started(*_):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(train, "launch", started)
    with pytest.raises(SystemExit) as ended:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("autoshard: error: "), err
    return err.strip().removeprefix("autoshard: error: ")


def test_every_train_mistake_is_one_line_and_status_2_before_any_rank(
    tmp_path, monkeypatch, capsys
) -> None:
    """An unknown cluster preset, a file that is not a plan, a plan of another model or
    another world size, micro-batches that do not divide the batch, a degree that does not
    divide the ranks, no ranks a node: each one line and status 2 from the launcher. The
    ``cpu`` preset takes any count of local ranks."""
    import autoshard
    from autoshard.cli.train import TrainConfig
    from autoshard.cli.train_check import check
    from autoshard.cost import cluster_spec

    (tmp_path / "usermodel.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodel

    (tmp_path / "notaplan.json").write_text(json.dumps({"mesh": {"dp": 2}}))
    torch.manual_seed(0)
    autoshard.plan(usermodel.reference(), usermodel.CONFIG.example_batch(4), "cpu",
                   num_devices=2).save(tmp_path / "llama2.json")  # fmt: skip
    cases = {
        ("usermodel:make", "--cluster", "nosuch"): "cluster 'nosuch': not a preset",
        (
            "usermodel:make",
            "--plan",
            "notaplan.json",
        ): "plan file 'notaplan.json': field 'format' is None",
        ("usermodel:make", "--plan", "llama2.json", "--nproc-per-node", "2"): (
            "plan llama2.json does not fit this model (made for another?)"
        ),
        ("usermodel:llama", "--plan", "llama2.json", "--nproc-per-node", "4"): (
            "plan 'llama2.json' is for 2 devices; this run has 4 ranks"
        ),
        ("usermodel:make", "--nproc-per-node", "2", "--pp", "2", "--microbatches", "3"): (
            "--microbatches 3 does not divide the batch of 8 samples"
        ),
        ("usermodel:make", "--nproc-per-node", "2", "--tp", "3"): (
            "--tp 3: the ranks must be a multiple of 3; this run has 2"
        ),
        ("usermodel:make", "--nproc-per-node", "0"): "--nproc-per-node 0: at least 1 rank",
        ("usermodel:make", "--nproc-per-node", "3", "--cluster", "dgx-h100", "--nnodes", "2"): (
            "--cluster dgx-h100: its nodes have 8 devices, --nproc-per-node 3 on 2 nodes"
        ),
    }
    cases[("usermodel:make", "--nproc-per-node", "12", "--cluster", "dgx-h100")] = (
        "--cluster dgx-h100: 12 devices is not a whole number of 8-device nodes of dgx-h100"
    )
    for argv, message in cases.items():
        assert _fails_before_any_rank(monkeypatch, capsys, *argv).startswith(message), argv
    check(TrainConfig("usermodel:make"), nproc=3)  # three local ranks of the cpu preset
    assert cluster_spec(TrainConfig("m:f").run_cluster(per_node=3), 3).num_devices == 3


def test_every_parameter_server_mistake_is_one_line_before_any_rank(
    tmp_path, monkeypatch, capsys
) -> None:
    """``--servers``: no worker left, a batch that does not split over the workers, a flag
    that plans or shards the dense part, ``--staleness`` alone, a model without tables."""
    (tmp_path / "usermodel.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        ("--servers", "2", "--nproc-per-node", "2"): (
            "--servers 2 leaves no worker of this run's 2 ranks"
        ),
        ("--servers", "1", "--nproc-per-node", "3", "--batch-size", "7"): (
            "--batch-size 7 does not split over the 2 workers"
        ),
        ("--servers", "1", "--nproc-per-node", "3", "--tp", "2", "--zero", "1"): (
            "--servers trains the dense part data parallel in float32 among the workers; "
            "leave out --tp, --zero"
        ),
        ("--staleness", "1", "--nproc-per-node", "2"): (
            "--staleness 1 is for parameter servers: give --servers"
        ),
        ("--servers", "1", "--nproc-per-node", "3"): "Net has no table for servers to hold",
        (
            "--servers",
            "-1",
        ): "train settings out of range: servers = -1",
    }
    for argv, message in cases.items():
        got = _fails_before_any_rank(monkeypatch, capsys, "usermodel:make", *argv)
        assert got.startswith(message), (argv, got)


def test_a_directory_of_damaged_checkpoints_is_not_a_silent_restart(
    tmp_path, monkeypatch, capsys
) -> None:
    """Every checkpoint damaged (one cut short, one whose manifest is garbled): one line
    naming each and why, status 2, no rank started; ``--restart`` starts over on purpose,
    and a whole checkpoint beside damaged ones is resumed from."""
    from autoshard.cli.train import TrainConfig
    from autoshard.cli.train_check import check

    (tmp_path / "usermodel.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = tmp_path / "ckpt"
    for step, manifest in (("step5", "{not json"), ("step10", None)):
        (ckpt / step).mkdir(parents=True)
        (ckpt / step / "shard0").write_bytes(b"x" * 10)
        record = {"format": "autoshard-checkpoint/2", "step": 10,
                  "files": {"shard0": {"bytes": 40, "crc32": "00000000"}}}  # fmt: skip
        (ckpt / step / "autoshard.json").write_text(manifest or json.dumps(record))
    argv = ["usermodel:make", "--checkpoint-dir", "ckpt", "--nproc-per-node", "2"]
    message = _fails_before_any_rank(monkeypatch, capsys, *argv)
    assert message.startswith("--checkpoint-dir ckpt has no whole checkpoint to resume from: ")
    assert "ckpt/step10 (shard0 is 10 bytes, the manifest recorded 40)" in message
    assert "ckpt/step5 (its autoshard.json cannot be read" in message
    assert message.endswith("--restart trains from step 1 over them")
    check(TrainConfig("usermodel:make", checkpoint_dir="ckpt", restart=True), nproc=2)
    (ckpt / "step10" / "shard0").write_bytes(b"x" * 40)  # now whole by its sizes
    check(TrainConfig("usermodel:make", checkpoint_dir="ckpt"), nproc=2)


#: each run: its target, its flags, and what the plan printed names
FLAG_RUNS = {
    "cp": (
        "llama",
        ["--cp", "2", "--attention", "ring", "--zero", "1"],
        ["cp(2)", "ZeRO 1", "attention over a split sequence: ring"],
    ),
    "ep": ("moe", ["--ep", "2"], ["ep(2)", "experts layers.*"]),
    "tp": ("llama", ["--tp", "2", "--sequence-parallel"], ["tp(2)"]),
}


def _launched(monkeypatch, *argv: str) -> dict:
    """The settings ``autoshard train`` hands torchrun's ranks for ``argv``, after its
    checks before any rank starts (torchrun itself not started)."""
    import dataclasses

    from autoshard.cli import train
    from autoshard.cli.main import main

    handed = []
    monkeypatch.setattr(train, "launch", lambda cfg, *_: handed.append(cfg) or 0)
    assert main(["train", *argv]) == 0
    return dataclasses.asdict(handed[0])


def _trained(settings: dict[str, dict]) -> dict[str, str]:
    """On each rank, each run's settings trained in turn as a rank torchrun starts trains
    them (``worker``); what each run printed."""
    import contextlib
    import io

    from autoshard.cli.train import TrainConfig, worker

    printed = {}
    for name, fields in settings.items():
        with contextlib.redirect_stdout(io.StringIO()) as out:
            worker(TrainConfig(**fields))
        printed[name] = out.getvalue()
    return printed


def test_the_parallel_flags_train_as_plain_pytorch(tmp_path, monkeypatch) -> None:
    """``--cp``/``--attention``, ``--ep``, ``--tp``/``--sequence-parallel`` and ``--zero``:
    the command line hands them to the ranks, and on 2 CPU ranks (one spawn for the three
    runs) the plan printed names the mesh, the ZeRO stage and the attention's and experts'
    layouts, and every step's loss is plain PyTorch's (the model's eager forward and
    backward, torch.optim.AdamW) on the same batch."""
    from autoshard.testing import run_ranks

    (tmp_path / "usermodel.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = {}
    for name, (target, flags, _) in FLAG_RUNS.items():
        log = str(tmp_path / f"{name}.jsonl")
        argv = [f"usermodel:{target}", "--nproc-per-node", "2", "--steps", "3", "--log", log]
        settings[name] = _launched(monkeypatch, *argv, *flags)
        for flag in flags[::2]:  # each flag given reached the ranks' settings
            assert settings[name][flag[2:].replace("-", "_")] not in (None, False), flag
    printed = run_ranks(_trained, 2, settings, timeout=300)[0]
    import usermodel

    for name, (target, _, shown) in FLAG_RUNS.items():
        plan = [line for line in printed[name].splitlines() if "step " not in line]
        assert plan[0].startswith("autoshard train: plan over 2 rank(s): "), printed[name]
        for text in shown:
            assert any(text in line for line in plan), (name, text, printed[name])
        log = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        losses = [json.loads(line)["loss"] for line in log]
        torch.manual_seed(0)
        model, batch = getattr(usermodel, target)()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        expected = []
        for _ in range(3):
            loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            expected.append(loss.item())
        assert losses == pytest.approx(expected, rel=1e-4, abs=1e-5), (name, losses, expected)
