"""Checkpoints (docs/checkpoints.md): saved by every rank as its shards through DCP, loaded
under another plan, mesh, ZeRO stage and world size, into a plain module too; a resumed run
equals an uninterrupted one bit for bit; an interrupted save never loads as complete."""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_copies import _megatron
from test_hf_gpt2 import CausalLMLoss
from test_runtime import batches, build, mixed

import autoshard
from autoshard import parallelize, shard_inputs
from autoshard.graph.capture import capture_modes
from autoshard.runtime.state import checkpoint, dcp_io
from autoshard.testing import run_ranks

#: the process's capture of ``_model``'s program (every build is the same program)
_CAPTURED: list[dict] = []


def _model() -> tuple[torch.nn.Module, list, dict]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("gpt", 0.1)
    model = model.to(torch.float64)
    data = batches(config, torch.float64)
    if not _CAPTURED:
        _CAPTURED.append(capture_modes(model, data[0]))
    return model, data, _CAPTURED[0]


def _train(pm: Any, opt: Any, data: list, steps: range) -> list[float]:
    losses = []
    for step in steps:
        batch = data[step % len(data)]
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(float(loss))
    return losses


def _other_values(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter drawn again (another seed): loads must overwrite them."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _plain_dcp_round_trip(pm: Any, other: Any, directory: Path) -> dict[str, torch.Tensor]:
    """``pm.state_dict()`` through plain ``torch.distributed.checkpoint`` save and load into
    ``other`` (the same plan, other values); returns ``other``'s full state dict after."""
    import torch.distributed.checkpoint as dcp

    saved = pm.state_dict()
    partial = {
        k: v.placements for k, v in saved.items() if any(p.is_partial() for p in v.placements)
    }
    assert not partial, partial  # a value is never a pending sum, and DCP refuses one
    dcp.save(saved, checkpoint_id=directory)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=directory)
    other.load_state_dict(state)
    return other.full_state_dict()


def _save_then_load_elsewhere(directory: str, phase: str) -> dict[str, Any]:
    """``save``: 4 ranks, dp 2 x tp 2 (mixed strategies) at ZeRO 2: 3 steps, a checkpoint, 2
    more steps; at the checkpoint also a plain DCP save of ``pm.state_dict()`` loaded into the
    same plan of other values. ``tp2`` (2 ranks, tp 2 at ZeRO 3) and ``one`` (1 rank) load it
    and take the same 2 steps. Returns the full state at the checkpoint and after, and the 2
    losses."""
    model, data, captured = _model()
    if phase == "save":
        mesh, strategies, zero = {"dp": 2, "tp": 2}, mixed("gpt", 2, 2), 2
    elif phase == "tp2":
        mesh, strategies, zero = {"dp": 1, "tp": 2}, mixed("gpt", 1, 2), 3
    else:
        mesh, strategies, zero = {"dp": 1}, None, 0
    pm = parallelize(model, data[0], mesh, strategies, captured=captured, zero=zero)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    path = Path(directory) / "step_3"
    if phase == "save":
        _train(pm, opt, data, range(3))
        autoshard.save(path, pm, opt, step=3, extra={"note": "three steps"})
    else:
        info = autoshard.load(path, pm, opt)
        assert info == {"step": 3, "extra": {"note": "three steps"}}
    at = pm.full_state_dict()
    if phase == "save":
        other = parallelize(_other_values(copy.deepcopy(model)), data[0], None,
                            plan=pm.plan, captured=captured, zero=zero)  # fmt: skip
        loaded = _plain_dcp_round_trip(pm, other, Path(directory) / "plain_dcp")
        for k, v in at.items():
            assert torch.equal(loaded[k], v), k
    losses = _train(pm, opt, data, range(3, 5))
    return {"at": at, "after": pm.full_state_dict(), "losses": losses}


