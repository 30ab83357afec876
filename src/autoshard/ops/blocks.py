"""One attention product of a block of query rows against a block of keys, as ring attention
and the all-gather method compute them (ops/ring.py): its output and the rows' log-sum-exp,
its gradients from the whole rows' output and log-sum-exp, and the online-softmax merge of
products that share rows. On CPU without an explicit mask a product runs the fused flash
kernel; elsewhere the explicit product, in float32 or wider.
"""

from __future__ import annotations

import torch

__all__ = ["fused", "merge", "pair_backward", "pair_forward", "scores"]


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


def fused(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a product runs the fused CPU kernel (which returns the rows' log-sum-exp): on
    CPU, with no explicit mask."""
    return q.device.type == "cpu" and mask is None


FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One product's (output, log-sum-exp), in ``acc``."""
    if fused(q, mask):
        out, lse = FLASH_CPU(q, k, v, 0.0, diagonal, scale=scale)
        return out.to(acc), lse.to(acc)
    s = scores(q.to(acc), k.to(acc), scale, diagonal, mask, cols, rows)
    top = s.amax(dim=-1)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(s - top.unsqueeze(-1))
    total = p.sum(dim=-1)
    out = torch.matmul(p, v.to(acc)) / total.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)
    return out, top + torch.log(total)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One product's (dq, dk, dv) in ``acc``, from the whole rows' output and log-sum-exp."""
    if fused(q, mask):
        grads = FLASH_CPU_BACKWARD(
            g,
            q,
            k,
            v,
            out,
            lse.to(torch.promote_types(q.dtype, torch.float32)),
            0.0,
            diagonal,
            scale=scale,
        )
        return tuple(t.to(acc) for t in grads)  # type: ignore[return-value]
    qa, ka, va, ga = (t.to(acc) for t in (q, k, v, g))
    s = scores(qa, ka, scale, diagonal, mask, cols, rows)
    p = torch.exp(s - lse.unsqueeze(-1))
    delta = (ga * out.to(acc)).sum(dim=-1, keepdim=True)
    dv = torch.matmul(p.transpose(-2, -1), ga)
    ds = p * (torch.matmul(ga, va.transpose(-2, -1)) - delta) * scale
    return torch.matmul(ds, ka), torch.matmul(ds.transpose(-2, -1), qa), dv


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
