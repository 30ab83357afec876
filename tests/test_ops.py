"""Op rules (ops/): what a rule refuses and what it costs on a shard."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from autoshard import StrategyError
from autoshard.graph.capture import capture
from autoshard.mesh import mesh_info
from autoshard.search.semi import plan_graph

warnings.filterwarnings("ignore", category=FutureWarning)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).sum()


def test_batch_norm_refuses_a_configured_batch_split() -> None:
    graph = capture(_ConvBN(), (torch.randn(4, 3, 4, 4),))
    strategy = ((2, 1, 1, 1), (1,), (1,), (1,), (1,))
    with pytest.raises(StrategyError, match="batch norm with its batch dim split"):
        plan_graph(graph, mesh_info(2), {"bn": strategy})


def test_rule_cost_counts_local_flops(mlp_graph) -> None:
    from autoshard.ops import rule_for

    plan = plan_graph(mlp_graph, mesh_info({"tp": 2}), {"layers.0.fc1": ((1, 1), (2, 1))})
    node = next(n for n in mlp_graph.graph.nodes if n.name == "linear")
    cost = rule_for(node).cost(node, plan.nodes["linear"].strategy)
    assert cost.flops == 2 * 8 * 30 * 16 / 2  # batch x out x in multiply-adds, half per rank


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_table_split_by_rows_pools_each_bag_as_the_whole_table(mode: str) -> None:
    """Four parts of a table's rows, each pooling only the ids it holds: their sum is the
    whole table's pooling, forward and backward (a mean by each bag's whole size; an empty
    bag stays zero)."""
    import torch.nn.functional as F

    from autoshard.ops import local

    torch.manual_seed(0)
    weight = torch.randn(16, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 16, (11,))
    offsets = torch.tensor([0, 3, 3, 7, 8])  # bag 1 empty
    whole = F.embedding_bag(ids, weight, offsets, mode=mode)
    (whole * torch.arange(15.0).view(5, 3)).sum().backward()
    parts = [weight.detach()[i : i + 4].clone().requires_grad_() for i in range(0, 16, 4)]
    pooled = sum(
        local.vocab_embedding_bag(part, ids, offsets, 4 * i, mode == "mean", False)[0]
        for i, part in enumerate(parts)
    )
    torch.testing.assert_close(pooled, whole)
    (pooled * torch.arange(15.0).view(5, 3)).sum().backward()
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), weight.grad)


def test_the_logistic_loss_of_parts_sums_to_the_whole_mean() -> None:
    import torch.nn.functional as F

    from autoshard.ops import local

    torch.manual_seed(0)
    logits, clicks = torch.randn(12, dtype=torch.float64), torch.rand(12).round().double()
    parts = sum(
        local.logistic_loss_sum(x, y, 12)
        for x, y in zip(logits.chunk(4), clicks.chunk(4), strict=True)
    )
    torch.testing.assert_close(parts, F.binary_cross_entropy_with_logits(logits, clicks))
