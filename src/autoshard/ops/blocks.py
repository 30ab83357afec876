"""One attention product of a block of query rows against a block of keys, as ring attention
and the all-gather method compute them (ops/ring.py): its output and the rows' log-sum-exp,
its gradients from the whole rows' output and log-sum-exp, and the online-softmax merge of
products that share rows.

A product runs a fused kernel that returns the log-sum-exp (``kernel``): the flash kernel on
CPU (any floating dtype, an explicit mask as its additive bias, grouped heads natively); on
CUDA the flash kernel (half precision, no mask), cuDNN's where flash is switched off, the
memory-efficient kernel otherwise (float32 too, a mask as its bias), each as far as
``torch.backends.cuda`` allows it, as ``scaled_dot_product_attention`` itself asks. A causal
product is a square block on the diagonal and takes the kernel's own causal flag; a product
below the diagonal takes no mask; one above it is never asked for. Only what no kernel takes
(float64 on CUDA, other devices) is computed explicitly, its scores in float32 or wider.
"""

from __future__ import annotations

import math

import torch

__all__ = ["KERNELS", "kernel", "merge", "pair_backward", "pair_forward", "scores"]

#: the kernels a product may run, ``explicit`` the one without a fused kernel
KERNELS = ("flash_cpu", "flash", "cudnn", "efficient", "explicit")

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
HALF = (torch.float16, torch.bfloat16)


