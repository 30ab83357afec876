"""Named meshes: from an initialised process group or the torchrun environment."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from autoshard import Layout, MeshError, init_mesh, parallelize
from autoshard.models import MLP, MLPConfig
from autoshard.testing import run_ranks


def _mesh_body() -> list:
    import torch.distributed as dist

    mesh = init_mesh({"dp": 2, "tp": 2})
    with pytest.raises(MeshError, match=r"dp\(2\) \* tp\(4\) = 8 != world size 4"):
        init_mesh({"dp": 2, "tp": 4})
    layout = Layout.from_named((8, 4), ("dp", "tp"), mesh)
    # DTensor agrees on which block each rank holds
    from torch.distributed.tensor import distribute_tensor

    full = torch.arange(32.0).reshape(8, 4)
    dtensor = distribute_tensor(full, mesh, layout.to_placements(mesh))
    from autoshard import shard_tensor

    assert torch.equal(dtensor.to_local(), shard_tensor(full, layout))
    return [dist.get_rank(), mesh.mesh.tolist(), mesh.mesh_dim_names]


def test_init_mesh_on_an_initialised_group():
    results = run_ranks(_mesh_body, 4, timeout=90)
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert results[0][1:] == [[[0, 1], [2, 3]], ("dp", "tp")]


def test_init_mesh_from_the_torchrun_environment():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = (
        "import autoshard; m = autoshard.init_mesh({'dp': 1}); "
        "print(m.mesh_dim_names, m.mesh.tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "('dp',) [0]" in out.stdout


def test_init_mesh_without_a_launcher_is_a_clear_error(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MeshError, match="no process group and no launcher environment"):
        init_mesh({"dp": 2})


def test_mesh_that_does_not_match_the_world_names_every_factor(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    model = MLP(MLPConfig())
    with pytest.raises(MeshError, match=r"dp\(2\) \* tp\(2\) = 4 != world size 1") as err:
        parallelize(model, MLPConfig().example_batch(4), {"dp": 2, "tp": 2})
    # where the world size came from, and what to do
    assert "no process group is initialised" in str(err.value)
    assert "torchrun --nproc-per-node 4" in str(err.value)


_LEAVES = """
import atexit
import torch
import torch.distributed as dist
import autoshard
from autoshard import comm

def check():  # registered before autoshard joins, so it runs after autoshard leaves
    print(f"left initialized={dist.is_initialized()} in_flight={len(comm.in_flight)} "
          f"sum={x.item()}", flush=True)

atexit.register(check)
autoshard.init_mesh({"dp": 2})  # joins torchrun's job
x = torch.full((1,), float(dist.get_rank() + 1))
comm.in_flight.append(comm.all_reduce_async_(x, [0, 1]))  # a loss sum no one reads
"""


def test_a_process_group_autoshard_joined_is_left_at_exit_after_its_sums(tmp_path):
    """Under torchrun with no process group of the user's, autoshard joins the job; when the
    script ends it waits the sums still in flight and tears the group down while the
    interpreter is whole (left to its finalization, gloo's threads could abort a run that had
    finished: SIGABRT after the last step, the launcher reporting a failure)."""
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(port), str(script),
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("left initialized=False in_flight=0 sum=3.0") == 2, out.stdout
