"""The cost model (cost/): collectives priced on their links, cluster specs, calibration and the
estimate of a plan's memory and FLOPs."""

from __future__ import annotations

import math

import pytest
import torch

from autoshard.cost import (
    PRESETS,
    ClusterSpec,
    Estimate,
    cluster_spec,
    collective_time,
    estimate,
    transition,
)
from autoshard.cost.collectives import gradient_transition, group_size, step_time
from autoshard.graph import capture
from autoshard.layout import Layout
from autoshard.mesh import mesh_info
from autoshard.models import MLP, MLPConfig
from autoshard.redistribution import gradient_sum, redistribution_plan, replica_sum_groups
from autoshard.search import plan_graph


def test_transition_prices_collectives_on_their_links() -> None:
    cluster = cluster_spec("dgx-h100", 16)
    mesh = {"dp": 2, "tp": 8}
    shape = (64, 1024)
    whole = Layout.from_named(shape, (None, None), mesh, dtype=torch.bfloat16)
    nbytes = 64 * 1024 * 2
    # rows already split over dp: the sum over tp is one all-reduce (of a whole tensor the
    # planner would split over dp first, reduce half and gather: fewer bytes)
    rows_dp = Layout.from_named(shape, ("dp", None), mesh, dtype=torch.bfloat16)
    inside = Layout.from_named(shape, ("dp", None), mesh, partial=("tp",), dtype=torch.bfloat16)
    across = Layout.from_named(shape, (None, None), mesh, partial=("dp",), dtype=torch.bfloat16)
    t_in = transition(inside, rows_dp, cluster)
    t_out = transition(across, whole, cluster)
    assert t_in.kinds == ("all_reduce",) and t_out.kinds == ("all_reduce",)
    bw_in, lat_in = cluster.intra_bandwidth, cluster.intra_latency
    # ring bandwidth, tree latency: 3 steps in a group of 8, 1 in a group of 2
    assert t_in.seconds == pytest.approx(2 * 7 / 8 * nbytes / 2 / bw_in + 2 * 3 * lat_in)
    bw_out, lat_out = cluster.inter_bandwidth, cluster.inter_latency
    assert t_out.seconds == pytest.approx(2 * 1 / 2 * nbytes / bw_out + 2 * lat_out)
    rows = Layout.from_named(shape, ("tp", None), mesh, dtype=torch.bfloat16)
    cols = Layout.from_named(shape, (None, "tp"), mesh, dtype=torch.bfloat16)
    assert transition(rows, cols, cluster).kinds == ("all_to_all",)
    assert transition(rows, whole, cluster).kinds == ("all_gather",)
    assert transition(whole, rows, cluster).seconds == 0.0
    sums = Layout.from_named(shape, (None, None), mesh, partial=("tp",), dtype=torch.bfloat16)
    # the planner's own plan, priced: split over dp, reduce-scatter half, gather over dp
    summed = transition(sums, rows, cluster)
    assert summed.kinds == ("reduce_scatter", "all_gather")
    assert summed.bytes == 7 / 8 * nbytes / 2 + nbytes / 16 < 7 / 8 * nbytes


def test_the_cost_model_prices_the_plan_that_runs() -> None:
    """Two moves the cost model once priced by its own formula: (P,S1) -> (S1,R), which runs
    as reduce-scatter, permute and all-gather (the reduce-scatter's rows are the wrong chunk
    of dim 1 for the destination), and (S0,S1) -> (S1,S0), one pairwise exchange. The price is
    the planner's steps, bytes for bytes."""
    cluster = cluster_spec("cpu", 4)
    mesh = {"dp": 2, "tp": 2}
    shape = (512, 1024)
    cases = [
        (Layout.from_named(shape, (None, "tp"), mesh, partial=("dp",)),
         Layout.from_named(shape, (None, "dp"), mesh), 1.5 * 2**20),
        (Layout.from_named(shape, ("dp", "tp"), mesh),
         Layout.from_named(shape, ("tp", "dp"), mesh), 512 * 2**10),
    ]  # fmt: skip
    for src, dst, nbytes in cases:
        plan = redistribution_plan(src, dst)
        priced = transition(src, dst, cluster)
        assert priced.bytes == plan.bytes == nbytes, (str(plan), priced)
        assert priced.kinds == tuple(s.kind for s in plan.steps if s.bytes)
        seconds = sum(step_time(s, cluster.devices_per_node, cluster) for s in plan.steps)
        assert priced.seconds == pytest.approx(seconds)


