"""``autoshard calibrate`` on CUDA (cost/calibrate_cuda.py): the spec its measurements make,
read back by the planner; the grouped product's efficiency priced; a clear error without CUDA;
the measurement itself where a GPU is."""

from __future__ import annotations

import pytest
import torch

from autoshard.cost import cluster_spec
from autoshard.cost.calibrate_cuda import CUDA_COMM_SIZES, CUDA_KIND_SIZES, cuda_spec

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _measured(latency: float, bandwidth: float, slower: float) -> list[dict]:
    """Two ranks' measurements, NCCL's all-reduce timed as the link model prices one of
    ``latency`` and ``bandwidth`` and the other kinds ``slower`` times their model."""
    world = 2
    ring = [2 * latency + 2 * (world - 1) / world * n / bandwidth for n in CUDA_COMM_SIZES]
    kind = [slower * ((world - 1) / world * n / bandwidth + latency) for n in CUDA_KIND_SIZES]
    nccl = {"all_reduce": ring, "reduce_scatter": kind, "all_gather": kind, "all_to_all": kind}
    ranks = []
    for r in range(world):
        ranks.append({
            "bfloat16": 7e14 + r * 1e13, "float16": 7e14 + r * 1e13, "float32": 4e14,
            "matmul_efficiency": [[256.0, 0.05], [8192.0, 1.0]],
            "attention_efficiency": [0.5, 0.4], "attention_kernel": "flash",
            "grouped_mm_efficiency": 0.9, "memory_bandwidth": 3e12,
            "memory_bytes": 80e9 + r, "op_overhead": 5e-6, "optimizer_passes": 7.5,
        })  # fmt: skip
    ranks[0]["nccl"] = nccl
    return ranks


def test_the_measurements_make_a_spec_the_planner_reads(tmp_path) -> None:
    spec = cuda_spec(_measured(8e-6, 4e11, 1.5), 2, "gpus")
    assert spec.num_devices == 2
    assert spec.flops["bfloat16"] == pytest.approx(7.05e14)
    assert spec.memory_bytes == 80e9  # the smaller device's
    assert spec.intra_latency == pytest.approx(8e-6, rel=1e-6)
    assert spec.intra_bandwidth == pytest.approx(4e11, rel=1e-6)
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        assert spec.collective_factors[kind] == pytest.approx(1.5)
    assert spec.grouped_mm_efficiency == 0.9 and spec.attention_efficiency == [0.5, 0.4]
    assert spec.extra["attention_kernel"] == "flash"
    assert spec.overlap_efficiency == 1.0  # not measured: NCCL's own stream, as presets say
    measured = _measured(8e-6, 4e11, 1.5)
    measured[0]["nccl"]["overlap_efficiency"] = 0.8
    assert cuda_spec(measured, 2, "gpus").overlap_efficiency == 0.8
    path = tmp_path / "gpus.json"
    spec.save(path)
    read = cluster_spec(str(path))
    assert read.to_json() == spec.to_json()

    from autoshard import plan
    from autoshard.models import MLP, MLPConfig

    config = MLPConfig()
    found = plan(MLP(config), config.example_batch(8), read, mesh={"dp": 2})
    assert found.json["predicted"]["step_time_s"] > 0


def test_one_device_has_no_link_to_measure() -> None:
    one = _measured(8e-6, 4e11, 1.0)[:1]
    del one[0]["nccl"]
    spec = cuda_spec(one, 1, "gpu")
    assert spec.num_devices == 1 and spec.collective_factors == {}


def test_the_grouped_product_is_priced_at_its_efficiency() -> None:
    from dataclasses import replace

    from autoshard.ops.work import Cost

    spec = cluster_spec("dgx-h100")
    grouped = Cost(1e12, 1e6, kind="grouped_mm", size=1024)
    separate = Cost(1e12, 1e6, kind="matmul", size=1024)
    assert spec.compute_time(grouped, torch.bfloat16) == spec.compute_time(
        separate, torch.bfloat16
    )  # the presets: as fast as separate products of one expert's size
    slower = replace(spec, grouped_mm_efficiency=0.5)
    work = spec.compute_time(separate, torch.bfloat16) - spec.op_overhead
    assert slower.compute_time(grouped, torch.bfloat16) == pytest.approx(
        2 * work + spec.op_overhead
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_calibrating_cuda_without_it_says_so(capsys) -> None:
    from autoshard.cli.main import main
    from autoshard.cost.calibrate import calibrate

    with pytest.raises(ValueError, match="no CUDA device"):
        calibrate(1, device="cuda")
    with pytest.raises(ValueError, match="device 'tpu'"):
        calibrate(1, device="tpu")
    with pytest.raises(SystemExit) as stopped:  # the command's one-line error
        main(["calibrate", "--device", "cuda", "--out", "unused.json"])
    assert stopped.value.code != 0
    assert "no CUDA device" in capsys.readouterr().err


@CUDA
def test_one_gpu_calibrates(tmp_path) -> None:
    from autoshard.cost.calibrate_cuda import calibrate_cuda

    spec = calibrate_cuda(1)
    assert spec.flops["bfloat16"] > 1e13 and 0 < spec.attention_efficiency[0] <= 1
    assert spec.grouped_mm_efficiency > 0 and spec.memory_bandwidth > 1e11
    assert spec.memory_bytes == torch.cuda.mem_get_info()[1]