def kernel(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The kernel a product of ``q`` against ``k`` runs (``KERNELS``)."""
    if q.dim() != 4:  # the kernels take (batch, heads, rows, head) alone
        return "explicit"
    if q.device.type == "cpu":
        return "flash_cpu"
    if q.device.type != "cuda" or q.shape[-3] != k.shape[-3]:
        return "explicit"
    head, cuda = q.shape[-1], torch.backends.cuda
    ampere = torch.cuda.get_device_capability(q.device) >= (8, 0)  # flash's and cuDNN's least
    if q.dtype in HALF and mask is None and head % 8 == 0 and ampere:
        if head <= 256 and cuda.flash_sdp_enabled():
            return "flash"
        if head <= 128 and cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available():
            return "cudnn"
    if q.dtype in (*HALF, torch.float32) and cuda.mem_efficient_sdp_enabled():
        if head % (4 if q.dtype == torch.float32 else 8) == 0:
            return "efficient"
    return "explicit"


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None,
    cols: slice,
    rows: slice,
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if mask is not None:
        m = mask[..., rows, cols]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    return s


def _bias(
    mask: torch.Tensor | None, rows: slice, cols: slice, q: torch.Tensor, align: int = 1
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The product's part of ``mask`` as the additive bias the kernels take, in ``q``'s dtype,
    its rows' stride a multiple of ``align`` elements (the memory-efficient kernel's); and the
    rows it masks whole. The kernels give such a row log-sum-exp 0 (no key, no weight), where
    the merge must weigh it nothing: -inf."""
    if mask is None:
        return None, None
    m = mask[..., rows, cols]
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(~m, float("-inf"))
    m = m.to(q.dtype)
    keys = m.shape[-1]
    if align > 1 and (m.stride(-1) != 1 or any(s % align for s in m.stride()[:-1] if s)):
        padded = m.new_zeros((*m.shape[:-1], -(-keys // align) * align))
        padded[..., :keys] = m
        m = padded[..., :keys]
    dead = ~(m > float("-inf")).any(dim=-1)
    return m.expand(*q.shape[:-1], keys), dead


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the CUDA kernels read it: rows of unit stride, other strides of 8 elements."""
    if t.stride(-1) == 1 and not any(s % 8 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


def _no_rng(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The random state a kernel's backward takes; without dropout it reads none."""
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    return empty, empty


def _cuda_forward(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    aten = torch.ops.aten
    if name == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    elif name == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse.reshape(lse.shape[:3])  # (b, h, rows, 1) in some releases
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse[..., : q.shape[-2]]  # rows padded to 32
    return out, lse


def _cuda_backward(
    name: str,
    g: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    q, k, v, out, g = (_aligned(t) for t in (q, k, v, out, g))
    aten, (seed, offset) = torch.ops.aten, _no_rng(q)
    rows, keys = q.shape[-2], k.shape[-2]
    lse = lse.float().contiguous()
    if name == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, None, None, rows, keys, 0.0, causal, seed, offset, scale=scale
        )
    if name == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            g,
            q,
            k,
            v,
            out,
            lse.unsqueeze(-1),
            seed,
            offset,
            bias,
            None,
            None,
            rows,
            keys,
            0.0,
            causal,
            scale=scale,
        )
    padded = lse.new_zeros((*lse.shape[:-1], math.ceil(rows / 32) * 32))
    padded[..., :rows] = lse
    return aten._scaled_dot_product_efficient_attention_backward(
        g,
        q,
        k,
        v,
        bias,
        out,
        padded,
        seed,
        offset,
        0.0,
        (True, True, True, False),
        causal,
        scale=scale,
    )[:3]


def pair_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None,
    cols: slice,
    rows: slice,
    acc: torch.dtype,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One product's (output, log-sum-exp), in ``acc``, by kernel ``name`` (by default the
    one ``kernel`` picks)."""
    name = name or kernel(q, k, mask)
    if name == "explicit":
        return _explicit_forward(q, k, v, scale, diagonal, mask, cols, rows, acc)
    bias, dead = _bias(mask, rows, cols, q, 16 if name == "efficient" else 1)
    if name == "flash_cpu":
        out, lse = FLASH_CPU(q, k, v, 0.0, diagonal, attn_mask=bias, scale=scale)
    else:
        out, lse = _cuda_forward(name, q, k, v, diagonal, scale, bias)
    lse = lse.to(acc)
    return out.to(acc), lse if dead is None else lse.masked_fill(dead, float("-inf"))


def _explicit_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None,
    cols: slice,
    rows: slice,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _grouped(k, q), _grouped(v, q)
    s = scores(q.to(acc), k.to(acc), scale, diagonal, mask, cols, rows)
    top = s.amax(dim=-1)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(s - top.unsqueeze(-1))
    total = p.sum(dim=-1)
    out = torch.matmul(p, v.to(acc)) / total.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)
    return out, top + torch.log(total)


def _grouped(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Keys or values of fewer heads than ``q``'s, each repeated for its group of query heads."""
    if t.shape[-3] == q.shape[-3]:
        return t
    return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3)


def _ungrouped(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A gradient of ``_grouped(t)`` as ``t``'s: each group's heads summed."""
    if grad.shape[-3] == t.shape[-3]:
        return grad
    heads = t.shape[-3]
    return grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(dim=-3)


def pair_backward(
    g: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None,
    cols: slice,
    rows: slice,
    acc: torch.dtype,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One product's (dq, dk, dv) in ``acc``, from the whole rows' output and log-sum-exp, by
    kernel ``name`` (by default the one ``kernel`` picks): the fused kernels' backward reads
    the rows' softmax from them, so a block's gradients need no other block."""
    name = name or kernel(q, k, mask)
    if name == "explicit":
        return _explicit_backward(g, q, k, v, out, lse, scale, diagonal, mask, cols, rows, acc)
    bias = _bias(mask, rows, cols, q, 16 if name == "efficient" else 1)[0]
    if name == "flash_cpu":
        lse = lse.to(torch.promote_types(q.dtype, torch.float32))
        grads = FLASH_CPU_BACKWARD(g, q, k, v, out, lse, 0.0, diagonal, attn_mask=bias, scale=scale)
    else:
        grads = _cuda_backward(name, g, q, k, v, out, lse, diagonal, scale, bias)
    return tuple(t.to(acc) for t in grads)  # type: ignore[return-value]


def _explicit_backward(
    g: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None,
    cols: slice,
    rows: slice,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qa, ga = q.to(acc), g.to(acc)
    ka, va = _grouped(k, q).to(acc), _grouped(v, q).to(acc)
    s = scores(qa, ka, scale, diagonal, mask, cols, rows)
    p = torch.exp(s - lse.unsqueeze(-1))
    delta = (ga * out.to(acc)).sum(dim=-1, keepdim=True)
    dv = torch.matmul(p.transpose(-2, -1), ga)
    ds = p * (torch.matmul(ga, va.transpose(-2, -1)) - delta) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qa)
    return torch.matmul(ds, ka), _ungrouped(dk, k), _ungrouped(dv, v)


def merge(
    total: torch.Tensor, lse: torch.Tensor, r: slice, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Fold one product's rows ``r`` (output and log-sum-exp) into the running ones: the part's
    share of the rows' softmax is ``sigmoid(part_lse - lse)``, so one interpolation in place
    (rows no key has reached yet: -inf on both sides, nothing taken)."""
    held = lse[..., r]
    share = torch.sigmoid(part_lse - held).nan_to_num_(0.0)
    total[..., r, :].lerp_(part, share.unsqueeze(-1))
    lse[..., r] = torch.logaddexp(held, part_lse)
