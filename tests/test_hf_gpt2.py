"""transformers' GPT-2 (GPT2LMHeadModel) under autoshard trains exactly as one device does.

Two ranks capture the model once and train three copies in lockstep for 5 AdamW steps in
float64 with dropout on: the one-device reference (``single_device``: the same dropout masks as
any split), (a) data parallel on ``{"dp": 2}`` with no strategies, and (b) head-parallel
attention on ``{"tp": 2}``: the fused QKV Conv1D split by heads, the output Conv1D split by rows.
Every step's loss and every parameter at the end are compared with ``assert_close`` defaults.

The model is used as users call it: ``model(input_ids=..., labels=...).loss``, with the config's
defaults otherwise, so it also covers
- ``use_cache=True`` (the default): the model builds an empty DynamicCache during training,
  which export lifts into constant tensors of shape ``[0]`` concatenated onto the keys and
  values;
- the example batch passing the same tensor as ``input_ids`` and ``labels`` (the usual causal-LM
  call) while the training batches differ (padding positions set to -100).

transformers computes this loss in float32 (ForCausalLMLoss upcasts the logits), so the
per-step losses are compared at float32 tolerance; the parameters are float64.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from autoshard.testing import run_ranks  # noqa: E402

VOCAB, SEQ, EMBD, HEADS, LAYERS = 64, 16, 32, 4, 2
BATCH, STEPS = 4, 5


def _strategies() -> dict[str, tuple]:
    """GPT-2's Conv1D computes addmm(bias[out], x[N, in], W[in, out]): one entry per tensor
    input, one item per dim. c_attn's output dim is (q|k|v, head, head_dim): each rank takes its
    heads of each; c_proj contracts over the heads, so its W is split by rows."""
    from autoshard.layout import Factored

    qkv = Factored((3, HEADS, EMBD // HEADS), (None, "tp", None))
    return {
        "model.transformer.h.*.attn.c_attn": ((qkv,), (None, None), (None, qkv)),
        "model.transformer.h.*.attn.c_proj": ((None,), (None, "tp"), ("tp", None)),
    }


class CausalLMLoss(torch.nn.Module):
    """The model's own loss; transformers shifts the labels and ignores -100."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def _gpt2() -> CausalLMLoss:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=EMBD,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.0,  # sdpa's own dropout has no split-invariant form
        bos_token_id=0,
        eos_token_id=0,
        # sdpa: one scaled_dot_product_attention op per layer, split by heads as a whole
        attn_implementation="sdpa",
    )
    return CausalLMLoss(GPT2LMHeadModel(config).double())


def _batches() -> tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    example = (ids, ids)  # labels=input_ids: one tensor passed twice
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = ids.masked_fill(torch.rand(BATCH, SEQ, generator=gen) < 0.25, -100)
        batches.append((ids, labels))
    return example, batches


def _train(example: tuple, batches: list) -> dict:
    import torch.distributed as dist

    from autoshard.graph.capture import capture_modes
    from autoshard.runtime import parallelize, shard_inputs, single_device

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    model = _gpt2()
    captured = capture_modes(model, example)
    captured_s = time.perf_counter() - start
    runs = {
        "one device": single_device(copy.deepcopy(model), example, captured=captured),
        "dp": parallelize(copy.deepcopy(model), example, {"dp": 2}, captured=captured),
        "tp": parallelize(
            copy.deepcopy(model), example, {"tp": 2}, _strategies(), captured=captured
        ),
    }
    planned_s = time.perf_counter() - start - captured_s

    # Dropout off: autoshard's programs compute what the eager model computes.
    model.eval()
    with torch.no_grad():
        eager = model(*batches[0])
        for name, pm in runs.items():
            pm.eval()
            got = pm(*shard_inputs(batches[0], pm))
            torch.testing.assert_close(got, eager, msg=lambda m, n=name: f"eval {n}: {m}")
            pm.train()

    optimizers = {name: torch.optim.AdamW(pm.parameters(), lr=1e-2) for name, pm in runs.items()}
    losses: list[dict[str, float]] = []
    for step, batch in enumerate(batches):
        step_losses = {}
        for name, pm in runs.items():
            loss = pm(*shard_inputs(batch, pm))
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            step_losses[name] = loss.detach()
        for name in ("dp", "tp"):
            torch.testing.assert_close(
                step_losses[name],
                step_losses["one device"],
                msg=lambda m, n=name, s=step: f"{n} step {s} loss: {m}",
            )
        losses.append({k: v.item() for k, v in step_losses.items()})

    reference = runs["one device"].full_state_dict()
    for name in ("dp", "tp"):
        state = runs[name].full_state_dict()  # a collective: same order on every rank
        assert state.keys() == reference.keys(), name
        for key, value in reference.items():
            torch.testing.assert_close(
                state[key], value, msg=lambda m, n=name, k=key: f"{n} {k}: {m}"
            )
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "capture_s": captured_s,
        "plan_s": planned_s,
        "total_s": time.perf_counter() - start,
    }


def test_hf_gpt2_data_and_head_parallel_match_one_device() -> None:
    example, batches = _batches()
    results = run_ranks(_train, 2, example, batches, timeout=240)
    assert [r["losses"] for r in results] == [results[0]["losses"]] * 2
    for r in results:
        print(
            f"rank {r['rank']}: capture {r['capture_s']:.1f}s, plan+lower {r['plan_s']:.1f}s, "
            f"total {r['total_s']:.1f}s, last losses {r['losses'][-1]}"
        )