def test_a_checkpoint_loads_under_another_plan_mesh_zero_stage_and_world(
    saved: tuple[Path, dict], on_2_ranks: list[dict]
) -> None:
    """Bitwise equal parameters where loaded; the optimizer's state (moments, step counts,
    settings) and the dropout step are loaded too, so the next steps equal the saving run's
    (float64; the sums run in another order on another split)."""
    directory, at_save = saved
    on_1_rank = run_ranks(_save_then_load_elsewhere, 1, str(directory), "one", timeout=300)
    for phase, loaded in (("tp2", on_2_ranks[0]["tp2"]), ("one", on_1_rank[0])):
        for k, v in at_save["at"].items():
            assert torch.equal(loaded["at"][k], v), (phase, k, loaded["at"][k][0, :3], v[0, :3])
            torch.testing.assert_close(loaded["after"][k], at_save["after"][k])
        assert loaded["losses"] == pytest.approx(at_save["losses"], rel=1e-9)
    # into the single-device model, on one process
    model, _, _ = _model()
    autoshard.load(directory / "step_3", model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, at_save["at"][k]), k


def _hf_llama(seed: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )
    return CausalLMLoss(transformers.LlamaForCausalLM(config)).to(torch.float64)


def _llama_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """5 batches of token ids for ``_hf_llama`` with a quarter of the labels ignored."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        out.append((ids, ids.masked_fill(torch.rand(4, 16, generator=gen) < 0.25, -100)))
    return out


def _searched_llama_through_plain_dcp(directory: str) -> dict[str, Any]:
    """transformers' Llama planned by ``search="optimal"`` on 2 ranks (a mesh with a size-1
    axis), at ZeRO 1, 2 and 3: ``pm.state_dict()`` saved and loaded with plain DCP into the
    same plan of other values gives the model's parameters exactly. Then the searched plan at
    ZeRO 3 trains 3 AdamW steps and ``autoshard.save``s; Megatron tensor parallel at ZeRO 1,
    from other values, loads the checkpoint and trains 2 more. Returns the mesh, the 5 losses
    and the full state after them."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = _hf_llama(0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    captured = capture_modes(model, (ids, ids))
    plan = None
    for zero in (1, 2, 3):
        how = {"search": "optimal"} if plan is None else {"plan": plan}
        pm = parallelize(copy.deepcopy(model), (ids, ids), 2 if plan is None else None,
                         captured=captured, zero=zero, **how)  # fmt: skip
        plan = pm.plan
        other = parallelize(_other_values(copy.deepcopy(model)), (ids, ids), None, plan=plan,
                            captured=captured, zero=zero)  # fmt: skip
        loaded = _plain_dcp_round_trip(pm, other, Path(directory) / f"zero{zero}")
        for k, v in model.state_dict().items():
            assert torch.equal(loaded[k], v), (zero, k)
    data, path = _llama_batches(), Path(directory) / "step_3"
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)  # pm: the searched plan at ZeRO 3
    losses = _train(pm, opt, data, range(3))
    autoshard.save(path, pm, opt, step=3)
    tp = parallelize(_other_values(copy.deepcopy(model)), (ids, ids), {"tp": 2},
                     _megatron(), captured=captured, zero=1)  # fmt: skip
    opt = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    autoshard.load(path, tp, opt)
    losses += _train(tp, opt, data, range(3, 5))
    state = tp.full_state_dict()
    split = [k for k, v in state.items() if tp.local_tensors()[k].numel() < v.numel()]
    return {"sizes": tuple(plan.mesh.sizes), "losses": losses, "state": state, "split": split}


def test_a_searched_plan_saves_and_loads_through_plain_dcp_at_every_zero_stage(
    on_2_ranks: list[dict],
) -> None:
    """The state dict of a searched plan with a size-1 axis has no Partial placement (once
    every parameter was ``Partial`` on the size-1 ``tp`` axis, and DCP refused it). And the
    searched plan's training, saved, loaded under Megatron tensor parallel and continued, is
    plain PyTorch's: the eager model and its AdamW, 5 steps on one process, losses (computed
    in float32 by transformers, which upcasts the logits) within 1e-6 and every parameter at
    ``assert_close``'s float64 defaults."""
    results = [r["searched"] for r in on_2_ranks]
    assert 1 in results[0]["sizes"], results[0]["sizes"]  # what DCP refused: dp 2 x tp 1
    assert len(results[0]["split"]) == 2 * 7  # q, k, v, o and the MLP's 3 weights of 2 layers
    eager = _hf_llama(0)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    expected = []
    for batch in _llama_batches():
        loss = eager(*batch)
        loss.backward()
        opt.step(), opt.zero_grad()
        expected.append(loss.item())
    for result in results:
        assert result["losses"] == pytest.approx(expected, rel=1e-6)
        assert result["state"].keys() == eager.state_dict().keys()
        for k, v in eager.state_dict().items():
            torch.testing.assert_close(result["state"][k], v, msg=lambda m, k=k: f"{k}: {m}")


