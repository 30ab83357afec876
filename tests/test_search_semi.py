"""Semi-automatic planning (search/semi.py): strategy validation, defaults and the plan table."""

from __future__ import annotations

import warnings

import pytest

from autoshard import StrategyError
from autoshard.graph.capture import capture
from autoshard.mesh import mesh_info
from autoshard.models import GPT, GPTConfig
from autoshard.search.semi import plan_graph

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (
            ((1, 1), (2, 1), (2,), (1,)),
            r"linear \(aten.linear.default in layers.0.fc1\): strategy "
            r"has 4 tuples but the op has 3 tensor inputs",
        ),
        (((1, 1, 1), (2, 1)), r"input 0 has 2 dims \(8, 16\) but its strategy \(1, 1, 1\)"),
        (((1, 1), (4, 1)), r"input 1 dim 0 \(size 30\): not divisible by its split 4"),
        (((2, 1), (2, 1)), r"uses 4 devices, which does not divide the 2 devices of the mesh"),
        (
            ((1, 2), (1, 1)),
            r"input 1 dim 1 \(size 16\): split 1 disagrees with input 0 dim 1 "
            r"split 2; both walk dim 'in'",
        ),
        (((None, None), ("tp", None)), r"axis names \['tp'\] are not in mesh axes"),
        ("oops", r"is not a tuple of tuples"),
    ],
)
def test_invalid_strategies_name_the_op_input_dim_and_sizes(mlp_graph, strategy, message) -> None:
    with pytest.raises(StrategyError, match=message):
        plan_graph(mlp_graph, mesh_info({"dp": 2}), {"layers.0.fc1": strategy})


def test_a_key_that_matches_nothing_is_an_error(mlp_graph) -> None:
    with pytest.raises(StrategyError, match="'layers.7.fc1' matches no node and no module"):
        plan_graph(mlp_graph, mesh_info(2), {"layers.7.fc1": ((1, 1), (2, 1))})


def test_a_dim_the_op_needs_whole_cannot_be_split() -> None:
    config = GPTConfig()
    graph = capture(GPT(config), config.example_batch(2))
    with pytest.raises(StrategyError, match=r"layer_norm .*dim 'd2' \(size 32\) cannot be split"):
        plan_graph(graph, mesh_info(2), {"layers.0.ln_1": ((1, 1, 2), (2,), (2,))})


def test_plan_table_shows_strategies_communication_and_bytes(mlp_graph) -> None:
    strategies = {"layers.*.fc1": ((1, 1), (2, 1)), "layers.*.fc2": ((1, 2), (1, 2))}
    plan = plan_graph(mlp_graph, mesh_info({"tp": 2}), strategies)
    text = str(plan)
    assert "linear*" in text and "layers.0.fc1" in text
    assert "all_reduce" in text
    assert text.endswith("(* configured by the user)")  # a searched plan says "by the search"
    # Megatron's pair with named dims: fc1 splits its output features (column), fc2 its input
    # features (row) and gives a pending sum (a tuple strategy's mesh axis is a0)
    assert "x[b, in] weight[out@a0, in] bias[out@a0] -> [b, out@a0]" in text
    assert "x[b, in@a0] weight[out, in@a0] bias[out] -> [b, out]{sum:a0}" in text
    assert "x[b, h] y[b, h] -> [b, h]" in text  # the residual add, named from the input
    # The row-split fc2 output is a partial sum that the residual add resolves (forward bytes of
    # an all-reduce of the [8, 16] float32 activation on 2 ranks: its size).
    add = plan.nodes["add"]
    assert add.forward_bytes() == 8 * 16 * 4
    assert plan.fingerprint == plan_graph(mlp_graph, mesh_info({"tp": 2}), strategies).fingerprint


def test_unconfigured_ops_follow_and_inputs_default_to_data_parallel(mlp_graph) -> None:
    plan = plan_graph(mlp_graph, mesh_info({"dp": 2}))
    assert str(plan.inputs["x"]) == "f32[8@dp,16]"
    assert all(not n.moves for n in plan.nodes.values())
    assert {str(p.grad_partial) for p in plan.params.values()} >= {"f32[30,16]{partial:dp}"}


def test_a_split_the_mesh_asks_for_that_the_shapes_cannot_take_is_an_error() -> None:
    """Every rank fed the whole batch (or sequence) where ``dp`` (``cp``) was asked for
    would train without that parallelism: the input, dim, size and axis are named."""
    config = GPTConfig(block_size=7)
    odd_batch = capture(GPT(config), config.example_batch(7))
    with pytest.raises(StrategyError, match=r"input idx dim 0 \(batch, size 7\): not divisible "
                       r"by its split 2 over axis dp of mesh dp\(2\)"):  # fmt: skip
        plan_graph(odd_batch, mesh_info({"dp": 2}))
    odd_sequence = capture(GPT(config), config.example_batch(2))
    with pytest.raises(StrategyError, match=r"input idx dim 1 \(sequence, size 7\): not "
                       r"divisible by its split 2 over axis cp"):  # fmt: skip
        plan_graph(odd_sequence, mesh_info({"cp": 2}), attention="ring")
    plan = plan_graph(odd_sequence, mesh_info({"dp": 2}))  # the batch divides: no sequence asked
    assert str(plan.inputs["idx"]) == "i64[2@dp,7]"


def test_a_search_on_a_given_mesh_does_not_feed_a_batch_it_cannot_split_whole() -> None:
    """``autoshard.plan`` on ``{"dp": 2}`` with a batch of 7 fed every rank all of it (the
    plan's inputs whole), and on ``{"cp": 2}`` with a sequence of 7 failed inside numpy."""
    import autoshard

    config = GPTConfig(block_size=7)
    for mesh, batch, what in (
        ({"dp": 2}, 7, "dim 0 \\(batch"),
        ({"cp": 2}, 2, "dim 1 \\(sequence"),
    ):
        with pytest.raises(StrategyError, match=f"input idx {what}, size 7\\): not divisible by "
                           f"its split 2 over axis {next(iter(mesh))}"):  # fmt: skip
            autoshard.plan(GPT(config), config.example_batch(batch), "cpu", num_devices=2,
                           mesh=mesh, attention="ring" if "cp" in mesh else None)  # fmt: skip
