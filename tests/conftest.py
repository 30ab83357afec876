"""Shared fixtures: the small MLP captured once per test module."""

from __future__ import annotations

import pytest
import torch

from autoshard.graph.capture import capture
from autoshard.models import MLP, MLPConfig


@pytest.fixture(scope="module")
def mlp_graph():
    """The train graph of an MLP with 30 hidden features (indivisible by 4) on a batch of 8."""
    torch.manual_seed(0)
    config = MLPConfig(hidden=30)
    model = MLP(config)
    return capture(model, config.example_batch(8))
