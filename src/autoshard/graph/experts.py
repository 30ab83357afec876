"""Which modules of a model are experts, and capturing each as one ``autoshard::experts`` op.

An experts module takes ``(tokens [T, H], expert indices [T, k], routing weights [T, k])`` and
returns ``[T, H]``: each token through its ``k`` experts, weighted and summed. Its weights are
``gate_up_proj [E, 2F, H]`` (gate rows first) and ``down_proj [E, H, F]``, transformers' layout.
Three kinds are recognised: autoshard's own (``autoshard.models.moe.Experts``), transformers'
experts classes (Mixtral, Qwen-MoE, DeepSeek...: those its ``use_experts_implementation``
decorates, whatever ``experts_implementation`` they run eagerly) and any module marked with
:func:`mark_experts`. While the model is captured, each one's forward is the op, so the routing
(data-dependent: which tokens reach which expert) is one node of the graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from autoshard.ops.experts import ACTIVATIONS

#: transformers' flags of an experts class, and the value the op computes
_TRANSFORMERS_FLAGS = {
    "has_gate": True,
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_post_expert_norm": False,
}


class ExpertsError(ValueError):
    """A module that looks like experts but computes something the experts op does not."""


def mark_experts(module: nn.Module, activation: str = "silu") -> nn.Module:
    """Mark ``module`` as experts: its forward is ``(tokens, indices, weights) -> output``
    and it holds ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``; ``activation`` is
    applied to the gate half. Returns the module."""
    _check_weights(module, type(module).__name__)
    if activation not in ACTIVATIONS:
        raise ExpertsError(
            f"mark_experts: activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}"
        )
    module.experts_activation = activation
    return module


def experts_activation(module: nn.Module, path: str = "") -> str | None:
    """The activation of an experts module, None for any other module."""
    own = getattr(module, "experts_activation", None)
    if isinstance(own, str):
        return own
    if not all(hasattr(module, f) for f in (*_TRANSFORMERS_FLAGS, "gate_up_proj", "config")):
        return None
    where = f"{path or 'the model'} ({type(module).__name__})"
    for flag, wanted in _TRANSFORMERS_FLAGS.items():
        if getattr(module, flag) != wanted:
            raise ExpertsError(
                f"{where}: experts with {flag}={getattr(module, flag)} are not supported yet "
                f"(the experts op computes {flag}={wanted})"
            )
    gate = getattr(type(module), "_apply_gate", None)
    if getattr(gate, "__name__", "") != "_default_apply_gate":
        raise ExpertsError(f"{where}: experts with their own gating are not supported yet")
    activation = getattr(module.config, "hidden_act", None)
    if activation not in ACTIVATIONS:
        raise ExpertsError(
            f"{where}: activation {activation!r}; the experts op has {', '.join(ACTIVATIONS)}"
        )
    _check_weights(module, where)
    return activation


def _check_weights(module: nn.Module, where: str) -> None:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        raise ExpertsError(f"{where}: experts hold gate_up_proj and down_proj tensors")
    (e, f2, h), (e2, h2, f) = gate_up.shape, down.shape
    if e != e2 or h != h2 or f2 != 2 * f:
        raise ExpertsError(
            f"{where}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
            "are not [E, 2F, H] and [E, H, F]"
        )


@contextmanager
def experts_as_ops(model: nn.Module) -> Iterator[list[str]]:
    """For the block, every experts module of ``model`` runs as the experts op; yields their
    module paths."""
    found: list[tuple[nn.Module, str, object]] = []
    for path, module in model.named_modules():
        activation = experts_activation(module, path)
        if activation is not None:
            found.append((module, path, module.__dict__.get("forward")))
            module.forward = _as_op(module, activation)
    try:
        yield [path for _, path, _ in found]
    finally:
        for module, _, own in found:  # the module's own forward back, as it was
            if own is None:
                del module.forward
            else:
                module.forward = own


def _as_op(module: nn.Module, activation: str):  # noqa: ANN202
    def forward(tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):  # noqa: ANN202
        return torch.ops.autoshard.experts(
            tokens, indices, weights, module.gate_up_proj, module.down_proj, activation
        )

    return forward


__all__ = ["ExpertsError", "experts_activation", "experts_as_ops", "mark_experts"]
