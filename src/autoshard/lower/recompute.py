"""Recompute (activation checkpointing) of repeated blocks in a rank's program.

``recompute="full"`` keeps only each block's inputs from forward and runs the block again in
backward (Megatron's full recompute, per layer); ``"selective"`` keeps the outputs of the
block's matrix products and runs everything else again in backward: the attention core (as
Megatron's selective recompute does), norms, activations and dropout, which cost little to
compute and much to keep; ``{module glob: mode}`` sets it per block (``"layers.1*"``),
the first glob that matches a block's path wins, other blocks ``"none"``. Only blocks of a
repeated list (``layers.0``, ``layers.1``, ...) are recomputed; what comes before and after
(embedding, head, loss) is kept.

The lowering tags every node it makes with the block of the captured node it lowers; the
program is then split into one submodule per run of nodes of the same block, and each
recomputed block's submodule runs under ``torch.utils.checkpoint`` (non-reentrant). Dropout's
masks are keyed by step and op, so the recomputed forward draws the same masks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from autoshard.options import RECOMPUTE_MODES as MODES

TAG = "autoshard_block"

#: the matrix products, whose outputs selective recompute keeps (everything else in a block,
#: the attention core, norms, activations and dropout among it, is run again in backward)
_KEPT = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
}


class RecomputeError(ValueError):
    """A recompute setting that is not a mode or a mapping of globs to modes."""


def check_recompute(spec: Any) -> str | dict[str, str]:
    """``spec`` as the plan keeps it: one mode, or ``{glob: mode}``."""
    if spec is None:
        return "none"
    if isinstance(spec, str):
        if spec not in MODES:
            raise RecomputeError(f"recompute={spec!r}: expected one of {', '.join(MODES)}")
        return spec
    if isinstance(spec, Mapping):
        out = {}
        for glob, mode in spec.items():
            if mode not in MODES:
                raise RecomputeError(
                    f"recompute[{glob!r}]={mode!r}: expected one of {', '.join(MODES)}"
                )
            out[str(glob)] = mode
        return out
    raise RecomputeError(f"recompute={spec!r}: expected a mode or {{module glob: mode}}")


def mode_of(spec: str | dict[str, str], block: str | None) -> str:
    """The recompute mode of the block at module path ``block`` (None: not in a block)."""
    if block is None:
        return "none"
    if isinstance(spec, str):
        return spec
    return next((m for g, m in spec.items() if fnmatch.fnmatchcase(block, g)), "none")


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if func in _KEPT:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Recompute(nn.Module):
    """Runs ``block`` under activation checkpointing: ``full`` or ``selective``."""

    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(*args)
        if self.mode == "selective":
            context = partial(create_selective_checkpoint_contexts, _policy)
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=context)
        return checkpoint(self.block, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"mode={self.mode}"


#: blocks whose saved tensors another module keeps (the activation offload): its module glob
#: and what wraps a block's submodule, given the block's path
Wrap = tuple[str, Callable[[str, nn.Module], nn.Module]]


def with_recompute(
    gm: fx.GraphModule, spec: str | dict[str, str], wrap: Wrap | None = None
) -> fx.GraphModule:
    """``gm`` split into a submodule per run of nodes of one block (nodes tagged ``TAG``),
    the recomputed blocks' submodules wrapped in :class:`Recompute` and those ``wrap``'s glob
    matches in what it makes; ``gm`` itself when no block is either. A block both name is an
    error: recompute keeps its inputs outside autograd's saved tensors, which ``wrap`` moves."""
    blocks = {n.meta.get(TAG) for n in gm.graph.nodes if n.meta.get(TAG)}
    modes = {b: mode_of(spec, b) for b in blocks}
    wrapped = {b for b in blocks if wrap is not None and fnmatch.fnmatchcase(b, wrap[0])}
    both = sorted(b for b in wrapped if modes[b] != "none")
    if both:
        raise RecomputeError(
            f"recompute={spec!r} and offload={{'activations': {wrap[0]!r}}} both name "
            f"{', '.join(both)}: a block either runs again in backward or offloads what it "
            "saves; leave it out of one of them"
        )
    if not wrapped and not any(m != "none" for m in modes.values()):
        return gm
    runs: dict[fx.Node, int] = {}
    run, previous = 0, object()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        tag = n.meta.get(TAG)
        if tag != previous:
            run, previous = run + 1, tag
        runs[n] = run
    run_tag = {runs[n]: n.meta.get(TAG) for n in runs}
    split = split_module(gm, gm, lambda n: runs[n], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if not name.startswith("submod_"):
            continue
        block = run_tag.get(int(name.removeprefix("submod_")))
        if block in wrapped:
            setattr(split, name, wrap[1](block, sub))
        elif mode_of(spec, block) != "none":
            setattr(split, name, Recompute(sub, mode_of(spec, block)))
    return split


__all__ = [
    "MODES",
    "Recompute",
    "RecomputeError",
    "TAG",
    "Wrap",
    "check_recompute",
    "mode_of",
    "with_recompute",
]
