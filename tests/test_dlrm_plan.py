"""``autoshard.plan`` on the DLRM reference (src/autoshard/models/dlrm.py): its ``cat`` of the
tables' pooled rows and the dense MLP's activations, its tables split by rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import autoshard
from autoshard.layout import NOT_SPLIT
from autoshard.lower import RunState, attr_name, lower
from autoshard.models import DLRM, DLRMConfig
from autoshard.ops import local
from autoshard.redistribution import shard_tensor
from autoshard.testing import run_ranks

# rows that 4 ranks divide, a batch that 4 ranks divide
CONFIG = DLRMConfig(
    num_tables=3, num_rows=48, embedding_dim=4, bag_size=3, dense_features=5, hidden=8
)


def _model_and_batch() -> tuple[DLRM, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return DLRM(CONFIG), CONFIG.example_batch(32, torch.Generator().manual_seed(0))


def _bags(plan: autoshard.Plan) -> list:
    return [n for n in plan.nodes.values() if "embedding_bag" in n.target]


def _rows_split(layout) -> bool:
    return any(a != NOT_SPLIT for _, a in layout.factors[0])


def test_the_dlrm_is_searched_on_4_devices() -> None:
    model, batch = _model_and_batch()
    for where in ({"num_devices": 4}, {"mesh": {"dp": 4}}):
        plan = autoshard.plan(model, batch, "cpu", **where)
        assert plan.searched and plan.mesh.num_devices == 4
        assert len(_bags(plan)) == CONFIG.num_tables
        assert plan.predicted.step_time > 0
        assert not any("has no rule" in w for w in plan.warnings), plan.warnings


def _rows_split_plan(model: DLRM, batch: tuple) -> autoshard.Plan:
    return autoshard.plan(
        model,
        batch,
        "cpu",
        mesh={"dp": 4},
        search="propagate",
        strategies={"tables.*": {"space": (None, None, "dp")}},
    )


def test_the_dlrm_plans_with_its_tables_split_by_rows() -> None:
    """The tables given split by rows over the 4 ranks (their pooled rows partial sums), the
    rest searched: the cat sums the pooled rows into the split it takes, a move the plan
    prices."""
    model, batch = _model_and_batch()
    plan = _rows_split_plan(model, batch)
    bags = _bags(plan)
    assert len(bags) == CONFIG.num_tables
    for bag in bags:
        weight, pooled = bag.strategy.ins[0], bag.strategy.outs[0]
        assert _rows_split(weight) and weight.local_shape() == (CONFIG.num_rows // 4, 4)
        assert pooled.partial and pooled.shape == (32, 4)
    (cat,) = [n for n in plan.nodes.values() if n.target.startswith("aten.cat")]
    assert not any(layout.partial for layout in cat.strategy.ins)
    assert sorted(cat.moves) == [1, 2, 3]  # the three tables' pooled rows, summed
    assert plan.predicted.comm > 0


def test_each_rank_s_program_pools_the_rows_it_holds() -> None:
    """Lowering runs no collective, so every rank's program is built here: it holds its
    quarter of every table's rows and pools from them, told where they start."""
    model, batch = _model_and_batch()
    plan = _rows_split_plan(model, batch)
    whole = dict(model.named_parameters())
    part = CONFIG.num_rows // 4
    for rank in range(4):
        tensors = {
            fqn: nn.Parameter(shard_tensor(whole[fqn].detach(), p.layout, rank))
            for fqn, p in plan.params.items()
        }
        program = lower(plan.graph, plan, rank, torch.device("cpu"), tensors, RunState())
        held = dict(program.named_parameters())
        for t in range(CONFIG.num_tables):
            rows = whole[f"tables.{t}.weight"][rank * part : (rank + 1) * part]
            assert torch.equal(held[attr_name(f"tables.{t}.weight")], rows)
        calls = [n for n in program.graph.nodes if n.target is local.vocab_embedding_bag]
        assert [n.args[3] for n in calls] == [rank * part] * CONFIG.num_tables


STEPS = 5
TABLE_OPTIMIZERS = {
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
}


def _float64_model_and_batches() -> tuple[DLRM, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model = DLRM(CONFIG).to(torch.float64)
    batches = []
    for step in range(STEPS):
        dense, rows, clicks = CONFIG.example_batch(32, torch.Generator().manual_seed(step))
        batches.append((dense.double(), rows, clicks.double()))
    return model, batches


def _optimizers(params: list[tuple[str, nn.Parameter]], tables: str) -> list:
    """``tables``' optimizer on the tables (every parameter under ``tables.``), AdamW on the
    rest, as the parameter servers' tests train them."""
    on_tables = [p for name, p in params if name.startswith("tables")]
    dense = [p for name, p in params if not name.startswith("tables")]
    return [TABLE_OPTIMIZERS[tables](on_tables), torch.optim.AdamW(dense, lr=1e-2)]


def _train(model: nn.Module, batches: list, optimizers: list, inputs) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(*inputs(batch))
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _rows_split_training() -> dict[str, Any]:
    """On each of 4 ranks: the rows-split plan trained STEPS steps per table optimizer."""
    torch.set_num_threads(1)
    out = {}
    for tables in TABLE_OPTIMIZERS:
        model, batches = _float64_model_and_batches()
        pm = autoshard.parallelize(
            model,
            batches[0],
            {"dp": 4},
            strategies={"tables.*": {"space": (None, None, "dp")}},
            search="propagate",
        )
        held = {name: tuple(p.shape) for name, p in pm.named_parameters()}
        optimizers = _optimizers(list(pm.named_parameters()), tables)
        losses = _train(pm, batches, optimizers, lambda b, pm=pm: autoshard.shard_inputs(b, pm))
        out[tables] = {"losses": losses, "state": pm.full_state_dict(), "held": held}
    return out


def test_the_rows_split_plan_trains_as_one_device() -> None:
    """The DLRM with its tables split by rows over 4 ranks (each holding a quarter of every
    table), float64, 5 steps, Adagrad or SGD on the tables and AdamW on the rest: every loss
    and every parameter equal plain PyTorch on one device."""
    per_rank = run_ranks(_rows_split_training, 4, timeout=600)
    for tables in TABLE_OPTIMIZERS:
        model, batches = _float64_model_and_batches()
        optimizers = _optimizers(list(model.named_parameters()), tables)
        losses = _train(model, batches, optimizers, lambda b: b)
        for rank in per_rank:
            outcome = rank[tables]
            part = (CONFIG.num_rows // 4, CONFIG.embedding_dim)
            assert [s for n, s in outcome["held"].items() if "tables" in n] == [part] * 3
            torch.testing.assert_close(outcome["losses"], losses)
            assert outcome["state"].keys() == model.state_dict().keys()
            for name, value in model.state_dict().items():
                torch.testing.assert_close(outcome["state"][name], value, msg=name)
