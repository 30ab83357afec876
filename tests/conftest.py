"""Shared fixtures: the small MLP and a two-block bfloat16 GPT on the meta device, captured
once per test module."""

from __future__ import annotations

import os

import pytest
import torch

from autoshard.graph.capture import capture
from autoshard.models import MLP, MLPConfig, build, reference_config
from autoshard.testing import preload


@pytest.fixture(scope="module")
def mlp_graph():
    """The train graph of an MLP with 30 hidden features (indivisible by 4) on a batch of 8."""
    torch.manual_seed(0)
    config = MLPConfig(hidden=30)
    model = MLP(config)
    return capture(model, config.example_batch(8))


@pytest.fixture(scope="module")
def gpt_meta_graph():
    """The train graph of a two-block GPT (hidden 1024, 16 heads, sequence 1024) in bfloat16
    on the meta device, on a batch of 4 (the pipeline search's small stage)."""
    config = reference_config("gpt", layers=2, hidden=1024, heads=16, vocab=32000, seq=1024)
    with torch.device("meta"):
        model = build(config).to(torch.bfloat16)
        example = config.example_batch(4)
    return capture(model, example, {}, train=True)


# transformers' model code is seconds of imports; the ranks' fork server imports it once
preload(
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.gpt2.modeling_gpt2",
)

# Two pytest-xdist workers share the cores: with a pool of intra-op threads each, the pools spin
# against each other (and against the ranks, which run on one thread each).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
