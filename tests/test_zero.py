"""ZeRO stages 1, 2 and 3 (docs/zero.md) against one device (DESIGN.md invariant 1): float64,
5 AdamW steps with dropout, losses at every step and every parameter at the end equal; with
gradient accumulation under no_sync and with clipping; at every stage also against plain
PyTorch (the eager model, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``, dropout
off); and what each rank holds and sends per step against the stage formulas."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from test_runtime import ONE_DEVICE, PYTORCH, STEPS, WithUnused, batches, build, megatron, mixed

from autoshard import clip_grad_norm_, comm, parallelize, shard_inputs, single_device
from autoshard.cost import cluster_spec, estimate
from autoshard.graph.capture import capture_modes
from autoshard.search import ZeroError, check_zero
from autoshard.testing import run_ranks


def _megatron_dp(name: str) -> dict[str, Any]:
    """Megatron's tensor parallel strategies with the batch split over dp."""
    out = {}
    for key, (ins, outs) in megatron(name).items():
        if len(ins) == 3:
            ins = ("dp", *ins[1:])
        out[key] = (ins, outs)
    return out


def _strategies(name: str, how: str | None) -> dict[str, Any] | None:
    if how is None:
        return None
    given = _megatron_dp(name) if how == "megatron" else mixed(name, 2, 2)
    return {f"inner.{k}": v for k, v in given.items()}


#: a rank's captures of the models it trains, by (model, dropout, dtype)
_CAPTURES: dict[tuple, Any] = {}


def _captured(model: torch.nn.Module, example: tuple, key: tuple) -> Any:
    """Every build of a model is the same program: a rank exports it once."""
    if key not in _CAPTURES:
        _CAPTURES[key] = capture_modes(model, example)
    return _CAPTURES[key]


