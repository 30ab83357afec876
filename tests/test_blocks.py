"""A user's model planned from two of its like blocks: the plan and its prediction are the
ones capturing every block gives, the model is whole again after, and blocks that differ are
captured whole."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from autoshard.graph import BlocksDiffer, blocks_cut, capture, check_depth, like_block_lists

warnings.filterwarnings("ignore", category=FutureWarning)

HF_LLAMA = """
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def loss(out, targets):
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))


def make():
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        idx = torch.zeros(16, 128, dtype=torch.long)
    return model, (idx, idx), loss
"""


class Block(nn.Module):
    def __init__(self, width: int, index: int, act: str = "relu") -> None:
        super().__init__()
        self.index, self.act = index, act
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return x + (torch.relu(y) if self.act == "relu" else torch.tanh(y))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "hf_llama_blocks.py").write_text(HF_LLAMA)
    (tmp_path / "odd_blocks.py").write_text(
        "import torch\n"
        "from test_blocks import Block, Stack\n"
        "class Alternating(Block):\n"
        "    def forward(self, x):\n"  # the index picks the op: the settings cannot tell
        "        y = self.fc(x)\n"
        "        return x + (torch.relu(y) if self.index % 2 else torch.tanh(y))\n"
        "def make():\n"
        "    model = Stack([Alternating(16, i) for i in range(4)])\n"
        "    return model, (torch.randn(8, 16),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    return tmp_path


def test_a_transformers_llama_plans_from_two_of_its_blocks_as_from_all(user_dir, capsys) -> None:
    from autoshard.cli.main import main

    plans = {}
    for name, extra in (("cut", []), ("whole", ["--every-block"])):
        out = user_dir / f"{name}.json"
        argv = ["plan", "--model-fn", "hf_llama_blocks:make", "--cluster", "dgx-h100"]
        assert main([*argv, "--nodes", "1", "--json", str(out), *extra]) == 0
        plans[name] = json.loads(out.read_text())
    cut, whole = plans["cut"], plans["whole"]
    assert (cut["mesh"], cut["zero"]) == (whole["mesh"], whole["zero"])
    assert cut["strategies"] == whole["strategies"]
    assert any(key.startswith("model.layers.*") for key in cut["strategies"])
    assert cut["predicted"]["peak_memory_bytes"] == whole["predicted"]["peak_memory_bytes"]
    # all but autograd's add of the residual stream's two gradients between blocks, which
    # the last block captured (read by the final norm alone) does not show
    assert cut["predicted"]["step_time_s"] == pytest.approx(
        whole["predicted"]["step_time_s"], rel=1e-2
    )


def test_the_cut_model_is_whole_again_and_its_depth_is_the_real_one(user_dir) -> None:
    import hf_llama_blocks

    model, example, loss = hf_llama_blocks.make()
    layers = list(model.model.layers)
    with blocks_cut(model) as depth:
        assert depth == {"model.layers": 6}
        assert len(model.model.layers) == 2
        og = capture(model, example, {}, loss_fn=loss, dtype=torch.bfloat16)
        check_depth(og, depth)  # the two blocks run the same ops
    assert list(model.model.layers) == layers
    assert og.repeated["model.layers"] == (0, 1)


def test_blocks_that_differ_are_not_cut() -> None:
    assert list(like_block_lists(Stack([Block(8, i) for i in range(4)]))) == ["blocks"]
    assert like_block_lists(Stack([Block(8, i) for i in range(2)])) == {}  # nothing to cut
    settings = Stack([Block(8, i, "relu" if i < 3 else "tanh") for i in range(4)])
    assert like_block_lists(settings) == {}
    shapes = Stack([Block(8, 0), Block(8, 1), Block(8, 2), Block(16, 3)])
    assert like_block_lists(shapes) == {}


def test_blocks_whose_ops_differ_are_captured_whole(user_dir, capsys) -> None:
    """Alike by their settings, but the index picks the op: the two captured do not repeat,
    so the plan is made from every block, and says so."""
    import odd_blocks

    from autoshard.cli.main import main

    model, example = odd_blocks.make()
    with blocks_cut(model) as depth, pytest.raises(BlocksDiffer, match="'blocks'"):
        check_depth(capture(model, example, {}), depth)
    out = user_dir / "odd.json"
    assert main(["plan", "--model-fn", "odd_blocks:make", "--cluster", "cpu", "--json",
                 str(out)]) == 0  # fmt: skip
    assert "capturing every block" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert {key.split("/")[0] for key in data["strategies"]} >= {f"blocks.{i}.fc" for i in (0, 3)}
