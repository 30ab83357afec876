"""One export at many batch sizes (``graph/batches.py``): the graph made at a size is the one a
capture at that size makes, op by op, for the reference models and transformers' ones, in
float32 and bfloat16; a model torch cannot export with a free batch is captured size by size.
The sizes captured in one trace each (where the model can be) are those graphs too.

These tests make the sizes from the export (``_export_only``), except where they say."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from test_capture_traced import _OnAView

import autoshard.graph.batches as batches_module
from autoshard.graph import capture
from autoshard.graph.batches import Batches
from autoshard.models import GPT, GPTConfig, Llama, LlamaConfig

warnings.filterwarnings("ignore", category=FutureWarning)


def _loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = y.logits if hasattr(y, "logits") else y
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))


@pytest.fixture(autouse=True)
def _export_only(monkeypatch, request):
    """Sizes made from the one export, not captured in one trace each (``one_trace`` tests:
    both)."""
    if "one_trace" not in request.node.name:
        monkeypatch.setattr(batches_module, "captured_in_one_trace", lambda *a, **k: None)


def _facts(og) -> list:
    """Every node: its op, target, arguments (graph values by position) and the facts the
    planner reads (kind, module path, op key, block, shapes, dtypes, FLOPs)."""
    index = {n: i for i, n in enumerate(og.graph.nodes)}
    nodes = [
        (n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])))
        for n in og.graph.nodes
    ]
    infos = [
        (i.kind, i.path, i.op, i.block, i.in_shapes, i.in_dtypes, i.out_shapes, i.flops) for i in og
    ]
    return nodes + infos


def _reference(name: str) -> nn.Module:
    with torch.device("meta"):
        if name == "gpt":
            return GPT(GPTConfig(block_size=64, hidden=64, num_heads=4, vocab_size=128,
                                 num_layers=2))  # fmt: skip
        return Llama(LlamaConfig(max_seq=64, num_kv_heads=2, ffn_hidden=128, hidden=64,
                                 num_heads=4, vocab_size=128, num_layers=2))  # fmt: skip


def _transformers_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "name,dtype",
    [("gpt", None), ("gpt", torch.bfloat16), ("llama", None), ("llama", torch.bfloat16),
     ("transformers-llama", torch.bfloat16)],
)  # fmt: skip
def test_a_size_made_from_the_one_export_is_its_capture(name: str, dtype) -> None:
    model = _transformers_llama() if name == "transformers-llama" else _reference(name)
    idx = torch.zeros(12, 64, dtype=torch.long)
    sizes = Batches(model, (idx, idx.clone()), loss_fn=_loss, dtype=dtype)
    for size in (6, 4, 3):
        made = sizes.at(size)
        alone = capture(model, (idx[:size], idx[:size].clone()), {}, loss_fn=_loss, train=True,
                        dtype=dtype)  # fmt: skip
        assert _facts(made) == _facts(alone), (name, dtype, size)
        inputs = [i for i in made if i.kind == "input"]
        assert inputs and all(i.out_shapes[0][0] == size for i in inputs)
    assert sizes.made == [6, 4, 3] and sizes.captured == []


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_model_with_its_weights_is_made_alike(name: str) -> None:
    """A model on the CPU with its weights (not on the meta device), in float64: the graph's
    own tensors (positions, masks) are made on the CPU beside the inputs."""
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig(block_size=32, hidden=32, num_heads=4, vocab_size=64, num_layers=2))
    else:
        model = Llama(LlamaConfig(max_seq=32, num_kv_heads=2, ffn_hidden=64, hidden=32,
                                  num_heads=4, vocab_size=64, num_layers=2))  # fmt: skip
    model = model.double()
    idx = torch.randint(0, 64, (8, 32))
    sizes = Batches(model, (idx, idx.clone()), loss_fn=_loss)
    for size in (4, 2):
        alone = capture(model, (idx[:size], idx[:size].clone()), {}, loss_fn=_loss, train=True)
        assert _facts(sizes.at(size)) == _facts(alone), size
    assert sizes.made == [4, 2]


class _Branches(nn.Module):
    """A model whose ops depend on its batch size: torch cannot export the batch as free."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w(x)
        return y * 2 if x.shape[0] > 4 else y


