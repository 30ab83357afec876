"""The fused attention kernels of a ring's products (ops/blocks.py) equal the explicit
product, forward and backward: on CPU in float64 (the CPU flash kernel takes it), causal and
not, under a mask, with grouped heads; the CUDA kernels where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from autoshard.ops import blocks, ring

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _tensors(heads: int, kv_heads: int, rows: int, keys: int, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, rows, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(2, kv_heads, keys, 16, dtype=torch.float64, generator=gen)
    v = torch.randn(2, kv_heads, keys, 16, dtype=torch.float64, generator=gen)
    g = torch.randn(2, heads, rows, 16, dtype=torch.float64, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, g)]


def _both(name: str, q, k, v, g, diagonal: bool, mask, acc) -> list[torch.Tensor]:
    """A product's output, log-sum-exp and gradients by kernel ``name``."""
    rows, cols = slice(0, q.shape[-2]), slice(0, k.shape[-2])
    out, lse = blocks.pair_forward(q, k, v, 0.3, diagonal, mask, cols, rows, acc, name)
    grads = blocks.pair_backward(
        g, q, k, v, out.to(q.dtype), lse, 0.3, diagonal, mask, cols, rows, acc, name
    )
    return [out, lse, *grads]


def _masks(rows: int, keys: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(rows, keys, generator=gen) > 0.3
    keep[:, 0] = True  # every row sees a key
    return {
        "none": None,
        "bool": keep,
        "float": torch.randn(rows, keys, dtype=torch.float64, generator=gen),
    }


@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_the_cpu_flash_product_equals_the_explicit_one(diagonal, mask, heads) -> None:
    q, k, v, g = _tensors(*heads, 24, 24, torch.float64)
    m = _masks(24, 24)[mask]
    assert blocks.kernel(q, k, m) == "flash_cpu"
    fused = _both("flash_cpu", q, k, v, g, diagonal, m, torch.float64)
    explicit = _both("explicit", q, k, v, g, diagonal, m, torch.float64)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fused, explicit, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=name)


def test_a_row_a_mask_hides_whole_weighs_nothing_in_the_merge() -> None:
    """The kernels give such a row log-sum-exp 0; the merge needs -inf, as explicit gives."""
    q, k, v, _ = _tensors(2, 2, 8, 8, torch.float64)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    rows, cols = slice(0, 8), slice(0, 8)
    _, lse = blocks.pair_forward(q, k, v, 0.3, False, keep, cols, rows, torch.float64)
    assert torch.isneginf(lse[..., 3]).all() and torch.isfinite(lse[..., :3]).all()


def test_the_ring_on_one_rank_equals_pytorch_forward_and_backward() -> None:
    """The all-gather method's op (rows against every key, dealt as a balanced ring deals
    them; grouped heads as they are) and the ring's, on one rank, against
    ``scaled_dot_product_attention``: causal and not, products cut to ``LEAF`` rows and whole."""
    q, k, v, g = _tensors(4, 2, 32, 32, torch.float64)
    kept = ring.LEAF
    try:
        for leaf in (64, 4):
            ring.LEAF = leaf
            got = lambda q, k, v: ring.causal_rows_attention(q, k, v, [0], 0, enable_gqa=True)  # noqa: E731
            _check(got, (q, k, v, g), True, f"all-gather, leaf {leaf}")
            wide = [t.repeat_interleave(2, -3) for t in (k, v)]
            for causal in (False, True):
                got = lambda q, k, v, c=causal: ring.ring_attention(q, k, v, None, [0], 0, None, c)  # noqa: E731
                _check(got, (q, *wide, g), causal, f"ring, causal {causal}, leaf {leaf}")
    finally:
        ring.LEAF = kept


def _check(op, tensors, causal: bool, what: str) -> None:
    *inputs, g = tensors
    want_in = [t.clone().requires_grad_() for t in inputs]
    want = torch.nn.functional.scaled_dot_product_attention(
        *want_in, is_causal=causal, enable_gqa=True
    )
    want_grads = torch.autograd.grad(want, want_in, g)
    got_in = [t.clone().requires_grad_() for t in inputs]
    got = op(*got_in)
    got_grads = torch.autograd.grad(got, got_in, g)
    torch.testing.assert_close(got, want, msg=f"out: {what}")
    for name, a, b in zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, msg=f"{name}: {what}")


def test_the_kernel_a_product_runs() -> None:
    q, k, _, _ = _tensors(4, 2, 8, 8, torch.float32)
    assert blocks.kernel(q, k, None) == "flash_cpu"
    assert blocks.kernel(q[0], k[0], None) == "explicit"  # no batch dim: no kernel takes it
    assert blocks.kernel(q.to("meta"), k.to("meta"), None) == "explicit"


def _cuda_kernels(dtype) -> list[str]:
    q = torch.empty(1, 2, 8, 64, dtype=dtype, device="cuda")
    names = {blocks.kernel(q, q, None), blocks.kernel(q, q, torch.ones(8, 8, device="cuda"))}
    return sorted(names - {"explicit"})


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("diagonal", [False, True])
def test_the_cuda_kernels_equal_the_explicit_product(dtype, diagonal) -> None:
    """At bf16 (flash, cuDNN, memory-efficient) the kernels read inputs rounded alike and sum
    in float32; tolerances are bf16's resolution of outputs of order one."""
    q, k, v, g = _tensors(4, 4, 96, 96, dtype, "cuda")
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    keep = torch.rand(96, 96, device="cuda") > 0.3
    keep[:, 0] = True
    names = _cuda_kernels(dtype)
    assert names, "no fused CUDA kernel allowed"
    for name in names:
        mask = keep if name == "efficient" else None
        fused = _both(name, q, k, v, g, diagonal, mask, torch.float32)
        explicit = _both("explicit", q, k, v, g, diagonal, mask, torch.float32)
        for part, a, b in zip(("out", "lse", "dq", "dk", "dv"), fused, explicit, strict=True):
            torch.testing.assert_close(a, b, **tol, msg=f"{name} {part}")
