"""Capture in one trace (graph/traced.py) against torch.export's two: the same OpGraph, node
for node (names, ops, arguments, module paths, op keys, shapes, dtypes, kinds, parameter
names), the same inputs, outputs and call specs, on the reference models and transformers'
models, on real and meta tensors, in train and eval; and export where the one trace would
differ (a mutation, a no_grad region, a constant)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard import CaptureError
from autoshard.graph import OpGraph, capture
from autoshard.graph import traced as traced_module
from autoshard.graph.traced import traced
from autoshard.models import build, reference_config

warnings.filterwarnings("ignore", category=FutureWarning)

capture_module = sys.modules[
    "autoshard.graph.capture"
]  # (the package's ``capture`` is the function)


def _facts(og: OpGraph) -> list[tuple]:
    """Everything later stages read of each node, and of the graph."""
    rows: list[tuple] = [
        ("graph", tuple(og.inputs), tuple(og.outputs), og.in_spec, og.out_spec,
         tuple(sorted(og.mutations.items())), tuple(sorted(og.aliases.items())))
    ]  # fmt: skip
    for info in og:
        node = info.node
        rows.append((
            node.name, node.op, str(node.target), repr(node.args), repr(node.kwargs), info.kind,
            info.path, info.op, info.block, info.in_shapes, info.in_dtypes, info.out_shapes,
            info.out_dtypes, info.params, info.requires_grad if info.kind != "op" else None,
        ))  # fmt: skip
    return rows


def _both(model: nn.Module, example: tuple, loss_fn: Any = None, train: bool = True,
          dtype: torch.dtype | None = None, kwargs: dict | None = None,
          one_trace: bool = True) -> None:  # fmt: skip
    """The capture equals export's, made in one trace (or, ``one_trace`` false, by export)."""
    made: list[Any] = []

    def spy(*args: Any) -> Any:
        made.append(traced(*args))
        return made[-1]

    capture_module.traced = spy
    try:
        one = capture(model, example, kwargs or {}, loss_fn=loss_fn, train=train, dtype=dtype)
    finally:
        capture_module.traced = traced
    assert made and (made[-1] is not None) == one_trace  # (not export twice)
    traced_module.ENABLED[0] = False
    try:
        two = capture(model, example, kwargs or {}, loss_fn=loss_fn, train=train, dtype=dtype)
    finally:
        traced_module.ENABLED[0] = True
    assert _facts(one) == _facts(two)


def _loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp", "moe"])
@pytest.mark.parametrize("train", [True, False])
def test_reference_models_are_captured_as_export_captures_them(name: str, train: bool) -> None:
    torch.manual_seed(0)
    config = reference_config(name, dropout=0.1)
    model = build(config)  # gpt: tied embeddings
    _both(model, config.example_batch(2), train=train)
    _both(model, config.example_batch(2), train=train, dtype=torch.bfloat16)  # on meta


def _transformers(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, use_cache=False, attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.0, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("kind", ["llama", "mixtral", "gpt2"])
def test_transformers_models_are_captured_as_export_captures_them(kind: str) -> None:
    """Mixtral's router divides its weights in place (``/=``): made functional, as export
    makes it."""
    model, one = _transformers(kind), True
    idx = torch.randint(0, 128, (2, 16))
    for train in (True, False):
        _both(model, (idx, idx.clone()), loss_fn=_loss, train=train, one_trace=one)
    _both(model, (idx, idx.clone()), loss_fn=_loss, dtype=torch.bfloat16, one_trace=one)
    # a dict batch as keywords, the model's own loss (use_cache off: no cache in the output)
    batch = {"input_ids": idx, "labels": idx.clone(), "attention_mask": torch.ones_like(idx)}
    _both(model, batch, one_trace=one)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)).mean(dim=1)


def test_torch_s_encoder_layer_is_captured_as_export_captures_it() -> None:
    torch.manual_seed(0)
    _both(_Encoder(), (torch.randn(4, 6, 32), torch.randint(0, 8, (4,))), loss_fn=F.cross_entropy)


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class _NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.abs().amax()
        return self.fc(x) / scale


class _Constant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.offset = torch.ones(8)  # neither parameter nor buffer: a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset


class _OnAView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y[:, :4].mul_(2)  # through a view: y changes too
        return y


class _OnAnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


class _Fresh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y /= y.sum(dim=-1, keepdim=True)
        z = self.fc(y).relu_()
        return (y * z).div(3)


def test_in_place_ops_on_fresh_values_are_captured_as_export_captures_them() -> None:
    torch.manual_seed(0)
    _both(_Fresh(), (torch.randn(4, 8),))
    _both(_Fresh(), (torch.randn(4, 8),), train=False)


class _Promoting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).half()
        y.mul_(self.scale)  # stays float16 in place; mul would promote to float32
        return y.float()


@pytest.mark.parametrize("model", [_OnAView, _Norm, _Constant, _Promoting])
def test_what_export_changes_is_left_to_export(model: type) -> None:
    """A mutation of a view's base, of a buffer (training's statistics) or one whose
    functional op would promote, or a constant: no one trace; the capture is export's."""
    root, x = model(), torch.randn(4, 8)
    root.train()
    assert traced(root, (x,), {}) is None
    og = capture(root, (x,))
    if model is _Norm:
        assert og.mutations  # the running statistics, as export reports them
    assert any(info.kind == "op" for info in og)


def test_a_mutated_input_is_refused_as_export_refuses_it() -> None:
    root = _OnAnInput()
    assert traced(root, (torch.randn(4, 8),), {}) is None
    with pytest.raises(CaptureError, match="USER_INPUT_MUTATION"):
        capture(root, (torch.randn(4, 8),))


def test_a_no_grad_region_is_left_to_export() -> None:
    root = _NoGrad()
    assert traced(root, (torch.randn(4, 8),), {}) is None
    og = capture(root, (torch.randn(4, 8),))
    assert [info.op for info in og.ops() if info.path == "fc"] == ["linear.0"]


def test_flags_and_modes_are_as_they_were_after_a_trace() -> None:
    """The backends' flags the trace turns off, and the model's mode, are back."""
    flags = (torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled)
    model = build(reference_config("mlp"))
    model.eval()
    capture(model, reference_config("mlp").example_batch(2), train=True)
    assert not model.training
    assert flags == (torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled)
    assert not torch.compiler.is_exporting()
