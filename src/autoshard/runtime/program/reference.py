"""The model as one device runs it under autoshard: the reference every parallel run must
equal, a ``ParallelModule`` over a one-device mesh."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoshard.graph import OpGraph, call_inputs, capture_modes
from autoshard.mesh import MeshInfo
from autoshard.options import Options
from autoshard.precision import Precision, precision_policy
from autoshard.runtime.program.parallel import ParallelModule
from autoshard.runtime.state import check_init
from autoshard.search import plan_graph


def single_device(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    captured: dict[bool, OpGraph] | None = None,
    precision: str | Precision | None = None,
    init: Any = None,
    device: Any = None,
) -> ParallelModule:
    """The model as one device runs it under autoshard (the same dropout masks as any split,
    the same ``precision`` policy, the same ``init`` of a meta model): the reference every
    parallel run must equal. Runs without collectives, on any rank, on ``device`` (the
    rank's, as ``parallelize`` picks it)."""
    check_init(model, init)
    info = MeshInfo(("dp",), (1,), ("dp",))
    policy = precision_policy(precision).resolve(model)
    if captured is None:
        example_inputs, example_kwargs = call_inputs(example_inputs, example_kwargs)
        captured = capture_modes(
            model, example_inputs, example_kwargs, loss_fn=loss_fn, dtype=policy.compute
        )
    plans = {mode: plan_graph(captured[mode], info) for mode in (True, False)}
    return ParallelModule(
        model, captured, plans, 0, Options(seed=seed, precision=policy, init=init, device=device)
    )


__all__ = ["single_device"]
