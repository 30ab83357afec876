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
