"""The examples run as their docstrings say, and train as one device would."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from autoshard import single_device

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the examples whose tests run them under torchrun, in the tests' order, and their steps
TORCHRUNS = {"train_loop": 4, "transformers_gpt2": 3, "pipeline": 4, "experts": 3, "offload": 3}
_STARTED: dict[str, subprocess.Popen] = {}
_SELECTED: set[str] = set()  # the TORCHRUNS this session's selected tests run


@pytest.fixture(scope="module", autouse=True)
def _torchruns(request) -> Iterator[None]:
    """Which examples this session's tests launch; any launch left when the module ends
    (its test failed first) is stopped."""
    sources = {
        item.name: inspect.getsource(item.function)
        for item in request.session.items
        if item.module is sys.modules[__name__]
    }
    _SELECTED.update(s for s in TORCHRUNS for src in sources.values() if f'"{s}"' in src)
    yield
    for proc in _STARTED.values():
        proc.kill()
        proc.wait()
    _STARTED.clear()


def _start_torchrun(script: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), str(EXAMPLES / f"{script}.py"),
        "--steps", str(TORCHRUNS[script]),
    ]  # fmt: skip
    pipe = subprocess.PIPE
    return subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe, text=True)


def _torchrun(script: str) -> tuple[str, list[float]]:
    """``torchrun --nproc-per-node 2 examples/<script>.py --steps N``: its output and losses.
    The next selected example is launched before this one is waited for: a launch leaves a
    core idle while torchrun imports torch and while its two ranks wait on each other."""
    following = [s for s in list(TORCHRUNS)[list(TORCHRUNS).index(script) :] if s in _SELECTED]
    for name in [script, *following[1:2]]:
        if name not in _STARTED:
            _STARTED[name] = _start_torchrun(name)
    proc = _STARTED.pop(script)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", stdout, re.M)]
    assert len(losses) == TORCHRUNS[script]
    return stdout, losses


def _one_device(model: torch.nn.Module, batches: list[tuple]) -> list[float]:
    one = single_device(model, batches[0])
    optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = one(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_plain_loop_under_torchrun_needs_no_init_process_group_and_matches_one_device():
    out, losses = _torchrun("train_loop")
    assert "plan over 2 rank(s)" in out
    example = _module("train_loop")
    model, config = example.make_model()
    expected = _one_device(model, [example.batch_of(config, step) for step in range(4)])
    assert losses == pytest.approx(expected, rel=1e-5)


def test_the_transformers_example_under_torchrun_matches_one_device():
    pytest.importorskip("transformers")
    _, losses = _torchrun("transformers_gpt2")
    example = _module("transformers_gpt2")
    expected = _one_device(example.build(), [example.batch_at(step) for step in range(3)])
    assert losses == pytest.approx(expected, rel=1e-5)


def _plain_pytorch(name: str, steps: int) -> list[float]:
    """The example's model stepped eagerly by torch.optim on its global batches."""
    example = _module(name)
    model, config = example.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = []
    for step in range(steps):
        loss = model(*example.batch_of(config, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    return expected


def test_the_pipeline_example_under_torchrun_trains_as_plain_pytorch():
    _, losses = _torchrun("pipeline")
    assert losses == pytest.approx(_plain_pytorch("pipeline", 4), rel=1e-5)


def test_the_experts_example_under_torchrun_trains_as_plain_pytorch():
    out, losses = _torchrun("experts")
    assert "experts per rank: 4 of 8" in out
    assert losses == pytest.approx(_plain_pytorch("experts", 3), rel=1e-5)


def test_the_offload_example_under_torchrun_trains_as_plain_pytorch():
    out, losses = _torchrun("offload")
    assert "device: optimizer 0 bytes" in out  # the shards' and the rest's state: the host's
    assert losses == pytest.approx(_plain_pytorch("offload", 3), rel=1e-5)


def _train_command(argv: list[str], log: Path) -> tuple[list[str], dict[str, str]]:
    command = [sys.executable, "-m", "autoshard.cli", "train", "train_fn:make", "--batch-size", "8"]
    command += ["--nproc-per-node", "2"]
    command += ["--master-port", str(_free_port()), "--log", str(log), "--log-every", "1", *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return command, env


def _losses(log: Path) -> list[float]:
    """The losses of a JSONL metrics file (a run killed while writing leaves half a line)."""
    lines = log.read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.endswith("}") and '"loss"' in line]


def _train(argv: list[str], tmp_path: Path, log: Path | None = None) -> tuple[str, list[float]]:
    log = log or tmp_path / f"log{len(list(tmp_path.glob('log*')))}.jsonl"
    command, env = _train_command(argv, log)
    out = subprocess.run(
        command, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for line in log.read_text().splitlines():  # a GPT fed token ids: tokens/s, MFU, memory
        record = json.loads(line)
        if "resumed_after_step" in record:  # where a resumed run's records begin
            continue
        assert record["unit"] == "tokens" and record["tokens_per_s"] > 0, record
        assert 0 < record["mfu"] < 1 and record["memory_bytes"] > 0, record
    return out.stdout, _losses(log)


def _kill_at_a_checkpoint(argv: list[str], directory: Path, log: Path) -> int:
    """Start ``autoshard train``, kill it (torchrun and its ranks, SIGKILL) once a complete
    checkpoint of step 6 or later is in ``directory``; the step of the latest one."""
    from autoshard import latest

    command, env = _train_command(argv, log)
    errors = log.with_suffix(".stderr")
    with errors.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=EXAMPLES, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    deadline = time.monotonic() + 240
    killed = []
    try:
        while (found := latest(directory)) is None or int(found.name.removeprefix("step")) < 6:
            assert proc.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "no checkpoint of step 6 in 240 s"
            time.sleep(0.05)
    finally:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun's ranks have own sessions
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    step = int(latest(directory).name.removeprefix("step"))
    while time.monotonic() < deadline and not all(_ended(pid) for pid in killed):
        time.sleep(0.05)
    assert all(_ended(pid) for pid in killed), "a killed process of the run lives on"
    assert latest(directory).name == f"step{step}"  # nothing of the run wrote after it
    return step


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children before their children."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(0), [])
        found += children
        todo += children
    return found


def test_autoshard_train_killed_resumes_from_the_latest_checkpoint_as_if_never_stopped(tmp_path):
    """Killed mid-run (every process, no chance to clean up), ``autoshard train`` run again
    resumes from the newest whole checkpoint (the two newest are damaged: they are named and
    passed over) and trains on as the run never stopped: the 4 steps after the checkpoint
    it resumed from are, bitwise, the losses the killed run logged for them."""
    killed = tmp_path / "killed"
    log = tmp_path / "killed.jsonl"  # resumed into the killed run's log: each step once
    newest = _kill_at_a_checkpoint(
        ["--steps", "100000", "--checkpoint-dir", str(killed), "--checkpoint-every", "2"],
        killed,
        log,
    )
    early = _losses(log)
    assert len(early) >= newest  # a step's record is written before its checkpoint
    # the two newest checkpoints damaged (a file cut short): the run before them is resumed
    damaged = [killed / f"step{newest}", killed / f"step{newest - 2}"]
    shards = [sorted(directory.glob("*.distcp"))[-1] for directory in damaged]
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[:-1])
    step = newest - 4
    picture = tmp_path / "metrics.png"
    out, late = _train(
        ["--steps", str(newest), "--checkpoint-dir", str(killed), "--picture", str(picture)],
        tmp_path,
        log,
    )
    assert "plan over 2 rank(s)" in out
    passed = f"passed over damaged checkpoint(s) {damaged[0]} ({shards[0].name} is "
    assert passed in out and f"; {damaged[1]} ({shards[1].name} is " in out, out
    assert f"resumed from {killed / f'step{step}'} at step {step}" in out
    assert f"metrics log {log} continues after step {step}" in out
    steps = [json.loads(line).get("step") for line in log.read_text().splitlines()]
    assert steps == [*range(1, step + 1), None, *range(step + 1, newest + 1)], steps
    assert picture.read_bytes().startswith(b"\x89PNG") and f"metrics: {picture}" in out
    assert late[:step] == early[:step]
    assert len(late) == newest
    # bitwise: parameters, optimizer state and data order as the run that was never stopped
    assert late[step:] == early[step:newest]


def test_autoshard_train_in_pipeline_stages_trains_as_plain_pytorch(tmp_path):
    """``autoshard train --pp 2 --microbatches 4`` (the schedule and recompute searched): the
    loader hands every rank whole global batches, the pipeline cuts them, and each step's loss
    is plain PyTorch's on the same batches (the loader's order) with the same AdamW."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from train_fn import make
    finally:
        sys.path.remove(str(EXAMPLES))
    from autoshard.data import ShardSampler

    out, losses = _train(["--steps", "3", "--pp", "2", "--microbatches", "4"], tmp_path)
    assert "plan over 2 rank(s): pp(2) x " in out and "4 micro-batches" in out, out
    parts = make()
    model, dataset = parts["model"], parts["dataset"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **parts["optimizer"])
    order = list(ShardSampler(len(dataset), 8, 1, 0, seed=0))
    expected = []
    for step in range(3):
        x, y = dataset[order[8 * step : 8 * step + 8]]
        loss = model(x, y)
        loss.backward()
        opt.step(), opt.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5), (losses, expected)


BRANCHY = """
import torch


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.proj(x)
        if h.sum() > 0:  # decided by the data: no graph captures it
            h = h * 2
        return ((h - y) ** 2).mean()


def make():
    return Branchy(), (torch.randn(4, 8), torch.randn(4, 8))
"""


def _failing_train(tmp_path: Path, model_source: str, argv: list[str]) -> str:
    """``autoshard train branchy:make`` on 2 ranks that must fail: its one line of stderr."""
    (tmp_path / "branchy.py").write_text(model_source)
    command, env = _train_command(["--steps", "2", *argv], tmp_path / "log.jsonl")
    command[command.index("train_fn:make")] = "branchy:make"
    out = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_a_capture_failure_under_autoshard_train_is_one_line_from_rank_zero(tmp_path):
    """Two ranks fail to capture a data-dependent `if`: the whole output is one line naming
    the user's source line and the op; the tracebacks and torch's log are in files."""
    line = _failing_train(tmp_path, BRANCHY, [])
    assert line.startswith("autoshard: error: cannot capture module 'Branchy' at ")
    assert "branchy.py:12 in forward: `if h.sum() > 0:" in line
    assert "(op aten.item)" in line and "full log: " in line
    assert (tmp_path / "autoshard-torchrun.log").read_text().strip()


def test_a_plan_for_another_model_under_autoshard_train_is_one_line_from_rank_zero(tmp_path):
    """A plan file whose strategies do not fit the model stops the run with one line (the
    launcher finds it before any rank starts)."""
    plan = {
        "format": "autoshard-plan/1",
        "mesh": {"dp": 2},
        "strategies": {"proj/linear.0": {"space": ["dp", "zz", None]}},
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    fits = BRANCHY.replace("if h.sum() > 0:", "if True:")
    line = _failing_train(tmp_path, fits, ["--plan", "plan.json"])
    assert "autoshard: error: plan plan.json does not fit this model" in line
    assert "axis names ['zz'] are not in mesh axes" in line


def test_the_parameter_server_example_under_torchrun_matches_one_device():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(_free_port()), str(EXAMPLES / "parameter_server.py"),
        "--servers", "2", "--steps", "3",
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out.stdout, re.M)]
    example = _module("parameter_server")
    model = example.make_model()
    tables = [t.weight for t in model.tables]
    dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    optimizers = [torch.optim.Adagrad(tables, lr=0.1), torch.optim.AdamW(dense, lr=1e-2)]
    expected = []
    for step in range(3):
        parts = [example.batch_of(2, worker, step) for worker in range(2)]
        loss = model(*(torch.cat(ts) for ts in zip(*parts, strict=True)))
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)


def test_autoshard_train_with_servers_as_the_parameter_server_page_runs_it():
    """The page's command, as written (a free port added): 2 servers and 2 workers started
    by one ``autoshard train``, whose printed losses are one device's on the same global
    batches (Adagrad on the tables, AdamW on the rest)."""
    page = (EXAMPLES.parent / "docs/parallelism/parameter-server.md").read_text()
    line = re.search(r"^\$ cd examples && (autoshard train parameter_server:make .*)$", page, re.M)
    argv = line.group(1).split()[2:]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "autoshard.cli", "train", *argv]
    command += ["--master-port", str(_free_port())]
    out = subprocess.run(
        command, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    printed = re.findall(r"^autoshard train: step (\d+)/(\d+) loss (\S+) ", out.stdout, re.M)
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    steps, size, every = (int(flags[f]) for f in ("--steps", "--batch-size", "--log-every"))
    assert [int(s) for s, _, _ in printed] == list(range(every, steps + 1, every)), out.stdout
    assert "2 server(s), 2 worker(s)" in out.stdout
    example = _module("parameter_server")
    data, model = example.make()["dataset"], example.make_model()
    tables = [t.weight for t in model.tables]
    dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    lr = float(flags["--lr"])
    optimizers = [torch.optim.Adagrad(tables, lr=0.1), torch.optim.AdamW(dense, lr=lr)]
    expected = []
    for step in range(steps):
        loss = model(*data[step * size : (step + 1) * size])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        expected.append(loss.item())
    losses = [float(loss) for _, _, loss in printed]
    assert losses == pytest.approx(expected[every - 1 :: every], abs=2e-6)
