"""Model FLOPs (docs/cost.md): each op rule's count, summed over the captured graph, equals what
torch's FlopCounterMode counts for the same forward and backward (attention through the math
kernel, which the counter sees as matrix products; the fused CPU kernel counts as zero), and a
strategy's local counts add up over the ranks to the global count."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from autoshard.graph import capture, node_info
from autoshard.mesh import MeshInfo
from autoshard.models import build, reference_config
from autoshard.ops import SpaceRule, rule_for, tensor_inputs
from autoshard.search.options import options

warnings.filterwarnings("ignore", category=FutureWarning)


class Convs(nn.Module):
    """Strided and padded convolutions (the output is smaller than the input) and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.head = nn.Linear(16 * 2 * 2, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return F.cross_entropy(self.head(h.flatten(1)), target)


class HFLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


def _gpt2() -> tuple[nn.Module, tuple]:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    return HFLoss(GPT2LMHeadModel(config)), (ids, ids.clone())


def _reference(name: str, batch: int, **sizes: int) -> tuple[nn.Module, tuple]:
    config = reference_config(name, **sizes)
    return build(config), config.example_batch(batch, torch.Generator().manual_seed(0))


MODELS = {
    "gpt": lambda: _reference("gpt", 4, hidden=64, heads=4, seq=64, layers=2, vocab=80),
    "llama-gqa": lambda: _reference(
        "llama", 4, hidden=64, heads=4, kv_heads=2, ffn=96, seq=64, layers=2, vocab=80
    ),
    "llama-tied": lambda: _reference(
        "llama", 2, hidden=32, heads=2, seq=16, vocab=40, tie_embeddings=True
    ),
    "mlp": lambda: _reference("mlp", 16, hidden=32, ffn=64, vocab=8, layers=2),
    "conv": lambda: (Convs(), (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))),
    "transformers-gpt2": _gpt2,
}


def _torch_flops(model: nn.Module, example: tuple) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*example).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_flops_equal_torchs_counter(name: str) -> None:
    torch.manual_seed(0)
    model, example = MODELS[name]()
    expected = _torch_flops(model, example)
    og = capture(model, example)
    ours = sum(info.flops for info in og.ops())
    assert expected > 0
    assert ours == expected, (ours, expected)  # exact: the same matrix products, counted alike


def test_an_input_without_gradient_costs_no_input_gradient() -> None:
    """The MLP's first linear reads data: backward computes its weight gradient only."""
    model, example = MODELS["mlp"]()
    og = capture(model, example)
    first = next(i for i in og.ops() if i.key == "layers.0.fc1/linear.0")
    batch, features = example[0].shape
    product = 2 * batch * features * first.out_shapes[0][-1]
    assert first.forward_backward_flops == (product, product)  # dW only
    second = next(i for i in og.ops() if i.key == "layers.0.fc2/linear.0")
    fwd, bwd = second.forward_backward_flops
    assert bwd == 2 * fwd  # dX and dW


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "conv"])
def test_local_flops_add_up_to_the_global_count(name: str) -> None:
    """Every strategy on a 2 x 2 mesh: the distinct shards' forward and backward counts sum to
    the op's global count (replicas of a shard compute the same part)."""
    model, example = MODELS[name]()
    og = capture(model, example)
    mesh = MeshInfo(("dp", "tp"), (2, 2), ("dp",))
    checked = 0
    for info in og.ops():
        rule = rule_for(info.node)
        if not isinstance(rule, SpaceRule) or not rule.contractions(info.node):
            continue
        needs = [node_info(a).requires_grad for a in tensor_inputs(info.node)]
        for option in options(info.node, mesh):
            space = option.strategy.space
            shards = {}
            for rank in range(mesh.num_devices):
                coords = tuple(space.local_index(rank))
                shards[repr(coords)] = space.local_shape(rank)
            fwd = sum(rule.flops(info.node, shape, needs)[0] for shape in shards.values())
            bwd = sum(rule.flops(info.node, shape, needs)[1] for shape in shards.values())
            assert (fwd, bwd) == pytest.approx(info.forward_backward_flops), (info.key, space)
            cost = rule.cost(info.node, option.strategy, needs)
            assert cost.flops * len(shards) == pytest.approx(fwd)
            checked += 1
    assert checked >= 5


def test_causal_attention_is_timed_at_the_work_its_kernel_does() -> None:
    """MFU counts a causal attention in full; the time model prices about half of it."""
    model, example = _reference("gpt", 1, hidden=32, heads=2, seq=512, layers=1, vocab=16)
    og = capture(model, example)
    node = next(i.node for i in og.ops() if i.op.startswith("scaled_dot_product_attention"))
    mesh = MeshInfo(("dp",), (1,), ("dp",))
    strategy = options(node, mesh)[0].strategy
    needs = [node_info(a).requires_grad for a in tensor_inputs(node)]
    cost = rule_for(node).cost(node, strategy, needs)
    assert cost.kind == "attention"
    assert cost.flops == node_info(node).forward_backward_flops[0]
    assert cost.work == pytest.approx(0.5 + 128 / (2 * 512))  # the tiles on and below the diagonal
    assert math.isclose(cost.backward_flops, 2 * cost.flops)
