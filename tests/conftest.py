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

#: the modules that take longest, longest first (seconds in a two-worker run, from --durations:
#: pipeline ~300, copies ~290, offload ~270, examples ~250, context ~180, meta ~165, ...)
SLOWEST_FIRST = (
    "test_pipeline", "test_copies", "test_offload", "test_examples", "test_context",
    "test_meta", "test_runtime", "test_pipeline_precision", "test_capture_traced", "test_expert",
    "test_zero", "test_search", "test_search_families", "test_checkpoint", "test_hf_own_loss",
    "test_train_cli", "test_train_failures", "test_ps", "test_ps_restart", "test_pipeline_cost",
    "test_cost",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's --dist loadfile hands out modules in collection order, by default re-sorted
    # by how many tests each has: modules of few long tests (a 4-rank run, a hang waited out)
    # came last, one worker running them alone while the others had nothing left. In the
    # order below (longest first) the workers end close together.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the files' order
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: tests keep order
