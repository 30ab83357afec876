"""Lowering (lower/): the rank's torch.fx program from a graph and its plan. Lowering runs no
collective, so every rank's program is built (and, on one device, run) in this process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from autoshard.graph import capture
from autoshard.lower import RunState, attr_name, lower
from autoshard.lower.lower import Redistribute, ReduceGrad
from autoshard.mesh import mesh_info
from autoshard.models import build, reference_config
from autoshard.redistribution import shard_tensor
from autoshard.search import plan_graph

warnings.filterwarnings("ignore", category=FutureWarning)

#: Megatron's MLP: fc1 and the head split their output features, fc2 its input features
MEGATRON_MLP = {
    "layers.*.fc1": ((None, None), ("tp", None)),
    "layers.*.fc2": ((None, "tp"), (None, "tp")),
    "head": ((None, None), ("tp", None)),
}


@pytest.fixture(scope="module")
def mlp():
    """The reference MLP in float64, an example batch and its train graph."""
    torch.manual_seed(0)
    config = reference_config("mlp")
    model = build(config).double()
    x, y = config.example_batch(4, torch.Generator().manual_seed(1))
    batch = (x.double(), y)
    return config, model, batch, capture(model, batch)


def _local_tensors(model: nn.Module, plan, rank: int) -> dict[str, torch.Tensor]:
    """Each planned parameter's shard on ``rank``, registered by name (as ParallelModule does)."""
    values = dict(model.named_parameters(remove_duplicate=False))
    values |= dict(model.named_buffers(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    for fqn, p in plan.params.items():
        local = shard_tensor(values[fqn].detach(), p.layout, rank)
        out[fqn] = nn.Parameter(local) if isinstance(values[fqn], nn.Parameter) else local
    return out


def _count(gm: torch.fx.GraphModule, kind: type) -> int:
    return sum(isinstance(m, kind) for m in gm.children())


@pytest.mark.parametrize("rank", [0, 1])
def test_megatron_program_holds_shards_and_one_module_per_move(mlp, rank: int) -> None:
    """Each rank's program holds its parameter shards (half of every split dim) and calls one
    Redistribute per planned move and one ReduceGrad per planned gradient sum."""
    config, model, _, og = mlp
    plan = plan_graph(og, mesh_info({"tp": 2}), MEGATRON_MLP)
    tensors = _local_tensors(model, plan, rank)
    gm = lower(og, plan, rank, torch.device("cpu"), tensors, RunState())

    h, f, o = config.in_features, config.hidden, config.out_features
    half = {
        "fc1.weight": (f // 2, h),
        "fc1.bias": (f // 2,),
        "fc2.weight": (h, f // 2),
        "fc2.bias": (h,),
    }
    expected = {f"layers.{i}.{k}": v for i in range(config.num_layers) for k, v in half.items()}
    expected |= {"head.weight": (o // 2, h), "head.bias": (o // 2,)}
    params = dict(gm.named_parameters())
    assert {k: tuple(v.shape) for k, v in params.items()} == {
        attr_name(k): v for k, v in expected.items()
    }
    full = dict(model.named_parameters())
    rows = slice(rank * f // 2, (rank + 1) * f // 2)
    torch.testing.assert_close(
        params[attr_name("layers.0.fc1.weight")], full["layers.0.fc1.weight"][rows]
    )
    torch.testing.assert_close(
        params[attr_name("layers.1.fc2.weight")], full["layers.1.fc2.weight"][:, rows]
    )

    moves = sum(len(n.moves) for n in plan.nodes.values())
    moves += sum(src != dst for src, dst in plan.outputs)
    sums = sum(len(n.grad_reduce) for n in plan.nodes.values())
    assert moves > 0 and sums > 0  # Megatron's f and g both appear
    assert _count(gm, Redistribute) == moves
    assert _count(gm, ReduceGrad) == sums
    # one all-reduce of each row-split fc2's partial output; one gradient sum at the input of
    # each column-split linear whose input needs a gradient: fc1 of every block but the first
    # (it reads the user's input) and the head
    assert (moves, sums) == (config.num_layers, config.num_layers)


def test_one_device_program_has_no_communication_and_gives_the_model_loss(mlp) -> None:
    """With no strategies on a 1-device mesh the program holds the whole parameters, calls no
    communication, and computes exactly the model's loss and gradients."""
    _, model, batch, og = mlp
    plan = plan_graph(og, mesh_info({"dp": 1}))
    tensors = _local_tensors(model, plan, 0)
    gm = lower(og, plan, 0, torch.device("cpu"), tensors, RunState())
    assert _count(gm, Redistribute) == 0 and _count(gm, ReduceGrad) == 0
    full = dict(model.named_parameters())
    assert {k: v.shape for k, v in gm.named_parameters()} == {
        attr_name(k): v.shape for k, v in full.items()
    }

    (loss,) = gm(*batch)
    model.zero_grad()
    expected = model(*batch)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for fqn, p in full.items():
        torch.testing.assert_close(tensors[fqn].grad, p.grad, msg=lambda m, f=fqn: f"{f}: {m}")
