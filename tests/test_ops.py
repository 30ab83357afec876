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


class _TwoBranches(nn.Module):
    """Two decision nodes (a linear and a table's pooled rows) joined by one cat."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(5, 4)
        self.table = nn.EmbeddingBag(16, 12, mode="sum")

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.dense(x), self.table(ids)], dim=1).sum()


def _two_branches():
    from autoshard.ops import rule_for

    torch.manual_seed(0)
    graph = capture(_TwoBranches(), (torch.randn(8, 5), torch.randint(0, 16, (8, 3))))
    node = next(n for n in graph.graph.nodes if n.target == torch.ops.aten.cat.default)
    return graph, node, rule_for(node)


def test_cat_has_a_space_with_its_dim_whole() -> None:
    from autoshard.layout import Layout
    from autoshard.ops import FIXED, FREE

    _, node, rule = _two_branches()
    space = rule.space(node)
    assert space is not None and space.sizes == (8, 16) and space.kinds == (FREE, FIXED)
    mesh = {"dp": 4}
    strategy = rule.layouts(node, Layout.from_named((8, 16), ("dp", None), mesh))
    want = [Layout.from_named(shape, ("dp", None), mesh) for shape in ((8, 4), (8, 12), (8, 16))]
    assert [layout.factors for layout in (*strategy.ins, *strategy.outs)] == [
        w.factors for w in want
    ]
    assert not any(layout.partial for layout in strategy.grads)
    with pytest.raises(StrategyError, match="cat dim 1"):
        rule.layouts(node, Layout.from_named((8, 16), (None, "dp"), mesh))


def test_a_cat_of_two_decision_nodes_is_one_its_inputs_moves_priced() -> None:
    """The cat chooses its own split; a move from each input's split to it is priced on the
    edge between them, nothing where both are whole."""
    from autoshard.cost import cluster_spec
    from autoshard.search.costgraph import build_cost_graph

    graph, node, _ = _two_branches()
    mesh = mesh_info({"dp": 4})
    cost = build_cost_graph(graph, mesh, cluster_spec("cpu", 4))
    cat = cost.names.index(node.name)
    table = cost.names.index(next(n.name for n in graph.graph.nodes if "embedding_bag" in n.name))
    edge = cost.edges[(min(cat, table), max(cat, table))]
    edge = edge if table < cat else edge.T  # [table's option, cat's option]
    spec = [o.spec for o in cost.options[table]]
    rows_split, whole = spec.index((None, None, "dp")), spec.index((None, None, None))
    batch_split = [o.spec for o in cost.options[cat]].index(("dp", None))
    cat_whole = [o.spec for o in cost.options[cat]].index((None, None))
    assert edge[whole, cat_whole] == 0
    # a slice forward, but the gradient gathered back whole
    assert edge[whole, batch_split] > 0
    # the table's partial sums: summed to either of the cat's splits
    assert edge[rows_split, batch_split] > 0 and edge[rows_split, cat_whole] > 0


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