def test_a_model_that_branches_on_its_batch_is_captured_size_by_size() -> None:
    model = _Branches()
    x, t = torch.randn(8, 8), torch.randn(8, 8)
    sizes = Batches(model, (x, t), loss_fn=F.mse_loss)
    for size in (8, 2):
        made = sizes.at(size)
        alone = capture(model, (x[:size], t[:size]), {}, loss_fn=F.mse_loss, train=True)
        assert _facts(made) == _facts(alone), size
    assert sizes.captured == [8, 2] and sizes.made == []
    # the branch taken is each size's own
    ops = [[n.target for n in sizes.at(s).graph.nodes if n.op == "call_function"] for s in (8, 2)]
    assert torch.ops.aten.mul.Tensor in ops[0] and torch.ops.aten.mul.Tensor not in ops[1]


class _Encoder(nn.Module):
    """``nn.TransformerEncoderLayer``: its attention merges (seq, batch) into one dim, which
    capture's rewrite (``rows_through_views``) takes apart again."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_an_encoder_layer_made_from_the_one_export_is_its_capture() -> None:
    with torch.device("meta"):
        model = _Encoder()
    x, t = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    sizes = Batches(model, (x, t), loss_fn=F.mse_loss)
    for size in (8, 3):
        alone = capture(model, (x[:size], t[:size]), {}, loss_fn=F.mse_loss, train=True)
        assert _facts(sizes.at(size)) == _facts(alone), size
    assert sizes.made == [8, 3]


def test_a_batch_of_one_is_captured_alone() -> None:
    model = _reference("gpt")
    idx = torch.zeros(4, 64, dtype=torch.long)
    sizes = Batches(model, (idx, idx.clone()), loss_fn=_loss)
    assert _facts(sizes.at(1)) == _facts(
        capture(model, (idx[:1], idx[:1].clone()), {}, loss_fn=_loss, train=True)
    )
    assert sizes.captured == [1]


def test_micro_batch_graphs_serve_the_cli_and_plan_alike() -> None:
    """What both planners call for one of ``m`` micro-batches: made from the one export when
    counts are searched, captured when one count is given; the same graph either way."""
    from autoshard.graph.batches import micro_batch_graphs

    model = _reference("llama")
    idx = torch.zeros(8, 64, dtype=torch.long)
    searched = micro_batch_graphs(model, (idx, idx.clone()), loss_fn=_loss, searched=True)
    given = micro_batch_graphs(model, (idx, idx.clone()), loss_fn=_loss, searched=False)
    for m in (2, 4):
        alone = capture(model, (idx[: 8 // m], idx[: 8 // m].clone()), {}, loss_fn=_loss,
                        train=True)  # fmt: skip
        assert _facts(searched(m)) == _facts(alone) == _facts(given(m)), m


@pytest.mark.parametrize("name", ["gpt", "llama", "transformers-llama"])
def test_sizes_captured_in_one_trace_are_the_sizes_made_from_the_export_one_trace(name) -> None:
    """Where the model is captured in one trace, each size is, and it is the graph the one
    export makes at that size; a model that needs export turns to the export."""
    model = _transformers_llama() if name == "transformers-llama" else _reference(name)
    idx = torch.zeros(12, 64, dtype=torch.long)
    one = Batches(model, (idx, idx.clone()), loss_fn=_loss, dtype=torch.bfloat16)
    exported = Batches(model, (idx, idx.clone()), loss_fn=_loss, dtype=torch.bfloat16)
    exported.one_trace = False
    for size in (6, 4, 3):
        assert _facts(one.at(size)) == _facts(exported.at(size)), (name, size)
    assert one.traced == [6, 4, 3] and one.made == [] and exported.made == [6, 4, 3]


def test_a_model_that_needs_export_is_made_from_the_export_one_trace() -> None:
    model = _OnAView()  # a write through a view: export functionalizes it
    x, t = torch.randn(8, 8), torch.randn(8, 8)
    sizes = Batches(model, (x, t), loss_fn=F.mse_loss)
    for size in (8, 4):
        alone = capture(model, (x[:size], t[:size]), {}, loss_fn=F.mse_loss, train=True)
        assert _facts(sizes.at(size)) == _facts(alone), size
    assert sizes.traced == [] and sizes.made == [8, 4]
