"""transformers models as they come: no wrapper, no loss function, the model's own loss.

The user's functions below return what ``autoshard train`` and ``autoshard plan --model-fn``
both take: transformers' ``LlamaForCausalLM`` or ``MixtralForCausalLM`` (built from a small
config, 2 layers, hidden 64, float64, ``use_cache`` left at its default) and a dataset of dicts
with ``input_ids``, ``attention_mask`` (right padding) and ``labels`` (-100 on the padding).
autoshard calls the model with the batch as keywords and ``use_cache=False`` and trains on the
``loss`` of its output.

Two ranks, spawned once, train four cases 4 AdamW steps each: Llama and Mixtral through
``autoshard train``'s rank function (a searched plan, the data from the loader, a checkpoint
at the end), Llama with Megatron's tensor parallel strategies and Mixtral with its experts
over ``ep`` through ``parallelize`` with a dict batch. Each is compared with plain PyTorch:
the eager model, ``model(**batch).loss``, ``loss.backward()`` and ``torch.optim.AdamW`` on the
same global batches; losses within 1e-6 (transformers computes the loss in float32: it upcasts
the logits) and every parameter at ``assert_close``'s float64 defaults.
"""

from __future__ import annotations

import copy
import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from test_copies import _megatron  # noqa: E402
from test_examples import _free_port  # noqa: E402

from autoshard.testing import run_ranks  # noqa: E402

VOCAB, SEQ, SAMPLES, BATCH, STEPS, LR = 64, 16, 32, 8, 4, 1e-2
NO_LOSS = (
    "LlamaForCausalLM returned no loss: pass labels in the batch, or return a scalar loss "
    "from forward"
)
#: Megatron's split of Llama's attention and MLP: the paths are the model's own (no wrapper)
MEGATRON = _megatron(layer="model.layers.*")


def _samples(labels: bool = True) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(SAMPLES):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < SEQ - int(torch.randint(0, 4, (), generator=g))).long()
        sample = {"input_ids": ids, "attention_mask": mask}
        if labels:
            sample["labels"] = ids.masked_fill(mask == 0, -100)
        out.append(sample)
    return out


def _llama() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()


def _mixtral() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation("batched_mm")  # float64: the grouped product is float32's
    return model.double()


# -- the user's functions: one shape for `autoshard train` and `autoshard plan --model-fn` ----


def make_llama() -> tuple:
    return _llama(), _samples()


def make_mixtral() -> dict[str, Any]:
    return {"model": _mixtral(), "dataset": _samples(), "optimizer": {"weight_decay": 0.0}}


def make_llama_batch() -> tuple:
    """One batch (a dict the model takes as keywords) instead of a dataset."""
    from torch.utils.data import default_collate

    return _llama(), default_collate(_samples()[:BATCH])


def make_unlabelled() -> tuple:
    return _llama(), _samples(labels=False)


# -- plain PyTorch -------------------------------------------------------------------------------


def _global_batches(dataset: list) -> list[dict[str, torch.Tensor]]:
    """The global batches ``autoshard train``'s loader hands out, in its order (seed 0)."""
    from torch.utils.data import default_collate

    from autoshard.data import ShardSampler

    order = list(ShardSampler(len(dataset), BATCH, 1, 0, seed=0))
    return [
        default_collate([dataset[i] for i in order[BATCH * s : BATCH * (s + 1)]])
        for s in range(STEPS)
    ]


def _eager(model: torch.nn.Module, batches: list, **optimizer: Any) -> tuple[list, dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **optimizer)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _same(losses: list, state: dict, want: tuple[list, dict], name: str) -> None:
    assert losses == pytest.approx(want[0], rel=1e-6, abs=0), (name, losses, want[0])
    assert state.keys() == want[1].keys(), name
    for key, value in want[1].items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{name} {k}: {m}")


# -- on the ranks --------------------------------------------------------------------------------


def _trained(target: str, directory: str) -> float:
    """``autoshard train target`` as each rank runs it: plan, train, log, checkpoint."""
    from autoshard.cli.train import TrainConfig, worker

    began = time.perf_counter()
    name = target.rpartition("_")[2]
    worker(TrainConfig(
        target=target, steps=STEPS, batch_size=BATCH, lr=LR, log_every=STEPS,
        log=f"{directory}/{name}.jsonl", checkpoint_dir=f"{directory}/{name}",
        checkpoint_every=STEPS,
    ))  # fmt: skip
    return time.perf_counter() - began


def _parallelized(model: torch.nn.Module, mesh: dict, strategies: Any = None) -> dict:
    """``parallelize`` with the first global batch, a dict, as the example; trained on the
    global batches with ``pm(**batch)``."""
    from autoshard import parallelize, shard_inputs

    batches = _global_batches(_samples())
    began = time.perf_counter()
    pm = parallelize(model, batches[0], mesh, strategies)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = pm(**shard_inputs(batch, pm))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = pm.full_state_dict()  # a collective: the same order on every rank
    return {"losses": losses, "state": state, "seconds": time.perf_counter() - began}