def test_a_gradient_sum_of_replicas_is_one_all_reduce() -> None:
    """A data-parallel gradient of a parameter replicated over tp: the least-bytes plan splits
    over tp, all-reduces a half and gathers it (fewer bytes, three collectives in the hook);
    the runtime sums it with one all-reduce a bucket joins, and the cost model prices that."""
    cluster = cluster_spec("dgx-h100", 8)
    grad = Layout.from_named((4096, 512), (None, None), {"dp": 4, "tp": 2}, partial=("dp",))
    whole = grad.without_partial()
    assert len(redistribution_plan(grad, whole).steps) == 3
    summed = gradient_sum(grad, whole)
    assert [s.kind for s in summed.steps] == ["all_reduce"]
    assert summed.steps[0].groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert gradient_transition(grad, whole, cluster).kinds == ("all_reduce",)
    assert replica_sum_groups(grad, whole) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert group_size((0, 2, 4, 6), cluster.devices_per_node) == (4, 4)


def test_a_split_of_the_same_dim_elsewhere_is_a_move() -> None:
    """Targets split by sequence and flattened, ``[b, s@dp]`` as ``[b*s]``, hold other elements
    on each rank than ``[b*s@dp]``: an all-to-all, not free (the search once chose it so);
    flattened from a batch split, they are the same."""
    cluster = cluster_spec("cpu", 2)
    by_seq = Layout.from_named((8, 64), (None, "dp"), {"dp": 2}, dtype=torch.int64).view((512,))
    by_row = Layout.from_named((512,), ("dp",), {"dp": 2}, dtype=torch.int64)
    by_batch = Layout.from_named((8, 64), ("dp", None), {"dp": 2}, dtype=torch.int64)
    moved = transition(by_seq, by_row, cluster)
    assert moved.kinds == ("all_to_all",) and moved.seconds > 0
    assert transition(by_row, by_seq, cluster).kinds == ("all_to_all",)
    assert transition(by_batch.view((512,)), by_row, cluster).seconds == 0.0


def test_a_backends_slower_collectives_are_priced_by_their_measured_factor() -> None:
    """gloo's reduce-scatter takes about 2.4 times the ring model's time: a spec carrying that
    factor prices ZeRO's reduce-scatter, and every reduce-scatter, at that factor; all-reduce
    keeps the fitted model."""
    from dataclasses import replace

    from autoshard.cost.calibrate import KIND_SIZES, kind_factors
    from autoshard.cost.collectives import collective_parts

    base = cluster_spec("cpu", 2)
    slow = replace(base, collective_factors={"reduce_scatter": 2.4})
    for kind, factor in (("reduce_scatter", 2.4), ("all_gather", 1.0), ("all_reduce", 1.0)):
        bandwidth, latency = collective_parts(kind, 1 << 20, 2, 2, base)
        got = collective_parts(kind, 1 << 20, 2, 2, slow)
        assert got[0] == pytest.approx(bandwidth * factor)
        assert got[1] == pytest.approx(latency * (factor if kind != "all_reduce" else 1.0))
    # the calibration's factor is measured over modelled time at each size, the median kept
    lat, bw = base.intra_latency, base.intra_bandwidth
    model = [(1 / 2) * n / bw + lat for n in KIND_SIZES]
    times = {"reduce_scatter": [2.0 * model[0], 3.0 * model[1], 2.5 * model[2]]}
    assert kind_factors(times, 2, lat, bw, KIND_SIZES) == {"reduce_scatter": pytest.approx(2.5)}
    assert ClusterSpec.from_json(slow.to_json()).collective_factors == {"reduce_scatter": 2.4}


def test_cluster_spec_round_trips_and_rejects_unknown_fields(tmp_path) -> None:
    path = tmp_path / "c.json"
    PRESETS["dgx-a100"].save(path)
    loaded = ClusterSpec.load(path)
    assert loaded.to_json() == PRESETS["dgx-a100"].to_json()
    assert cluster_spec(str(path), 32).nodes == 4
    with pytest.raises(ValueError, match="unknown fields"):
        ClusterSpec.from_json({**PRESETS["cpu"].to_json(), "bogus": 1})
    with pytest.raises(ValueError, match="not a preset"):
        cluster_spec("no-such-cluster")


