"""The rank's device (docs/devices.md): chosen once (``parallelize(device=)``, else
``cuda:LOCAL_RANK`` under NCCL, else the CPU), every shard and every tensor the runtime makes
on it whatever device the model was built on; NCCL's own watchdog told the job's timeout; and
the watchdog following the device, where a collective's wait returns before it has run.

The CUDA cases run where CUDA exists and are skipped with the reason where not."""

from __future__ import annotations

import copy
import re
import time
from datetime import timedelta

import pytest
import torch

import autoshard
from autoshard.devices import DeviceError, host_ints, rank_device
from autoshard.mesh import NCCL_ENVIRONMENT, group_timeout, nccl_environment
from autoshard.options import Options
from autoshard.testing import RankFailure, run_ranks
from autoshard.watch import BACKSTOP_S

NO_CUDA = "no CUDA device on this machine: the CUDA path is checked where one is"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


_LOSS = torch.nn.functional.mse_loss


def test_a_device_is_an_option_of_the_run_not_of_the_plan() -> None:
    opts = Options(device="cuda:1")
    assert opts.device == torch.device("cuda", 1)
    assert "device" not in opts.as_json()  # a plan runs on any device
    assert Options(device=torch.device("cpu")).device == torch.device("cpu")


def test_without_a_process_group_the_rank_computes_on_the_cpu() -> None:
    assert rank_device() == torch.device("cpu")
    assert rank_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the device is usable")
def test_a_cuda_device_without_cuda_is_named() -> None:
    with pytest.raises(DeviceError, match="device='cuda:0', but this torch sees no CUDA device"):
        rank_device("cuda:0")
    with pytest.raises(DeviceError, match="no CUDA device"):
        autoshard.parallelize(_mlp(), _batch(), {"dp": 1}, loss_fn=_LOSS, device="cuda")


def test_nccl_is_told_the_timeout_and_keeps_a_user_s_settings() -> None:
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    added = nccl_environment(environ)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert environ == {**NCCL_ENVIRONMENT, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert int(environ["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0  # the flight recorder on
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert group_timeout(None) == timedelta(seconds=600)
    assert group_timeout(30.0) == timedelta(seconds=30.0 + BACKSTOP_S)


def test_the_train_launcher_gives_torchrun_nccl_s_settings(monkeypatch, tmp_path) -> None:
    """``autoshard train`` starts torchrun with NCCL's watchdog settings in its environment
    (the command itself is not run: its environment is what is checked)."""
    import subprocess

    from autoshard.cli.train import TrainConfig, launch

    seen = {}

    class Stop(Exception):
        pass

    def popen(command, env, **_):
        seen.update(env)
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    cfg = TrainConfig(target="x.py", log=str(tmp_path / "log.jsonl"))
    with pytest.raises(Stop):
        launch(cfg, 2, [])
    assert {k: seen[k] for k in NCCL_ENVIRONMENT if k not in _users()} == {
        k: v for k, v in NCCL_ENVIRONMENT.items() if k not in _users()
    }


def test_host_ints_reads_counts_in_one_copy() -> None:
    counts = torch.tensor([[3, 0], [1, 2]])
    assert host_ints([counts.sum(1), counts[1]]) == [[3, 3], [1, 2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_host_ints_stages_cuda_counts_through_pinned_memory() -> None:
    counts = torch.arange(6, device="cuda").reshape(2, 3)
    assert host_ints([counts.sum(1), counts[0]]) == [[3, 12], [0, 1, 2]]


def _users() -> set[str]:
    import os

    return {k for k in NCCL_ENVIRONMENT if k in os.environ}


def _on_the_device(device: str) -> dict:
    """A model built on the CPU and one built on meta, parallelized onto ``device``: where
    their shards, inputs, loss and gradients are, and the loss against one device's."""
    model = _mlp()
    batch = _batch()
    ref = autoshard.single_device(copy.deepcopy(model), batch, _LOSS)
    pm = autoshard.parallelize(model, batch, {"dp": 2}, loss_fn=_LOSS, device=device)
    loss = pm(*autoshard.shard_inputs(batch, pm))
    loss.backward()
    norm = autoshard.clip_grad_norm_(pm, 0.1)
    with autoshard.meta_init():
        meta = _mlp()
    built = autoshard.parallelize(
        meta, batch, {"dp": 2}, loss_fn=_LOSS, device=device, init="reset"
    )
    return {
        "device": str(pm.device),
        "options": str(pm.options.device),
        "tensors": {str(t.device) for t in [*pm.local_tensors().values(), *built.parameters()]},
        "grads": {str(t.grad.device) for t in pm.local_tensors().values()},
        "loss": (str(loss.device), float(loss), float(ref(*batch))),
        "norm": str(norm.device),
    }


def test_every_shard_and_every_tensor_made_is_on_the_rank_s_device() -> None:
    for seen in run_ranks(_on_the_device, 2, "cpu", timeout=120):
        assert seen["device"] == seen["options"] == "cpu"
        assert seen["tensors"] == seen["grads"] == {"cpu"}
        where, loss, want = seen["loss"]
        assert where == seen["norm"] == "cpu" and loss == pytest.approx(want, rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_cpu_model_moves_to_the_cuda_device_shard_by_shard() -> None:
    model, batch = _mlp(), _batch()
    ref = autoshard.single_device(copy.deepcopy(model), batch, _LOSS)
    pm = autoshard.parallelize(model, batch, {"dp": 1}, loss_fn=_LOSS, device="cuda")
    assert {t.device.type for t in pm.local_tensors().values()} == {"cuda"}
    assert next(model.parameters()).device.type == "cpu"  # the model given stays where it was
    loss = pm(*batch)
    loss.backward()
    assert loss.device.type == "cuda"
    torch.testing.assert_close(loss.cpu(), ref(*batch), rtol=1e-5, atol=1e-6)


class _NeverDone:
    """A device marker whose work never completes (a collective stuck on the device)."""

    def query(self) -> bool:
        return False


def _device_laggard(timeout_s: float) -> None:
    """Rank 0 issues a sum whose wait returns at once (as NCCL's does) but whose device never
    runs it; rank 1 never issues it and sits in its own code."""
    from autoshard import comm, watch

    rank = torch.distributed.get_rank()
    watch.start(timeout_s, tick_s=0.25)
    watch.step(2)
    comm.barrier()  # both here: from now on rank 1 is in its own code
    if rank == 0:  # from now on, rank 0's device never runs what it is given
        watch.start(timeout_s, tick_s=0.25, marker=_NeverDone)
    if rank == 1:
        watch.doing("in its own code")
        time.sleep(120)
    what = watch.issued("all_reduce", [0, 1])
    with watch.waiting(what):
        pass  # enqueued on the device, returned at once
    watch.doing("computing")
    time.sleep(120)


def test_a_collective_stuck_on_the_device_names_the_rank_that_never_arrived(capfd) -> None:
    began = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_device_laggard, 2, 3.0, timeout=100)
    assert time.monotonic() - began < 60
    assert str(failure.value).count("exited with code 124") == 2, failure.value
    err = capfd.readouterr().err
    said = re.search(r"autoshard: error: (.*)", err)
    assert said, err
    assert re.fullmatch(
        r"rank 0's device waited 3 s in all_reduce #\d+ over ranks \[0, 1\] \(step 2\): rank 1 "
        r"never arrived \(rank 1 is at step 2, in its own code for \d+ s\)",
        said.group(1),
    ), said.group(1)
