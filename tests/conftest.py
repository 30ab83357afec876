"""Shared fixtures: the small MLP captured once per test module."""

from __future__ import annotations

import pytest
import torch

from autoshard.graph.capture import capture
from autoshard.models import MLP, MLPConfig
from autoshard.testing import preload


@pytest.fixture(scope="module")
def mlp_graph():
    """The train graph of an MLP with 30 hidden features (indivisible by 4) on a batch of 8."""
    torch.manual_seed(0)
    config = MLPConfig(hidden=30)
    model = MLP(config)
    return capture(model, config.example_batch(8))


# transformers' model code is seconds of imports; the ranks' fork server imports it once
preload(
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.gpt2.modeling_gpt2",
)