def test_calibration_fit_recovers_latency_and_bandwidth() -> None:
    from autoshard.cost.calibrate import COMM_SIZES, fit_all_reduce

    for group, alpha, bw in ((2, 6e-4, 1.5e9), (4, 5e-6, 2.4e11), (8, 3e-5, 2e10)):
        spec = ClusterSpec(
            name="t",
            nodes=1,
            devices_per_node=group,
            flops={"float32": 1e12},
            memory_bytes=1e9,
            memory_bandwidth=1e11,
            intra_bandwidth=bw,
            intra_latency=alpha,
            inter_bandwidth=bw,
            inter_latency=alpha,
        )
        # the joint fit over group sizes 2..group (and each size alone) recovers the link
        sizes = [g for g in (2, 4, 8) if g <= group]
        samples = [
            (g, s, collective_time("all_reduce", s, g, g, spec)) for g in sizes for s in COMM_SIZES
        ]
        fit = fit_all_reduce(samples)
        assert fit["latency"] == pytest.approx(alpha, rel=1e-6)
        assert fit["bandwidth"] == pytest.approx(bw, rel=1e-6)
    # times that fall with size fit no positive line: smallest message and largest instead
    fit = fit_all_reduce([(2, 1000, 2e-3), (2, 10**6, 1e-3)])
    assert fit["latency"] == pytest.approx(1e-3)
    assert fit["bandwidth"] > 0


def test_calibration_times_the_conditions_it_compares_in_turns() -> None:
    """A collective's time is the difference of two timings (compute with and without it): they
    are taken in turns, round by round, so a slower stretch of the host falls on both, and
    each keeps its own median."""
    from autoshard.cost.calibrate import _in_turns

    calls: list[str] = []
    alone = iter([3.0, 1.0, 2.0, 9.0, 2.0])
    synced = iter([5.0, 4.0, 6.0, 4.0, 30.0])

    def run(name: str, times) -> float:
        calls.append(name)
        return next(times)

    medians = _in_turns([lambda: run("alone", alone), lambda: run("synced", synced)], rounds=5)
    assert calls == ["alone", "synced"] * 5
    assert medians == [2.0, 5.0]


def test_estimate_of_data_parallel_mlp_counts_replicated_state_and_model_flops() -> None:
    """Data parallel on 2 devices: every device holds all parameters and their gradients,
    Adam's two moments are twice that, and model FLOPs are the sum over the graph's ops."""
    torch.manual_seed(0)
    config = MLPConfig()
    model = MLP(config)
    og = capture(model, config.example_batch(8))
    plan = plan_graph(og, mesh_info({"dp": 2}))
    est = estimate(plan, og, cluster_spec("cpu", 2))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert nbytes == 4 * (2 * (16 * 32 + 32 + 32 * 16 + 16) + 16 * 8 + 8)
    assert est.memory["parameters"] == nbytes
    assert est.memory["gradients"] == nbytes
    assert est.memory["optimizer"] == 2 * nbytes
    flops = sum(og[node].flops for node in og.graph.nodes if og[node].kind == "op")
    assert flops > 0
    assert est.model_flops == pytest.approx(flops, rel=1e-12)
    assert est.num_devices == 2


# -- the device and link models (docs/cost.md) -----------------------------------------------------


def _link_spec(**kw: float) -> ClusterSpec:
    fields = dict(
        name="links",
        nodes=4,
        devices_per_node=8,
        flops={"float32": 1e14},
        memory_bytes=1e10,
        memory_bandwidth=1e12,
        intra_bandwidth=400e9,
        intra_latency=2e-6,
        inter_bandwidth=40e9,
        inter_latency=10e-6,
    )
    return ClusterSpec(**(fields | kw))


def test_collectives_run_on_their_links_and_hierarchically_across_nodes() -> None:
    spec = _link_spec()
    nbytes = 64e6
    inside = collective_time("all_reduce", nbytes, 8, 8, spec)
    assert inside == pytest.approx(2 * 7 / 8 * nbytes / 400e9 + 2 * 3 * 2e-6)
    one_per_node = collective_time("all_reduce", nbytes, 4, 1, spec)
    assert one_per_node == pytest.approx(2 * 3 / 4 * nbytes / 40e9 + 2 * 2 * 10e-6)
    # 32 ranks, 8 per node: inside, then across on an eighth of the bytes, then inside again
    hier = collective_time("all_reduce", nbytes, 32, 8, spec)
    expected = (
        7 / 8 * nbytes / 400e9 + 7 * 2e-6  # reduce-scatter inside (a ring)
        + 2 * 3 / 4 * nbytes / 8 / 40e9 + 2 * 2 * 10e-6  # all-reduce across
        + 7 / 8 * nbytes / 400e9 + 7 * 2e-6  # all-gather inside
    )  # fmt: skip
    assert hier == pytest.approx(expected)
    flat_ring_over_the_network = 2 * 31 / 32 * nbytes / 40e9
    assert hier < flat_ring_over_the_network / 4
    # rings pay a latency per peer, all-reduce a tree's
    assert collective_time("all_gather", 8.0, 8, 8, spec) == pytest.approx(
        7 / 8 * 8 / 400e9 + 7 * 2e-6
    )


