"""The experts op as one grouped product over token slots sorted by expert (ops/grouped.py)
equals the explicit loop over experts, forward and backward: float64 by segments (the grouped
kernel takes no float64), float32 by ``torch._grouped_mm`` at a stated tolerance, a rank's
share of the experts alone; on CUDA with no host sync."""

from __future__ import annotations

import pytest
import torch

from autoshard.ops import grouped
from autoshard.ops.experts import experts_math
from autoshard.ops.grouped import expert_ffn

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _explicit(x, index, weight, gate_up, down, act, first=0):
    """Each expert on the tokens that picked it, one at a time."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        rows, slots = torch.nonzero(index == first + e, as_tuple=True)
        y = expert_ffn(x[rows], gate_up[e], down[e], act) * weight[rows, slots, None]
        out = out.index_add(0, rows, y.to(x.dtype))
    return out


def _inputs(dtype, device="cpu", tokens=40, experts=6, hidden=16, ffn=8, top_k=2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    index[:5] = 0  # an expert with more tokens than others; expert 5 may get none
    index[:5, 1] = 1
    weight = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=gen, dtype=torch.float64) / 4
    down = torch.randn(experts, hidden, ffn, generator=gen, dtype=torch.float64) / 4
    floats = [t.to(device=device, dtype=dtype) for t in (x, weight, gate_up, down)]
    return floats[0], index.to(device), *floats[1:]


def _run(op, x, index, weight, gate_up, down, g, sl=slice(None), first=0):
    leaves = [t.clone().requires_grad_() for t in (x, weight, gate_up[sl], down[sl])]
    out = op(leaves[0], index, leaves[1], leaves[2], leaves[3], "silu", first)
    return [out, *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize(
    ("dtype", "kernel", "tol"),
    [(torch.float64, "segments", {}), (torch.float32, "grouped_mm", {"atol": 1e-5, "rtol": 1e-5})],
)
@pytest.mark.parametrize("share", ["all", "some"])
def test_the_grouped_experts_equal_the_loop_over_experts(dtype, kernel, tol, share) -> None:
    """``some``: experts 2-4 of 6, a rank's share under an experts split (a partial sum)."""
    x, index, weight, gate_up, down = _inputs(dtype)
    assert grouped.grouped_kernel(x, gate_up, down) == kernel
    g = torch.randn_like(x)
    sl, first = (slice(None), 0) if share == "all" else (slice(2, 5), 2)
    got = _run(experts_math, x, index, weight, gate_up, down, g, sl, first)
    want = _run(_explicit, x, index, weight, gate_up, down, g, sl, first)
    for name, a, b in zip(("out", "dx", "dweight", "dgate_up", "ddown"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_both_ways_of_the_grouped_product_agree(monkeypatch) -> None:
    """The segments way on the grouped kernel's own float32 operands."""
    x, index, weight, gate_up, down = _inputs(torch.float32)
    g = torch.randn_like(x)
    got = _run(experts_math, x, index, weight, gate_up, down, g)
    monkeypatch.setattr(grouped, "grouped_kernel", lambda *a: "segments")
    want = _run(experts_math, x, index, weight, gate_up, down, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_grouped_kernel_is_taken_only_where_it_runs() -> None:
    x, _, _, gate_up, down = _inputs(torch.float32)
    assert grouped.grouped_kernel(x, gate_up, down) == "grouped_mm"
    assert grouped.grouped_kernel(x.double(), gate_up.double(), down.double()) == "segments"
    odd = _inputs(torch.float32, hidden=6)  # rows of 24 bytes: not on 16-byte strides
    assert grouped.grouped_kernel(odd[0], odd[3], odd[4]) == "segments"
    assert grouped.grouped_kernel(x.half(), gate_up, down) == "segments"  # mixed dtypes


def test_rows_past_every_group_come_out_zero() -> None:
    x, _, _, gate_up, down = _inputs(torch.float32)
    counts = torch.tensor([3, 0, 5, 2, 0, 1])
    y = grouped.grouped_ffn(x, counts, gate_up, down, "silu")
    assert y.shape == (40, 16) and not y[11:].any()
    want = expert_ffn(x[3:8], gate_up[2], down[2], "silu")
    torch.testing.assert_close(y[3:8], want, atol=1e-5, rtol=1e-5)


@CUDA
def test_the_cuda_grouped_experts_equal_the_loop_without_a_host_sync() -> None:
    x, index, weight, gate_up, down = _inputs(torch.bfloat16, "cuda", hidden=64, ffn=32)
    g = torch.randn_like(x)
    want = _run(_explicit, x, index, weight, gate_up, down, g)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run(experts_math, x, index, weight, gate_up, down, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