def _zero_training(
    name: str,
    mesh: Any,
    how: str | None,
    level: int,
    micro: int = 1,
    clip: float | None = None,
    reference: str = ONE_DEVICE,
) -> dict[str, Any]:
    """``name`` (with an unused parameter) at ZeRO ``level`` on ``mesh`` against one device
    (dropout on) or plain PyTorch (``reference=PYTORCH``, dropout off): 5 AdamW steps of
    ``micro`` micro-batches (all but the last under no_sync), clipped to ``clip`` when given."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dropout = 0.1 if reference == ONE_DEVICE else 0.0
    inner, config = build(name, dropout)
    model = WithUnused(inner).to(torch.float64)
    data = batches(config, torch.float64)
    captured = _captured(model, data[0], (name, dropout, torch.float64))
    if reference == PYTORCH:
        ref = copy.deepcopy(model)
    else:
        ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(model, data[0], mesh, _strategies(name, how), captured=captured, zero=level)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        for i in range(micro):
            batch = data[(step + i) % len(data)]
            loss_ref = ref(*batch) / micro
            loss_ref.backward()
            loss = pm(*shard_inputs(batch, pm)) / micro
            torch.testing.assert_close(loss, loss_ref, msg=lambda m, s=step: f"step {s}: {m}")
            if i < micro - 1:
                with pm.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norms.append((float(clip_grad_norm_(pm, clip)), float(expected)))
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    full = pm.full_state_dict()
    full_ref = ref.state_dict() if reference == PYTORCH else ref.full_state_dict()
    assert full.keys() == full_ref.keys()
    for k in full_ref:
        torch.testing.assert_close(full[k], full_ref[k], msg=lambda m, k=k: f"{k}: {m}")
    assert torch.equal(full["unused.weight"], model.unused.weight)  # no gradient, no step
    sharded = sum(1 for fqn in pm.local_tensors() if fqn in pm._zero)
    return {"norms": norms, "sharded": sharded}


def _cases(fn: Any, cases: list[tuple]) -> list[Any]:
    """``fn`` on each case in turn; a case that fails is named in the failure."""
    out = []
    for case in cases:
        try:
            out.append(fn(*case))
        except Exception as err:
            err.add_note(f"in {fn.__name__}{case}")
            raise
    return out


def _trained_cases(level: int) -> list[tuple]:
    return [
        ("gpt", {"dp": 2}, None, level),
        ("llama", {"dp": 2}, None, level, 2),
        ("gpt", {"dp": 2}, None, level, 2, 0.05, PYTORCH),
    ]


@pytest.mark.parametrize("level", [1, 2, 3])
def test_zero_trains_as_one_device_on_2_ranks(level: int, on_2_ranks: list[dict]) -> None:
    """... and as plain PyTorch: GPT (tied embeddings) with accumulation and clipping."""
    for per_rank in (r["trains"][level - 1] for r in on_2_ranks):
        assert all(r["sharded"] > 0 for r in per_rank)
        for got, expected in per_rank[2]["norms"]:
            assert got == pytest.approx(expected, rel=1e-9)
            assert expected > 0.05  # the clipping was active


def test_zero_argument_is_checked() -> None:
    assert check_zero({"layers.*": 3}) == {"layers.*": 3}
    with pytest.raises(ZeroError, match="zero=4: expected a ZeRO stage"):
        check_zero(4)
    with pytest.raises(ZeroError, match=r"zero\['x'\]=True"):
        check_zero({"x": True})


#: every stage over dp while the weights are split over tp (MindSpore's mixed tuples and
#: Megatron's strategies), and alone over dp 4; with gradient accumulation and clipping
CASES_ON_4 = [
    ("gpt", {"dp": 4}, None, 3, 1, 0.05),
    ("llama", {"dp": 4}, None, 2, 2),
    ("gpt", {"dp": 2, "tp": 2}, "mixed", 1, 2, 0.05),
    ("gpt", {"dp": 2, "tp": 2}, "mixed", 3, 3),
    ("llama", {"dp": 2, "tp": 2}, "megatron", 2, 1, 0.05),
    ("llama", {"dp": 2, "tp": 2}, "megatron", 3, 2, 0.05),
]


def test_zero_with_tensor_parallelism_accumulation_and_clipping_on_4_ranks(
    on_4_ranks: list[dict],
) -> None:
    for per_rank in (r["trains"] for r in on_4_ranks):
        for case, result in zip(CASES_ON_4, per_rank, strict=True):
            assert result["sharded"] > 0, case
            for got, expected in result["norms"]:
                assert got == pytest.approx(expected, rel=1e-9), case
                assert expected > 0.05, case  # the clipping was active


# -- what a rank holds and sends ---------------------------------------------------------------


def _held_and_sent(
    mesh: Any, how: str | None, level: int, precision: str | None = None
) -> dict[str, Any]:
    """GPT in float32 at ZeRO ``level`` (under ``precision``): the bytes a rank holds after a
    step (before zero_grad) and sends in a step, with the sizes the formulas need."""
    warnings.filterwarnings("ignore")
    inner, config = build("gpt", 0.0)
    model = WithUnused(inner)
    data = batches(config, torch.float32)
    # bf16 captures the model in its compute dtype: that program is parallelize's own
    captured = None if precision else _captured(model, data[0], ("gpt", 0.0, torch.float32))
    strategies = _strategies("gpt", how)
    pm = parallelize(
        model, data[0], mesh, strategies, captured=captured, zero=level, precision=precision
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(2):
        with comm.counting() as sent:
            loss = pm(*shard_inputs(data[step], pm))
            # stage 3 holds nothing gathered between forward and backward, and starts no
            # gather forward will not use
            gathering = [u.name for u in pm._zero.units if u.gathering is not None]
            loss.backward()
            opt.step()
        held = pm.state_bytes(opt)
        other_grads = sum(
            t.grad.numel() for f, t in pm.local_tensors().items() if f not in pm._zero and
            t.grad is not None
        )  # fmt: skip
        stepped = sum(1 for p in pm.parameters() if p.grad is not None)
        opt.zero_grad()
    zero = pm._zero
    members = [m for u in zero.units for m in u.members]
    # the two largest units' elements: what forward gathers (in the compute dtype) and
    # backward sums (in the reduce dtype) at most besides the shards
    units = [sum(m.rows * m.row for m in u.members) for u in zero.units if u.used]
    compute = pm.precision.compute or torch.float32
    reduce = pm.precision.reduce or torch.float32
    return {
        "predicted": estimate(pm.plan, pm.plan.graph, cluster_spec("cpu")).memory,
        "two_units": sum(sorted(units)[-2:]) * compute.itemsize,
        "two_sums": sum(sorted(units)[-2:]) * reduce.itemsize,
        "held": held,
        "sent": sent,
        "local": sum(m.rows * m.row for m in members),  # the plan's local elements
        "padded": sum(m.chunk * m.row * len(u.group) for u in zero.units for m in u.members),
        # what a step sends per unit: (n - 1) / n of its padded elements, in float32
        "share": sum(
            4 * m.chunk * m.row * (len(u.group) - 1)
            for u in zero.units
            if u.used
            for m in u.members
        ),
        "even_shards": sum(m.rows * m.row / len(u.group) for u in zero.units for m in u.members),
        "shards": sum(m.shard.numel() for m in members),
        "largest_group": max((len(u.group) for u in zero.units), default=1),
        # bytes of what ZeRO leaves alone (buffers, parameters with no gradient sum to shard)
        "others": sum(
            t.untyped_storage().nbytes() for f, t in pm.local_tensors().items() if f not in zero
        ),
        "other_grads": other_grads,
        "count": len(list(pm.parameters())),
        "stepped": stepped,
        "gathering": gathering,
        "gathered": [u.name for u in zero.units if u.level == 3 and u.full is not None],
    }


#: the mesh and strategies whose bytes are measured, by the ranks they run on
HELD_ON = {2: ({"dp": 2}, None), 4: ({"dp": 2, "tp": 2}, "mixed")}


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_held_and_sent_follow_the_stage_formulas(world: int, request) -> None:
    results = request.getfixturevalue(f"on_{world}_ranks")[0]["held"]
    zero0 = results[0]
    for level, r in enumerate(results):
        _assert_predicted_memory(r, level)
    for level, r in enumerate(results[1:], start=1):
        psi, padded, shards = r["local"], r["padded"], r["shards"]
        n = r["largest_group"]
        assert psi <= padded < psi + n * 64 * r["count"]  # padding: under a row per rank
        assert shards == pytest.approx(r["even_shards"], abs=64 * r["count"])
        others = r["others"]
        params = {1: 4 * (psi + shards), 2: 4 * (psi + shards), 3: 4 * shards}[level]
        grads = {1: 4 * (padded + shards), 2: 4 * shards, 3: 4 * shards}[level]
        held = r["held"]
        if level == 3:
            assert r["gathering"] == [] and r["gathered"] == []
        assert held["parameters"] - others == params, level
        assert held["gradients"] - 4 * r["other_grads"] == grads, level
        # two moments of each shard and other parameter that has a gradient, and AdamW's step,
        # a float32 scalar per parameter stepped
        moments = 2 * 4 * (shards + r["other_grads"])
        assert held["optimizer"] == moments + 4 * r["stepped"]
        # stage 0 holds every local parameter, its gradient and two moments
        assert zero0["held"]["parameters"] == 4 * psi + others
        # a step: reduce-scatter and all-gather of the padded parameters (a third pass, the
        # backward's all-gather, at stage 3), (n - 1) / n of them each
        # (the program's own collectives, tensor parallelism's, are stage 0's)
        sent = {
            k: v["bytes"] - zero0["sent"].get(k, {}).get("bytes", 0) for k, v in r["sent"].items()
        }
        share = r["share"]
        assert sent["reduce_scatter"] == share
        assert sent["all_gather"] == (2 if level == 3 else 1) * share
        # the same bytes as stage 0's all-reduce of the same gradients, up to the padding
        # (stage 3 adds a gather)
        assert 0 <= share * 2 + sent.get("all_reduce", 0) < 4 * 64 * r["count"]


def _assert_predicted_memory(r: dict[str, Any], level: int) -> None:
    """The cost model's breakdown is what the rank holds, up to the padding of the shards,
    plus at stages 2 and 3 two units' gradient buffers and at stage 3 two units' gathered
    parameters (what backward and forward hold at most besides the shards)."""
    # padding, and a buffer that is a view of a larger storage
    predicted, held, pad = r["predicted"], r["held"], 4 * (r["padded"] - r["local"]) + 256
    params = held["parameters"] + (r["two_units"] if level == 3 else 0)
    assert predicted["parameters"] == pytest.approx(params, abs=pad), level
    grads = held["gradients"] + (r["two_sums"] if level >= 2 else 0)
    assert predicted["gradients"] == pytest.approx(grads, abs=pad), level
    moments = held["optimizer"] - 4 * r["stepped"]  # AdamW's step counters are not priced
    assert predicted["optimizer"] == pytest.approx(moments, abs=pad), level


def test_the_memory_planned_under_bf16_is_what_a_rank_holds(on_2_ranks: list[dict]) -> None:
    """Under ``precision="bf16"`` a rank keeps float32 master weights, gradients and Adam
    moments (bfloat16 only where the program reads them, and in ZeRO's gathered copies): the
    plan's breakdown at every stage is those bytes, not bfloat16's half of them."""
    results = on_2_ranks[0]["bf16"]
    for level, r in enumerate(results):
        _assert_predicted_memory(r, level)
    for r in results[1:]:  # float32 state: four bytes an element of the parameters at stage 0
        assert results[0]["held"]["parameters"] == 4 * r["local"] + r["others"]


def _searched_plan_with_zero() -> dict[str, Any]:
    """A plan searched at ZeRO 2, written to JSON and read back by parallelize, against one
    device and against plain PyTorch (the eager model and its AdamW; dropout off): each
    step's loss and every parameter after the last."""
    import autoshard

    warnings.filterwarnings("ignore")
    model, config = build("gpt", 0.0)
    model = model.to(torch.float64)
    data = batches(config, torch.float64)
    captured = capture_modes(model, data[0])
    eager = copy.deepcopy(model)
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    searched = autoshard.plan(model, data[0], "cpu", num_devices=2, zero=2, captured=captured)
    pm = parallelize(model, data[0], 2, plan=searched.json, captured=captured)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, eager, pm)]
    losses = []
    for batch in data:
        ref(*batch).backward()
        loss_eager = eager(*batch)
        loss_eager.backward()
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        losses.append((float(loss), float(loss_eager)))
        for opt in opts:
            opt.step(), opt.zero_grad()
    full, full_ref = pm.full_state_dict(), ref.full_state_dict()
    for k in full_ref:
        torch.testing.assert_close(full[k], full_ref[k], msg=lambda m, k=k: f"{k}: {m}")
    assert full.keys() == eager.state_dict().keys()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(full[k], v, msg=lambda m, k=k: f"eager {k}: {m}")
    return {
        "zero": searched.json["zero"],
        "stages": {u.level for u in pm._zero.units},
        "losses": losses,
    }