def test_compute_time_reaches_the_share_of_peak_its_size_gets() -> None:
    from autoshard.ops import Cost

    spec = _link_spec(matmul_efficiency=[[100, 0.1], [1000, 0.5], [10000, 0.8]])
    assert spec.matmul_share(50) == 0.1 and spec.matmul_share(1e5) == 0.8
    assert spec.matmul_share(math.sqrt(100 * 1000)) == pytest.approx(0.3)  # log-interpolated
    big = Cost(2e12, 1e6, kind="matmul", size=1000)
    assert spec.compute_time(big, torch.float32) == pytest.approx(2e12 / (1e14 * 0.5) + 5e-6)
    skinny = Cost(2e9, 4e9, kind="matmul", size=1000)  # its bytes take longer than its FLOPs
    assert spec.compute_time(skinny, torch.float32) == pytest.approx(4e9 / 1e12 + 5e-6)
    causal = Cost(1e12, 0.0, 2e12, kind="attention", work=0.5)
    attention = _link_spec(attention_efficiency=[0.5, 0.25])
    assert attention.compute_time(causal, torch.float32) == pytest.approx(1e12 * 0.5 / 5e13 + 5e-6)
    assert attention.compute_time(causal, torch.float32, backward=True) == pytest.approx(
        2e12 * 0.5 / 2.5e13 + 5e-6
    )
    assert spec.compute_time(Cost(0.0, 0.0), torch.float32, backward=True) == 0.0


def test_overlapped_communication_is_exposed_only_where_compute_waits() -> None:
    from autoshard.cost import Overlapped
    from autoshard.cost.estimate import exposed

    assert exposed([]) == 0.0
    assert exposed([Overlapped(1.0, ready=0.0, due=5.0)]) == 0.0  # hidden behind compute
    assert exposed([Overlapped(3.0, ready=4.0, due=5.0)]) == pytest.approx(2.0)
    # one stream: the second transfer waits for the first, and the stall delays what follows
    two = [Overlapped(2.0, ready=0.0, due=10.0), Overlapped(2.0, ready=1.0, due=3.0)]
    assert exposed(two) == pytest.approx(1.0)
    est = Estimate(compute_forward=1.0, compute_backward=2.0, optimizer=0.5)
    est.overlapped.append(Overlapped(1.5, ready=2.5, due=3.0))
    assert est.exposed_comm == pytest.approx(1.0)
    assert est.step_time == pytest.approx(3.0 + 1.0 + 0.5)
    assert est.comm == pytest.approx(1.5)
    # a backend that overlaps half: half of what the timeline hides is still waited for
    assert exposed(two, 0.5) == pytest.approx(1.0 + 0.5 * (4.0 - 1.0))
    assert exposed([Overlapped(1.0, ready=0.0, due=5.0)], 0.0) == pytest.approx(1.0)
    est.overlap_efficiency = 0.0
    assert est.exposed_comm == pytest.approx(1.5)


def test_calibration_measures_the_matmul_curve_and_attention_shares() -> None:
    """This machine's products: the best size is the peak (share 1), tiny ones reach less; the
    attention shares are fractions of that peak."""
    from autoshard.cost.calibrate import MATMUL_SIZES, measure_attention, measure_matmul

    peak, curve = measure_matmul(torch.float32)
    assert peak > 1e8
    assert [size for size, _ in curve] == list(MATMUL_SIZES)
    assert max(share for _, share in curve) == 1.0
    assert curve[0][1] < 1.0  # a 16-cube product is overhead-bound
    forward, backward = measure_attention(peak)
    assert 0 < forward <= 1 and 0 < backward <= 1


