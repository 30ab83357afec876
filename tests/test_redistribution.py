"""Redistribution: least-bytes plans, checked against an unpruned search, executed on 2, 4 and
8 ranks, and priced by the cost model as they run (the cost model's bytes == the plan's == the
bytes each rank counts).

The property test runs inside the ranks (one spawn per world size): every rank draws the same
derandomized cases, and after each case the ranks all-reduce a failure flag so that no rank walks
into the next case's collectives while another has stopped.
"""

import heapq
import itertools
import math
import random

import pytest
import torch

from autoshard import (
    Factored,
    Layout,
    gather_tensor,
    redistribute,
    redistribution_plan,
    shard_tensor,
)
from autoshard.layout.grid import common_grid, prime_cuts
from autoshard.redistribution.planner import candidate_steps, step_bytes
from autoshard.testing import run_ranks


def random_layout(rng: random.Random, shape: tuple[int, ...], num_devices: int) -> Layout:
    """A random valid layout of ``shape`` over a random device matrix of ``num_devices``."""
    device_matrix = []
    left = num_devices
    while left > 1:
        factor = rng.choice([f for f in (2, 4) if left % f == 0])
        device_matrix.append(factor)
        left //= factor
    if rng.random() < 0.3:
        device_matrix.insert(rng.randrange(len(device_matrix) + 1), 1)
    rng.shuffle(device_matrix)
    num_axes = len(device_matrix)
    spare = list(shape)
    dim_axes: list[list[int]] = [[] for _ in shape]
    partial = []
    for axis in rng.sample(range(num_axes), num_axes):
        size = device_matrix[axis]
        choice = rng.random()
        dims = [d for d in range(len(shape)) if spare[d] % size == 0]
        if choice < 0.6 and dims:
            dim = rng.choice(dims)
            dim_axes[dim].append(num_axes - 1 - axis)
            spare[dim] //= size
        elif choice < 0.75:
            partial.append(num_axes - 1 - axis)
    tensor_map = []
    for dim, axes in enumerate(dim_axes):
        if len(axes) == 1 and shape[dim] % 4 == 0 and spare[dim] % 2 == 0 and rng.random() < 0.3:
            # a factored dim: (2, rest) with the split on the second factor
            tensor_map.append(Factored((2, shape[dim] // 2), (-1, axes[0])))
        else:
            tensor_map.append(-1 if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return Layout(device_matrix, tensor_map, shape, partial=partial, dtype=torch.float64)


def random_shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.choice([4, 8, 8, 16, 12]) for _ in range(rng.randint(1, 3)))


def random_pair(seed: int, num_devices: int) -> tuple[Layout, Layout]:
    rng = random.Random(seed)
    shape = random_shape(rng)
    return random_layout(rng, shape, num_devices), random_layout(rng, shape, num_devices)


def brute_force_bytes(src: Layout, dst: Layout) -> int:
    """Least bytes per rank over every step sequence on the finest grid (prime axes, every
    power-of-two cut of every dim), with unpruned moves: an independent uniform-cost search."""
    coarse = common_grid((src, dst))
    grid = common_grid(
        (src, dst),
        extra_mesh=prime_cuts(coarse.axes),
        extra_dims=[prime_cuts(d) for d in coarse.dims],
    )
    start, goal = grid.encode(src), grid.encode(dst)
    seen = {start: 0}
    heap = [(0, 0, start)]
    tick = itertools.count(1)
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == goal:
            return cost
        if seen[state] < cost:
            continue
        for kind, axes, nxt in candidate_steps(grid, state, goal, exhaustive=True):
            new = cost + step_bytes(kind, grid, axes, state, src.dtype.itemsize)
            if new < seen.get(nxt, math.inf):
                seen[nxt] = new
                heapq.heappush(heap, (new, next(tick), nxt))
    raise AssertionError("goal unreachable")


@pytest.mark.parametrize("num_devices, num_seeds", [(2, 40), (4, 60), (8, 150)])
def test_plans_are_no_worse_than_brute_force(num_devices, num_seeds):
    checked = 0
    for seed in range(num_seeds):
        src, dst = random_pair(seed * 7 + num_devices, num_devices)
        if math.prod(src.shape) > 256:
            continue
        assert redistribution_plan(src, dst).bytes <= brute_force_bytes(src, dst), (src, dst)
        checked += 1
    assert checked >= num_seeds // 3


def test_reducing_into_a_finer_split_than_either_layout_is_found():
    # P(dp),S1(tp) -> S1(dp): reduce-scatter rows, gather columns, exchange: 3/4 of the bytes
    # of all-reducing first. Neither layout cuts dim 1 into quarters; the plan must.
    mesh = {"dp": 2, "tp": 2}
    src = Layout.from_named((8, 16), (None, "tp"), mesh, partial=("dp",))
    dst = Layout.from_named((8, 16), (None, "dp"), mesh)
    plan = redistribution_plan(src, dst)
    assert plan.bytes == brute_force_bytes(src, dst) == 384
    assert [s.kind for s in plan.steps] == ["reduce_scatter", "all_gather", "all_to_all"]


def test_seed_cases_of_z_equals_xw_times_v():
    # 8 devices, X[16,32] W[32,16] -> Z[16,16], then Z * V.
    shape = (16, 16)
    row_split = Layout.from_strategy(shape, (8, 1), 8)  # data parallel first MatMul's output
    whole = Layout.from_strategy(shape, (1, 1), 8)  # model-parallel MatMul wants Z whole
    col_split = Layout.from_strategy(shape, (1, 8), 8)  # ... or Z split by columns
    kinds = [s.kind for s in redistribution_plan(row_split, whole).steps]
    assert kinds == ["all_gather"]
    kinds = [s.kind for s in redistribution_plan(row_split, col_split).steps]
    assert kinds == ["all_to_all"]
    # mixed ((2,4),(4,1)): contracting a split of 4 leaves Z partial over that axis; the next
    # MatMul with ((2,1),(1,1))-style rows wants only the sum.
    partial = Layout((2, 4), (1, -1), shape, partial=(0,))
    rows = Layout((2, 4), (1, -1), shape)
    plan = redistribution_plan(partial, rows)
    assert [s.kind for s in plan.steps] == ["all_reduce"]
    assert plan.steps[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_swapping_two_axes_is_one_exchange():
    mesh = {"dp": 2, "tp": 2}
    src = Layout.from_named((8, 8), ("dp", "tp"), mesh)
    dst = Layout.from_named((8, 8), ("tp", "dp"), mesh)
    plan = redistribution_plan(src, dst)
    assert [s.kind for s in plan.steps] == ["permute"]
    assert plan.steps[0].groups == ((1, 2),)


def test_bad_pairs_are_clear_errors():
    with pytest.raises(ValueError, match="global shapes differ"):
        redistribution_plan(Layout.replicated((4,), 2), Layout.replicated((8,), 2))


# -- executed on ranks ----------------------------------------------------------------------------


def _check_case(src: Layout, dst: Layout, seed: int) -> str | None:
    """Forward, backward and byte count of one pair on this rank; an error text or None."""
    import torch.distributed as dist

    from autoshard import comm, gather_tensor, redistribute, shard_tensor
    from autoshard.cost import cluster_spec, transition

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(src.shape, generator=gen, dtype=torch.float64)
    grad = torch.randn(src.shape, generator=gen, dtype=torch.float64)
    in_src = rank in src.ranks
    local = shard_tensor(full, src) if in_src else torch.empty(0, dtype=torch.float64)
    local.requires_grad_(True)
    plan = redistribution_plan(src, dst)
    comm.reset_counters()
    out = redistribute(local, src, dst)
    measured = sum(c["bytes"] for c in comm.counters().values())
    problems = []
    if rank in dst.ranks:
        expected = shard_tensor(full, dst)
        if dst.partial:
            # a pending sum is checked by summing it
            expected = full
            out_full = gather_tensor(out.detach(), dst)
            if not torch.allclose(out_full, expected):
                problems.append("forward sum differs")
        elif not torch.equal(out, expected):
            problems.append("forward differs")
    seed_grad = shard_tensor(grad, dst.without_partial()) if rank in dst.ranks else out.new_empty(0)
    out.backward(seed_grad)
    if rank in src.ranks and not torch.equal(local.grad, shard_tensor(grad, src.without_partial())):
        problems.append("backward differs")
    if measured != plan.bytes_on(rank):
        problems.append(f"rank {rank} measured {measured} B != planned {plan.bytes_on(rank)} B")
    priced = transition(src, dst, cluster_spec("cpu", max(len(src.ranks), len(dst.ranks))))
    if src != dst and (priced.bytes != plan.bytes or len(priced.kinds) > len(plan.steps)):
        problems.append(f"the cost model prices {priced} for a plan of {plan.bytes} B")
    return f"{src} -> {dst}: {', '.join(problems)}\n{plan}" if problems else None


def _property_body(num_devices: int, num_cases: int) -> int:
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    failures: list[str] = []

    @settings(
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        max_examples=num_cases,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.integers(0, 2**31))
    def case(seed: int) -> None:
        src, dst = random_pair(seed, num_devices)
        error = _check_case(src, dst, seed)
        flag = torch.tensor([0.0 if error is None else 1.0])
        dist.all_reduce(flag)  # every rank learns of a failure before the next case
        if error:
            failures.append(error)
        assert flag.item() == 0, failures[-1] if failures else "another rank failed"

    case()
    return num_cases


@pytest.mark.parametrize("num_devices, num_cases", [(2, 40), (4, 40), (8, 25)])
def test_random_pairs_forward_backward_and_bytes(num_devices, num_cases):
    results = run_ranks(_property_body, num_devices, num_devices, num_cases, timeout=240)
    assert results == [num_cases] * num_devices


def _subset_body() -> None:
    import torch.distributed as dist

    # stage 0 on ranks 0,1 (rows split) -> stage 1 on ranks 2,3 (columns split), and a 2x2
    # mesh with a different device matrix on the same ranks.
    src = Layout((2,), (0, -1), (4, 6), ranks=(0, 1), dtype=torch.float64)
    dst = Layout((2,), (-1, 0), (4, 6), ranks=(2, 3), dtype=torch.float64)
    error = _check_case(src, dst, 11)
    assert error is None, error
    plan = redistribution_plan(src, dst)
    assert "send_recv" in [s.kind for s in plan.steps]
    three = Layout((2, 2), (1, 0), (8, 6), partial=(), dtype=torch.float64)
    other = Layout((4,), (Factored((2, 4), (-1, 0)), -1), (8, 6), dtype=torch.float64)
    error = _check_case(three, other, 12)
    assert error is None, error
    # a stage of 2 ranks feeding a stage of 4 (and back), partial sums on the way
    two = Layout((2,), (-1, -1), (4, 6), partial=(0,), ranks=(2, 0), dtype=torch.float64)
    four = Layout((2, 2), (0, 1), (4, 6), ranks=(3, 2, 1, 0), dtype=torch.float64)
    for a, b in ((two, four), (four.without_partial(), two.without_partial())):
        error = _check_case(a, b, 13)
        assert error is None, error
    # a pairwise swap of a strided view (a transpose's output): received into a dense buffer
    mesh = {"dp": 2, "tp": 2}
    full = torch.randn(6, 8, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    cols_tp = Layout.from_named((6, 8), (None, "tp"), mesh, dtype=torch.float64)
    rows_tp = Layout.from_named((8, 6), ("tp", None), mesh, dtype=torch.float64)
    rows_dp = Layout.from_named((8, 6), ("dp", None), mesh, dtype=torch.float64)
    assert [s.kind for s in redistribution_plan(rows_tp, rows_dp).steps] == ["permute"]
    whole, local = full.t(), shard_tensor(full, cols_tp).t()  # rows of full.t() over tp
    assert not local.is_contiguous()
    moved = redistribute(local, rows_tp, rows_dp)
    assert torch.equal(gather_tensor(moved, rows_dp), whole)
    dist.barrier()


def test_rank_subsets_and_pipeline_transfer():
    run_ranks(_subset_body, 4, timeout=120)


def test_step_costs_are_the_plans_steps_as_pricing_sees_them() -> None:
    """The search's pricing path (``step_costs``: no layouts made) gives what the plan the
    runtime runs would: kind, bytes, input bytes and first group of every step."""
    from autoshard.redistribution import StepCost, step_costs

    for devices in (2, 4, 8, 16):
        for seed in range(50):
            src, dst = random_pair(seed, devices)
            want = tuple(StepCost.of(s) for s in redistribution_plan(src, dst).steps)
            assert step_costs(src, dst) == want, (src, dst)
            # to other ranks (a pipeline's stage boundary), of the same count and of half
            moved = dst.on_ranks([r + devices for r in dst.ranks])
            want = tuple(StepCost.of(s) for s in redistribution_plan(src, moved).steps)
            assert step_costs(src, moved) == want, (src, moved)
    src = Layout.replicated((8, 4), [0, 1, 2, 3])
    half = Layout.replicated((8, 4), [4, 5])
    want = tuple(StepCost.of(s) for s in redistribution_plan(src, half).steps)
    assert step_costs(src, half) == want and want


def test_a_common_grid_is_made_once_for_what_it_reads() -> None:
    """Common grids are kept by ``grid_key``: a pair, the pair reversed, and the pair with
    another dtype, without its pending sums or on other ranks share one grid, and each is the
    grid made afresh for it (no pair gets another's)."""
    from autoshard import memo
    from autoshard.layout.grid import grid_key
    from autoshard.redistribution.planner import _grid_of

    made = _grid_of.__wrapped__  # a grid made afresh
    asked, grids = 0, {}
    with memo.scope() as caches:  # the grids are the scope's
        for devices in (2, 4, 8, 16):
            for seed in range(60):
                src, dst = random_pair(seed, devices)
                shifted = dst.on_ranks([r + devices for r in dst.ranks])
                pairs = [(src, dst), (dst, src), (src.with_dtype(torch.bfloat16), dst),
                         (src.without_partial(), dst), (src, shifted)]  # fmt: skip
                for a, b in pairs:
                    fresh = made(a, b)
                    assert _grid_of(a, b) == fresh, (a, b)
                    assert grids.setdefault(grid_key(a, b), fresh) == fresh, (a, b)
                    asked += 1
        kept = caches[made]
    assert len(kept) == len(grids) < asked / 3, (len(kept), asked)