def _resumed(directory: str) -> dict[str, Any]:
    """GPT on dp 2 at ZeRO 1 with a shuffling loader: 10 steps, a checkpoint, 10 more (the
    straight run); then a new model, optimizer and loader from the checkpoint, 10 more (the
    resumed run, whose first 10 steps are the straight run's). Returns each run's 20 losses
    and final parameters, and what a load of the checkpoint with a file cut short says."""
    model, data, captured = _model()
    samples = [tuple(t[i] for t in batch) for batch in data for i in range(len(batch[0]))]
    samples = samples[:18]  # 4 global batches of 4 an epoch, so step 10 is mid-epoch

    def fresh() -> tuple[Any, Any, Any]:
        pm = parallelize(copy.deepcopy(model), data[0], {"dp": 2}, captured=captured, zero=1)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        return pm, opt, autoshard.data.loader(samples, pm, batch_size=4, seed=7)

    pm, opt, loader = fresh()
    batches_seen = iter(())

    def steps(n: int) -> list[float]:
        nonlocal batches_seen
        losses = []
        for _ in range(n):
            batch = next(batches_seen, None)
            if batch is None:
                loader.set_epoch(loader.sampler.epoch + 1)
                batches_seen = iter(loader)
                batch = next(batches_seen)
            loss = pm(*batch)
            loss.backward()
            opt.step(), opt.zero_grad()
            losses.append(float(loss))
        return losses

    first = steps(10)
    path = Path(directory) / "b"
    autoshard.save(path, pm, opt, step=10, loader=loader)
    straight = first + steps(10)
    straight_state = pm.full_state_dict()
    pm, opt, loader = fresh()
    autoshard.load(path, pm, opt, loader=loader)
    batches_seen = iter(loader)
    resumed = first + steps(10)
    return {
        "straight": straight + [straight_state],
        "resumed": resumed + [pm.full_state_dict(), _damaged_load(path, pm, opt)],
    }


def _damaged_load(path: Path, pm: Any, opt: Any) -> str:
    """Rank 1 cuts the last byte off a file of the checkpoint; what each rank's load says."""
    import torch.distributed as dist

    victim = sorted(path.glob("*.distcp"))[-1]
    if dist.get_rank() == 1:
        victim.write_bytes(victim.read_bytes()[:-1])
    dist.barrier()
    try:
        autoshard.load(path, pm, opt)
    except autoshard.CheckpointDamaged as err:
        return str(err)
    return "loaded"


def test_ten_steps_save_load_ten_more_equals_twenty_steps_bitwise(on_2_ranks: list[dict]) -> None:
    """... and a file of the checkpoint cut short is one error naming it on every rank."""
    straight = on_2_ranks[0]["straight"]
    resumed = [r["resumed"] for r in on_2_ranks]
    assert resumed[0][:20] == straight[:20]
    for k, v in straight[20].items():
        assert torch.equal(resumed[0][20][k], v), k
    said = {rank[21] for rank in resumed}
    assert len(said) == 1, said  # the same error on both ranks, none waiting for the other
    assert re.fullmatch(r"checkpoint \S+/b is damaged: __\d_\d\.distcp is \d+ bytes, .*", *said)


