"""The parts optimizer offload steps (``optimizer.py``): each tensor's head on the device and
tail on the host, tails side by side in chunks stepped as one tensor; a chunk cut where only
some of its tails have a gradient; one tensor's optimizer state joined from its head's and
tail's and split back into them."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class _Piece:
    """One tensor the optimizer steps, its flat head on the device and its tail on the host."""

    fqn: str
    param: torch.Tensor  # what the program reads (a ZeRO shard or a local tensor)
    kept: int  # elements of the head
    host: torch.Tensor  # the tail's master weights (a view of its dtype's flat masters)
    buffer: torch.Tensor  # the tail's gradient, filled by routing (the same view of the flat
    # gradients)
    head: torch.Tensor  # a view of the param's first ``kept`` elements
    tail: int = 0  # elements of the tail
    start: int = 0  # where the tail starts in its dtype's flat buffers
    has_grad: bool = False
    copied: Any = None  # the CUDA event after the gradient's copy to the host


@dataclass(eq=False)
class _Chunk:
    """Tails side by side in their flat buffers, stepped as one tensor."""

    pieces: list[_Piece]
    master: torch.Tensor  # their masters, one view (a leaf the host optimizer steps)
    grad: torch.Tensor  # their gradients, the same view of the flat gradients
    returned: Any = None  # the CUDA event after the updated tails' copy back
    #: the copy back: the tails' views of the device tensors and of the masters, made once
    back: tuple[list[torch.Tensor], list[torch.Tensor]] = ((), ())

    def __post_init__(self) -> None:
        self.back = (
            [p.param.detach().view(-1)[p.kept :] for p in self.pieces],
            [p.host for p in self.pieces],
        )


@dataclass(eq=False)
class _Group:
    """The host and device optimizers of the pieces one group of the user's optimizer holds."""

    pieces: list[_Piece]
    host: torch.optim.Optimizer | None
    device: torch.optim.Optimizer | None
    chunks: dict[int, _Chunk] = field(default_factory=dict)  # id(piece) -> its chunk


def _elementwise(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == master.shape


def _cut(group: _Group, ready: set[int]) -> None:
    """Cut each chunk of ``group`` whose pieces are some in ``ready`` and some not into runs
    of one kind: each keeps its slice of the chunk's elementwise state (views of it) and a
    copy of the rest (a step count)."""
    for chunk in {id(c): c for c in group.chunks.values()}.values():
        kinds = [id(p) in ready for p in chunk.pieces]
        if all(kinds) or not any(kinds):
            continue
        assert group.host is not None  # chunks are made only beside a host optimizer
        params = group.host.param_groups[0]["params"]
        index = next(i for i, t in enumerate(params) if t is chunk.master)
        state, first, parts = group.host.state.pop(chunk.master, {}), chunk.pieces[0].start, []
        for _, pieces in itertools.groupby(chunk.pieces, key=lambda p: id(p) in ready):
            run = list(pieces)
            a, b = run[0].start - first, run[-1].start + run[-1].tail - first
            part = _Chunk(run, chunk.master[a:b], chunk.grad[a:b], chunk.returned)
            if state:
                group.host.state[part.master] = {  # views of the moments, a step count each
                    k: v[a:b] if _elementwise(v, chunk.master) else copy.deepcopy(v)
                    for k, v in state.items()
                }
            group.chunks |= {id(p): part for p in run}
            parts.append(part.master)
        params[index : index + 1] = parts


def _joined(piece: _Piece, head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """One tensor's optimizer state from its head's and its tail's."""
    out = {}
    for key in head.keys() | tail.keys():
        h, t = head.get(key), tail.get(key)
        either = t if t is not None else h
        if isinstance(either, torch.Tensor) and either.dim() == 1:
            parts = [x.detach().to("cpu") for x in (h, t) if x is not None]
            out[key] = torch.cat(parts).view(piece.param.shape)
        elif isinstance(either, torch.Tensor):
            out[key] = either.detach().to("cpu").clone()
        else:
            out[key] = either
    return out


def _split_into(
    piece: _Piece, key: str, value: Any, head: dict[str, Any], tail: dict[str, Any]
) -> None:
    """``value`` (one entry of the whole tensor's state) into its head's and tail's state."""
    for part, start, stop in ((head, 0, piece.kept), (tail, piece.kept, piece.param.numel())):
        if key not in part:
            continue
        if isinstance(part[key], torch.Tensor) and part[key].dim() == 1:  # elementwise
            part[key].copy_(value.reshape(-1)[start:stop])
        elif isinstance(part[key], torch.Tensor):
            part[key].copy_(torch.as_tensor(value, device=part[key].device))
        else:
            part[key] = value


__all__: list[str] = []