def test_a_searched_plan_carries_its_zero_stage(on_2_ranks: list[dict]) -> None:
    for result in (r["searched"] for r in on_2_ranks):
        assert (result["zero"], result["stages"]) == (2, {2})
        for got, expected in result["losses"]:  # plain PyTorch's losses
            assert got == pytest.approx(expected, rel=1e-9)


# -- one spawn for each count of ranks ------------------------------------------------------------


def _checks_on(world: int) -> dict[str, tuple]:
    """This module's checks on ``world`` ranks, each a function and its arguments: one spawn
    runs them all in turn, since spawning and a new process's first capture dominate their
    time."""
    held = [(*HELD_ON[world], level) for level in (0, 1, 2, 3)]
    if world == 4:
        return {
            "trains": (_cases, _zero_training, CASES_ON_4),
            "held": (_cases, _held_and_sent, held),
        }
    levels = (1, 2, 3)
    return {
        "trains": (_by_level, [_trained_cases(level) for level in levels]),
        "held": (_cases, _held_and_sent, held),
        "bf16": (_cases, _held_and_sent, [({"dp": 2}, None, k, "bf16") for k in (0, *levels)]),
        "searched": (_searched_plan_with_zero,),
    }


def _by_level(cases: list[list[tuple]]) -> list[list[dict]]:
    return [_cases(_zero_training, level_cases) for level_cases in cases]


def _run_checks(world: int) -> dict[str, Any]:
    return {name: fn(*args) for name, (fn, *args) in _checks_on(world).items()}


@pytest.fixture(scope="module")
def on_2_ranks() -> list[dict]:
    """Every rank's outcome of each check on 2 ranks, by name."""
    return run_ranks(_run_checks, 2, 2, timeout=1200)


@pytest.fixture(scope="module")
def on_4_ranks() -> list[dict]:
    """Every rank's outcome of each check on 4 ranks, by name."""
    return run_ranks(_run_checks, 4, 4, timeout=1200)