def test_a_parallel_job_waits_for_its_slowest_rank() -> None:
    """``sync_wait`` slows the compute of ops that run on several devices, not on one."""
    from dataclasses import replace

    from autoshard.cost import op_time

    config = MLPConfig()
    og = capture(MLP(config), config.example_batch(8))
    node = next(i.node for i in og.ops() if i.key == "layers.0.fc1/linear.0")
    spec = replace(cluster_spec("cpu"), sync_wait=0.25)
    for devices, factor in ((1, 1.0), (2, 1.25)):
        plan = plan_graph(og, mesh_info({"dp": devices}))
        strategy = plan.nodes[node.name].strategy
        plain = op_time(node, strategy, replace(spec, sync_wait=0.0))
        slowed = op_time(node, strategy, spec)
        assert slowed == pytest.approx(tuple(factor * t for t in plain)), devices


def test_an_estimate_at_depth_equals_the_deeper_capture() -> None:
    """A Llama captured with 2 blocks and priced at 4 costs what the 4-block capture costs:
    compute, communication, memory, and the buckets of its gradients with their overlap,
    under a plan that splits every layer alike (dp 2 x tp 4 on 8 devices)."""
    from autoshard.models import build, reference_config

    batch_and_rows = (("dp", None, None), ("tp", None))  # weights summed over dp
    strategies = {
        "layers.*.attention.w*": batch_and_rows,
        "layers.*.feed_forward.w*": batch_and_rows,
    }
    mesh = mesh_info({"dp": 2, "tp": 4})
    cluster = cluster_spec("dgx-h100", 8)
    estimates = {}
    for layers in (2, 4):
        config = reference_config("llama", layers=layers, hidden=256, heads=8, kv_heads=4)
        with torch.device("meta"):
            model = build(config)
        batch = tuple(t.to("meta") for t in config.example_batch(8))
        og = capture(model, batch)
        plan = plan_graph(og, mesh, strategies)
        depth = {"layers": 4} if layers == 2 else None
        estimates[layers] = estimate(plan, og, cluster, bucket_cap_mb=0.5, depth=depth)
    shallow, deep = estimates[2], estimates[4]
    assert len(shallow.overlapped) == len(deep.overlapped) > 2
    for field in ("comm", "exposed_comm", "peak_memory", "model_flops"):
        assert getattr(shallow, field) == pytest.approx(getattr(deep, field), rel=1e-9), field
    assert shallow.memory == pytest.approx(deep.memory, rel=1e-9)
    # compute differs by one thing only: the residual stream out of the last captured block
    # has one reader (the final norm) where the blocks it stands for have two (the next
    # block's norm and residual add), so autograd's add of those two gradients is missing
    for field in ("step_time", "compute"):
        assert getattr(shallow, field) == pytest.approx(getattr(deep, field), rel=5e-3), field


def test_zero_model_states_reproduce_the_zero_papers_figure_1() -> None:
    """7.5B parameters on 64 devices, Adam in mixed precision (K = 12): 120, 31.4, 16.6 and
    1.88 GB of model state per device at stages 0 to 3 (the ZeRO paper's Figure 1)."""
    from autoshard.cost.zero import model_states

    totals = [sum(model_states(7.5e9, 64, stage, 2, 2, 12).values()) / 1e9 for stage in range(4)]
    assert [round(t, 2) for t in totals] == [120.0, 31.41, 16.64, 1.88]
    stage2 = model_states(7.5e9, 64, 2)
    assert stage2 == {"parameters": 15e9, "gradients": 15e9 / 64, "optimizer": 90e9 / 64}


def _kinds_on_ranks(_: object) -> dict:
    from autoshard.cost.calibrate import _measure_kinds

    return _measure_kinds(1)


def test_calibration_times_every_other_collective_kind() -> None:
    """On 2 gloo ranks: a positive, finite time per kind and size. (Not that larger messages
    take longer: each time is the difference of two bursts of about 10 ms of compute, and
    another process on the host moves a 64 KiB call's share past a 4 MiB one's; timings are
    bench/'s to judge, not a test's.)"""
    from autoshard.cost.calibrate import KIND_SIZES, OTHER_KINDS
    from autoshard.testing import run_ranks

    times = run_ranks(_kinds_on_ranks, 2, None, timeout=300)[0]
    assert set(times) == set(OTHER_KINDS)
    for kind, seconds in times.items():
        assert len(seconds) == len(KIND_SIZES), kind
        assert all(0 < s < 1 for s in seconds), (kind, seconds)