def _cases(directory: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    return {
        "llama train": _trained("test_hf_own_loss:make_llama", directory),
        "mixtral train": _trained("test_hf_own_loss:make_mixtral", directory),
        "llama tp": _parallelized(_llama(), {"tp": 2}, MEGATRON),
        "mixtral ep": _parallelized(_mixtral(), {"ep": 2}),
    }


def _from_train(directory: Path, name: str, model: torch.nn.Module) -> tuple[list, dict]:
    """The losses ``autoshard train`` logged and the parameters of its last checkpoint."""
    from autoshard.runtime.state.checkpoint import load_weights

    lines = (directory / f"{name}.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    load_weights(directory / name / f"step{STEPS}", model)
    return losses, model.state_dict()


def test_transformers_models_train_with_their_own_loss_as_plain_pytorch(tmp_path) -> None:
    results = run_ranks(_cases, 2, str(tmp_path), timeout=900)
    for name, make in (("llama", make_llama), ("mixtral", make_mixtral)):
        parts = make()
        model, dataset = (parts["model"], parts["dataset"]) if name == "mixtral" else parts
        optimizer = parts["optimizer"] if name == "mixtral" else {}
        want = _eager(copy.deepcopy(model), _global_batches(dataset), **optimizer)
        _same(*_from_train(tmp_path, name, model), want, f"{name} through autoshard train")
        print(f"{name} through autoshard train: {results[0][f'{name} train']:.1f} s")
    for name, model in (("llama tp", _llama()), ("mixtral ep", _mixtral())):
        want = _eager(model, _global_batches(_samples()))
        for result in results:
            _same(result[name]["losses"], result[name]["state"], want, name)
        print(f"{name}: {results[0][name]['seconds']:.1f} s")


# -- on one process ------------------------------------------------------------------------------


def test_a_model_that_returns_no_loss_says_what_to_return_in_one_line() -> None:
    import autoshard
    from autoshard.graph import CaptureError

    model, samples = make_unlabelled()
    from torch.utils.data import default_collate

    began = time.perf_counter()
    with pytest.raises(CaptureError) as caught:
        autoshard.plan(model, default_collate(samples[:BATCH]), "cpu", num_devices=2)
    assert str(caught.value) == NO_LOSS
    assert time.perf_counter() - began < 30  # one trace, not export's retries
    assert "forward" not in model.__dict__  # the model's own forward back


def test_autoshard_train_of_a_model_without_labels_is_one_line(tmp_path) -> None:
    """Two ranks under torchrun capture the model, which returns no loss: the whole output
    is one line saying what to return, from rank 0."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    command = [
        sys.executable, "-m", "autoshard.cli", "train", "test_hf_own_loss:make_unlabelled",
        "--nproc-per-node", "2", "--steps", "1", "--log", str(tmp_path / "log.jsonl"),
        "--master-port", str(_free_port()),  # not torchrun's 29500: other launches run beside
    ]  # fmt: skip
    out = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    assert out.stderr == f"autoshard: error: {NO_LOSS}\n", out.stderr


def test_plan_model_fn_takes_the_function_train_takes(tmp_path, capsys) -> None:
    """``autoshard plan --model-fn`` with ``train``'s functions: a dataset (8 samples planned,
    or ``--batch`` of them), one batch (reshaped by ``--batch`` and ``--seq``), and a model
    without labels in one line with status 2."""
    from autoshard.cli.main import main

    def planned(target: str, *flags: str) -> dict:
        out = tmp_path / "plan.json"
        argv = ["plan", "--model-fn", target, "--cluster", "cpu", "--devices", "2"]
        assert main([*argv, *flags, "--json", str(out)]) == 0
        return json.loads(out.read_text())

    default = planned("test_hf_own_loss:make_llama")
    assert sorted(default["inputs"]) == ["attention_mask", "input_ids", "labels"]
    activations = default["predicted"]["memory_bytes"]["activations"]
    batch = planned("test_hf_own_loss:make_llama_batch")
    assert batch["predicted"]["memory_bytes"]["activations"] == activations  # the same 8 x 16
    smaller = planned("test_hf_own_loss:make_llama", "--batch", "4", "--seq", "8")
    assert smaller["predicted"]["memory_bytes"]["activations"] < activations / 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model-fn", "test_hf_own_loss:make_unlabelled", "--cluster", "cpu"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"autoshard: error: {NO_LOSS}\n"


def test_the_example_batch_is_shaped_by_batch_and_seq_from_the_data() -> None:
    from autoshard.cli.user_fn import plan_inputs

    model, example, loss_fn = plan_inputs("test_hf_own_loss:make_llama", None, None)
    assert loss_fn is None and isinstance(model, torch.nn.Module)
    assert {k: tuple(v.shape) for k, v in example.items()} == {
        "input_ids": (8, SEQ), "attention_mask": (8, SEQ), "labels": (8, SEQ),
    }  # fmt: skip
    samples = _samples()
    _, example, _ = plan_inputs("test_hf_own_loss:make_llama", 40, 20)
    ids = example["input_ids"]
    assert tuple(ids.shape) == (40, 20)
    assert torch.equal(ids[SAMPLES], samples[0]["input_ids"].repeat(2)[:20])  # data, again
    _, example, _ = plan_inputs("test_hf_own_loss:make_llama_batch", 3, 6)
    assert tuple(example["labels"].shape) == (3, 6)
    assert torch.equal(example["labels"][1], samples[1]["labels"][:6])
    with pytest.raises(ValueError, match=re.escape("--seq 0: expected 1 or more")):
        plan_inputs("test_hf_own_loss:make_llama", None, 0)