def _with_unused() -> tuple[torch.nn.Module, list]:
    """GPT (no dropout) in float64 with a parameter its forward never reads, so it never has
    a gradient and AdamW never makes state for it."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("gpt", 0.0)
    model.unused = torch.nn.Parameter(torch.randn(3))
    return model.to(torch.float64), batches(config, torch.float64)


def _unused_parameter(directory: str) -> dict[int, Any]:
    """At ZeRO 0 and 1 on dp 2: ``_with_unused`` trained 2 AdamW steps, saved, loaded into a
    fresh module and optimizer, 2 more steps. Returns by stage the 4 losses, the full state
    after them, and whether the loaded optimizer has state for the unused parameter and for
    every other one."""
    model, data = _with_unused()
    captured = capture_modes(model, data[0])
    out = {}
    for zero in (0, 1):
        pm = parallelize(copy.deepcopy(model), data[0], {"dp": 2}, captured=captured, zero=zero)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        losses = _train(pm, opt, data, range(2))
        path = Path(directory) / f"zero{zero}"
        autoshard.save(path, pm, opt, step=2)
        pm = parallelize(copy.deepcopy(model), data[0], {"dp": 2}, captured=captured, zero=zero)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        autoshard.load(path, pm, opt)
        stateful = {name: bool(opt.state.get(p)) for name, p in pm.named_parameters()}
        losses += _train(pm, opt, data, range(2, 4))
        out[zero] = {"losses": losses, "state": pm.full_state_dict(), "stateful": stateful}
    return out


def test_a_parameter_without_optimizer_state_saves_and_loads_without_it(
    on_2_ranks: list[dict],
) -> None:
    """A parameter that never had a gradient has no AdamW state when saved; it loads without
    state (torch's ``optimizer.state_dict()`` round trip leaves it so), and the run goes on as
    plain PyTorch's: the eager model and its AdamW, 4 steps without a checkpoint, losses
    within 1e-12 and every parameter at ``assert_close``'s float64 defaults."""
    eager, data = _with_unused()
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    expected = []
    for step in range(4):
        loss = eager(*data[step % len(data)])
        loss.backward()
        opt.step(), opt.zero_grad()
        expected.append(loss.item())
    assert eager.unused not in opt.state  # what the checkpoint has to carry over: nothing
    for rank in on_2_ranks:
        for zero, result in rank["unused"].items():
            others = {k: v for k, v in result["stateful"].items() if k != "unused"}
            assert not result["stateful"]["unused"] and all(others.values()), (zero, others)
            assert result["losses"] == pytest.approx(expected, rel=1e-12), zero
            assert result["state"].keys() == eager.state_dict().keys()
            for k, v in eager.state_dict().items():
                torch.testing.assert_close(result["state"][k], v, msg=lambda m, k=k: f"{k}: {m}")


def test_a_damaged_checkpoint_is_passed_over_by_latest_and_named_by_load(tmp_path) -> None:
    """The newest checkpoint with a file cut short, its ``.metadata`` gone or a byte changed:
    ``latest`` takes the one before and says once which it passed over and why (a changed
    byte is only found by the checksum, so ``latest`` takes it and ``load`` names it); every
    damage is one CheckpointDamaged naming the checkpoint and the file."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for step in (1, 2):
        autoshard.save(tmp_path / f"step{step}", model, opt, step=step)
    manifest = json.loads((tmp_path / "step2" / checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in (tmp_path / "step2").iterdir()} - {
        checkpoint.MANIFEST
    }
    shard = sorted((tmp_path / "step2").glob("*.distcp"))[0]
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.warns(UserWarning, match=r"step2 \(__0_0\.distcp is \d+ bytes, the manifest"):
        assert autoshard.latest(tmp_path) == tmp_path / "step1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run: the same news is not told again
        assert autoshard.latest(tmp_path) == tmp_path / "step1"
    with pytest.raises(autoshard.CheckpointDamaged, match=r"checkpoint \S+step2 is damaged: __0_"):
        autoshard.load(tmp_path / "step2", model, opt)
    shard.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    assert autoshard.latest(tmp_path) == tmp_path / "step2"
    with pytest.raises(autoshard.CheckpointDamaged, match="does not have the checksum"):
        autoshard.load(tmp_path / "step2", model, opt)
    shard.write_bytes(whole)
    assert autoshard.load(tmp_path / "step2", model, opt)["step"] == 2
    (tmp_path / "step2" / ".metadata").unlink()
    with pytest.warns(UserWarning, match=r"step2 \(\.metadata is missing\); taking \S+step1"):
        assert autoshard.latest(tmp_path) == tmp_path / "step1"
    with pytest.raises(autoshard.CheckpointDamaged, match=r"\.metadata is missing"):
        autoshard.load(tmp_path / "step2", model, opt)
    (tmp_path / "step1" / checkpoint.MANIFEST).write_text('{"format": ')
    with pytest.warns(UserWarning, match="no whole checkpoint left"):
        assert autoshard.latest(tmp_path) is None


class _Killed(BaseException):
    """A writer stopped dead (not an Exception: nothing may catch it and go on)."""


def test_an_interrupted_save_never_loads_as_complete(tmp_path, monkeypatch) -> None:
    """A save stopped at each of its steps in turn (every chunk resolved, every file written,
    the manifest, the renames): ``latest`` still finds the previous checkpoint, which loads."""
    import os
    import shutil

    import torch.distributed.checkpoint as dcp

    model, data, captured = _model()
    pm = parallelize(model, data[0], {"dp": 1}, captured=captured, zero=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    _train(pm, opt, data, range(1))
    autoshard.save(tmp_path / "step_1", pm, opt, step=1)
    first = pm.full_state_dict()
    _train(pm, opt, data, range(1, 2))
    calls = {"n": 0, "stop": 0}
    targets = [
        (dcp_io.SavePlanner, "resolve_data"),
        (dcp.FileSystemWriter, "write_data"),
        (dcp.FileSystemWriter, "finish"),
        (Path, "write_text"),
        (os, "replace"),
        (shutil, "rmtree"),
    ]
    for owner, name in targets:
        original = getattr(owner, name)

        def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == calls["stop"]:
                raise _Killed
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    fresh = parallelize(_model()[0], data[0], {"dp": 1}, captured=captured)
    points = 0
    while True:
        calls["n"], calls["stop"] = 0, points + 1
        try:
            autoshard.save(tmp_path / "step_2", pm, opt, step=2)
        except (_Killed, dcp.api.CheckpointException):  # DCP reports what stopped a rank
            assert calls["n"] >= calls["stop"]  # stopped by us, nothing else
            points += 1
            calls["stop"] = 0  # the checks run uninterrupted
            found = autoshard.latest(tmp_path)
            assert found == tmp_path / "step_1", points
            autoshard.load(found, fresh)
            got = fresh.full_state_dict()
            assert all(torch.equal(got[k], v) for k, v in first.items()), points
            continue
        break
    # the last save ran whole, through every call it makes: each was a stop point before it
    assert points == calls["n"] and points >= 20, (points, calls["n"])
    print(f"stopped at {points} points")
    assert autoshard.latest(tmp_path) == tmp_path / "step_2"


def test_a_checkpoint_of_another_model_or_an_incomplete_one_is_a_clear_error(tmp_path) -> None:
    model, data, captured = _model()
    autoshard.save(tmp_path / "small", model)
    wider = torch.nn.Linear(4, 3)
    with pytest.raises(
        autoshard.CheckpointError, match="small: the checkpoint has no 'model.(weight|bias)'"
    ):
        autoshard.load(tmp_path / "small", wider)
    other = copy.deepcopy(model)
    other.wpe = torch.nn.Embedding(other.wpe.num_embeddings * 2, other.wpe.embedding_dim)
    with pytest.raises(autoshard.CheckpointError, match=r"wpe.weight is \(\d+, \d+\) in the "):
        autoshard.load(tmp_path / "small", other)
    (tmp_path / "half.incomplete").mkdir()
    with pytest.raises(autoshard.CheckpointError, match="not a complete autoshard checkpoint"):
        autoshard.load(tmp_path / "half.incomplete", model)
    assert autoshard.latest(tmp_path) == tmp_path / "small"


# -- one spawn for each count of ranks ------------------------------------------------------------


def _on_2_ranks(directory: str) -> dict[str, Any]:
    """This module's checks on 2 ranks in turn, in one spawn (spawning and a new process's
    first capture dominate their time); ``directory`` holds the 4 ranks' checkpoint, and a
    folder of its own for each other check's."""
    searched, resumed = Path(directory) / "searched", Path(directory) / "resumed"
    unused = Path(directory) / "unused"
    for folder in (searched, resumed, unused):
        folder.mkdir(exist_ok=True)
    return {
        "tp2": _save_then_load_elsewhere(directory, "tp2"),
        "searched": _searched_llama_through_plain_dcp(str(searched)),
        **_resumed(str(resumed)),
        "unused": _unused_parameter(str(unused)),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The directory of the checkpoint 4 ranks saved (dp 2 x tp 2 at ZeRO 2), and rank 0's
    full state at it and after, and losses."""
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, run_ranks(_save_then_load_elsewhere, 4, str(directory), "save", timeout=300)[
        0
    ]


@pytest.fixture(scope="module")
def on_2_ranks(saved: tuple[Path, dict]) -> list[dict]:
    """Every rank's outcome of each check on 2 ranks, by name."""
    return run_ranks(_on_2_ranks, 2, str(saved[0]), timeout=900)
