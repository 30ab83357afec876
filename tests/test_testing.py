"""Tests for the multi-rank launcher.

Each test starts ranks once and covers several properties; the failure tests also prove that no
child process is left behind.
"""

import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autoshard import testing
from autoshard.testing import RankFailure, preload, run_ranks

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _record_pid(pid_dir: str) -> None:
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))


def _assert_no_children_left(pids: list[int]) -> None:
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


def _recorded_pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("*.pid"))]


def _sum_ranks(scale: float, *, tag: str) -> tuple:
    t = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(t)
    env = {key: os.environ[key] for key in ENV_KEYS}
    return dist.get_rank(), tag, t, torch.get_num_threads(), env, os.getpid()


def _raise_on_rank_one(pid_dir: str) -> str:
    _record_pid(pid_dir)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)  # let rank 0 return first, so the outcomes really differ
        raise ValueError("boom on rank 1")
    return "fine"


def _die_during_all_reduce(pid_dir: str, how: str) -> str:
    _record_pid(pid_dir)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.3)  # rank 0 is now blocked in all_reduce, waiting for rank 1
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def _hang_on_rank_one(pid_dir: str) -> str:
    _record_pid(pid_dir)
    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


@pytest.mark.parametrize("world_size", [2, 4])
def test_returns_values_in_rank_order(world_size: int) -> None:
    # the first run of the module may start the fork server (seconds of imports; a minute on a
    # host shared with other test workers): the bound is no part of the claim
    results = run_ranks(_sum_ranks, world_size, 2.0, tag="x", timeout=120)
    expected = 2.0 * world_size * (world_size + 1) / 2
    assert [r[0] for r in results] == list(range(world_size))
    ports = set()
    for rank, (_, tag, total, threads, env, _) in enumerate(results):
        assert tag == "x"
        assert torch.equal(total, torch.tensor([expected]))  # tensors survive the trip back
        assert threads == 1
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1
    _assert_no_children_left([r[-1] for r in results])


def test_raising_rank_reports_traceback_and_every_outcome(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2, str(tmp_path), timeout=30)
    message = str(info.value)
    assert "rank 0: returned 'fine'\n" in message
    assert "rank 1: raised\n" in message
    assert "ValueError: boom on rank 1" in message
    assert "_raise_on_rank_one" in message  # the traceback, not just the exception text
    _assert_no_children_left(_recorded_pids(tmp_path))


@pytest.mark.parametrize(
    ("how", "expected"), [("exit", "exited with code 3"), ("kill", "killed by SIGKILL")]
)
def test_dead_rank_fails_fast_while_others_wait(tmp_path: Path, how: str, expected: str) -> None:
    timeout = 30.0
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_die_during_all_reduce, 2, str(tmp_path), how, timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout / 2
    assert f"rank 1: no result; {expected}" in str(info.value)
    _assert_no_children_left(_recorded_pids(tmp_path))


def _what_the_rank_sees() -> tuple[str | None, str, bool]:
    print(f"rank {dist.get_rank()} to the caller's output", flush=True)
    return os.environ.get("AUTOSHARD_SET_LATE"), os.getcwd(), "/set/late" in sys.path


def test_ranks_see_the_callers_environment_directory_path_and_output_at_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    run_ranks(_what_the_rank_sees, 2)  # the fork server (where there is one) starts before
    monkeypatch.setenv("AUTOSHARD_SET_LATE", "yes")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("/set/late")
    capfd.readouterr()
    assert run_ranks(_what_the_rank_sees, 2) == [("yes", str(tmp_path), True)] * 2
    out = capfd.readouterr().out
    assert "rank 0 to the caller's output" in out and "rank 1 to the caller's output" in out
    with pytest.raises(RuntimeError, match="before the first run_ranks"):
        preload("json")  # the server already runs: naming more would silently do nothing
    # where there is no fork server, spawned ranks see the same
    monkeypatch.setattr(testing, "_context", lambda: multiprocessing.get_context("spawn"))
    monkeypatch.setenv("AUTOSHARD_SET_LATE", "spawned")
    assert run_ranks(_what_the_rank_sees, 2) == [("spawned", str(tmp_path), True)] * 2
    out = capfd.readouterr().out
    assert "rank 0 to the caller's output" in out and "rank 1 to the caller's output" in out


def test_timeout_names_unfinished_ranks_and_kills_them(tmp_path: Path) -> None:
    timeout = 8.0
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_hang_on_rank_one, 2, str(tmp_path), timeout=timeout)
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 4
    message = str(info.value)
    assert "timed out after 8 s; rank(s) [" in message
    # Rank 0 normally returns; on a heavily loaded machine it may still be starting up.
    assert "rank 0: returned 'done'" in message or "rank(s) [0, 1]" in message
    assert "rank 1: no result; still running" in message
    _assert_no_children_left(_recorded_pids(tmp_path))


def _module_level(x: int) -> int:
    return x


def test_rejects_what_spawn_cannot_ship() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level"):
        run_ranks(local, 2)
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda: None, 2)
    with pytest.raises(TypeError, match="picklable arguments"):
        run_ranks(_module_level, 2, threading.Lock())
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_module_level, 0, 1)
    assert multiprocessing.active_children() == []
