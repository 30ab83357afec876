"""The experts' feed-forward on rows sorted by expert, as one grouped matrix product per layer
of the expert (``torch._grouped_mm``: the rows of expert ``e`` are ``offs[e-1]:offs[e]``),
with no host sync: the offsets stay on the device. Where the build's grouped kernel does not
take the dtype (float64) or the strides (16-byte multiples), the rows are cut by the counts
read once to the host (``sizes``, when the caller knows them already, as expert parallelism
does from its count exchange) and each expert's segment is one product.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "counts_of", "expert_ffn", "grouped_ffn", "grouped_kernel"]


def counts_of(key: torch.Tensor, n: int) -> torch.Tensor:
    """How many of ``key`` are each of ``0 .. n-1``, on the device (``bincount`` reads the
    largest key to the host on CUDA: a sync)."""
    return torch.zeros(n, dtype=torch.long, device=key.device).index_add_(
        0, key, torch.ones_like(key)
    )


#: the experts' activations by the names transformers' configs give them
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def expert_ffn(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor:
    """One expert on rows ``x [n, H]``: ``gate_up [2F, H]`` (gate rows first), ``down [H, F]``."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(ACTIVATIONS[act](gate) * up, down)


def grouped_kernel(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    """``grouped_mm`` where the build's grouped kernel takes these operands (CPU: float32 and
    half precision; CUDA: bfloat16 from compute capability 8.0, as its documentation states),
    their rows and the weights' columns on 16-byte strides; else ``segments``."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return "segments"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return "segments"
    elif x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return "segments"
    if len({x.dtype, gate_up.dtype, down.dtype}) > 1:
        return "segments"
    size = x.element_size()
    widths = (x.shape[-1], gate_up.shape[-2], gate_up.shape[-1], down.shape[-1], down.shape[-2])
    return "grouped_mm" if all(w * size % 16 == 0 for w in widths) else "segments"


def grouped_ffn(
    rows: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rows ``[n, H]`` sorted by expert, ``counts[e]`` of them expert ``e``'s (rows past
    their sum belong to none and come out 0), through their experts: ``gate_up [E, 2F, H]``,
    ``down [E, H, F]``. ``sizes``: ``counts`` on the host, where the caller has them."""
    if rows.shape[0] == 0:
        return rows.new_zeros((0, down.shape[-2]))
    if grouped_kernel(rows, gate_up, down) == "grouped_mm":
        ends = counts.cumsum(0)
        offs = ends.to(torch.int32)
        # rows past the groups the kernel leaves undefined, forward and backward: kept at 0
        kept = (torch.arange(rows.shape[0], device=rows.device) < ends[-1:]).unsqueeze(-1)
        # the weights as views, read column-major by the kernel: no copy of them
        h = torch._grouped_mm(torch.where(kept, rows, 0.0), gate_up.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, -1)
        h = torch.where(kept, ACTIVATIONS[act](gate) * up, 0.0)
        return torch.where(kept, torch._grouped_mm(h, down.transpose(-2, -1), offs=offs), 0.0)
    sizes = counts.tolist() if sizes is None else list(sizes)  # one read of them all
    used = sum(sizes)
    parts = torch.split(rows[:used], sizes)
    outs = [expert_ffn(p, gate_up[e], down[e], act) for e, p in enumerate(parts)]
    rest = rows.new_zeros((rows.shape[0] - used, down.shape[-2]))
    return torch.cat([*outs, rest])