def test_a_loss_computed_by_separate_passes_moves_its_logits_that_many_times() -> None:
    """``loss_bytes`` prices a cross-entropy by its logit elements on the rank (split classes
    count a t-th); left at [0, 0], the op's own reads and writes as before."""
    from dataclasses import replace

    from autoshard.cost import op_time
    from autoshard.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, block_size=8)
    og = capture(GPT(config), config.example_batch(4))
    node = next(i.node for i in og.ops() if "cross_entropy" in i.key)
    spec = cluster_spec("dgx-h100")
    passes = replace(spec, loss_bytes=[38.0, 14.0], op_overhead=0.0)
    for devices in (1, 2):
        plan = plan_graph(og, mesh_info({"tp": devices}))
        strategy = plan.nodes[node.name].strategy
        logits = strategy.ins[0].local_numel
        assert logits == 4 * 8 * 96 // (devices if strategy.ins[0].local_shape()[1] < 96 else 1)
        forward, backward = op_time(node, strategy, passes)
        assert forward == pytest.approx(38 * logits / spec.memory_bandwidth)
        assert backward == pytest.approx(14 * logits / spec.memory_bandwidth)
        plain = op_time(node, strategy, replace(spec, op_overhead=0.0))
        assert plain[0] < forward and plain[0] > 0


def test_a_products_output_passed_through_a_copy_is_still_beside_the_product() -> None:
    """A row-parallel product's output reaches the residual add through dropout's copy (it
    drops nothing): the reduce-scatter of that copy runs beside the product, as Transformer
    Engine's tensor-parallel overlap runs it, so ``tp_comm_overlap`` prices it in chunks;
    a value an elementwise op made is not a product's."""
    from dataclasses import replace

    from autoshard.cost.collectives import is_product, move_time
    from autoshard.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, block_size=8)
    og = capture(GPT(config), config.example_batch(4))
    nodes = {i.key: i.node for i in og.ops()}
    copy = next(n for k, n in nodes.items() if "mlp.dropout" in k)
    assert is_product(copy.args[0]) and is_product(copy)
    assert not is_product(next(n for k, n in nodes.items() if "gelu" in k))
    shape, bf16 = (4, 1024, 4096), torch.bfloat16
    partial = Layout.from_named(shape, (None,) * 3, {"tp": 8}, partial=("tp",), dtype=bf16)
    rows = Layout.from_named(shape, (None, "tp", None), {"tp": 8}, dtype=bf16)
    spec = cluster_spec("dgx-h100")
    overlapped = replace(spec, tp_comm_overlap=True)
    whole = move_time(partial, rows, spec, beside_product=True)
    assert move_time(partial, rows, overlapped, beside_product=False) == pytest.approx(whole)
    assert move_time(partial, rows, overlapped, beside_product=True) < whole / 2


def test_the_kind_breakdown_adds_up_to_the_estimates_compute_and_in_line_comm() -> None:
    """``kind_breakdown`` splits a tensor-parallel GPT's step by kind of op: every node in
    exactly one kind, products and attention priced by FLOPs, views by their overhead alone,
    and the moves tensor parallelism adds on the products and the adds they feed."""
    from autoshard.cost.breakdown import KINDS, kind_breakdown
    from autoshard.models import GPT, GPTConfig
    from autoshard.search import run_search
    from autoshard.search.driver import build_plan

    config = GPTConfig(vocab_size=512, block_size=64, hidden=128, num_heads=4, num_layers=2)
    og = capture(GPT(config), config.example_batch(8))
    spec = cluster_spec("dgx-h100").with_devices(2)
    whole = build_plan(og, run_search(og, 2, spec, tp=2, zero=0), spec).predicted.peak_memory
    # under less memory than the replicated plan's, the weights are split and moves priced
    split = run_search(og, 2, spec, tp=2, zero=0, memory_limit=0.95 * whole)
    est = build_plan(og, split, spec).predicted
    rows = {r.kind: r for r in kind_breakdown(est, og)}
    assert set(rows) <= set(KINDS) and {"matrix products", "attention", "loss"} <= set(rows)
    assert sum(r.forward_s + r.backward_s for r in rows.values()) == pytest.approx(est.compute)
    inline = est.comm_forward + est.comm_backward + est.grad_sync
    comm = sum(r.comm_forward_s + r.comm_backward_s for r in rows.values())
    assert 0 < comm <= inline * (1 + 1e-9)
    assert sum(r.ops for r in rows.values()) == sum(c for _, c in est.by_node.values())
    views = rows["views"]
    # a view costs a kernel's overhead and a tuple's item nothing: no bytes, no FLOPs
    assert 0 < views.forward_s <= views.ops * spec.op_overhead * (1 + 1e-9)
    assert rows["matrix products"].forward_s > rows["elementwise"].forward_s
