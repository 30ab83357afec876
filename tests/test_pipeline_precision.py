"""Mixed precision across pipeline stages: transformers' Llama (its loss computed in float32
whatever the compute dtype) under ``precision="bf16"`` on ``{"pp": 2}`` (1F1B and ZB-V) and
``{"dp": 2, "pp": 2}`` equals one device under the same policy (``single_device``), step by
step. A stage receives what the stage before it makes, in the dtype it makes it (bfloat16
activations, a float32 loss), and every rank gets the float32 loss.

Tolerances are bfloat16's, as in test_precision.py: the loss within 2% each step; SGD's update
of every parameter over the run within 3% of its norm (a stage boundary adds nothing but the
order of the micro-batches' sums; a gradient missing a micro-batch is off by tens of percent).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from autoshard.testing import run_ranks  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 8, 8, 4
LOSS_RTOL = 0.02
#: small enough that both runs stay near one path: a larger step turns the rounding of the
#: first gradients (0.2-0.3% a parameter, as in one device's run on the same micro-batches)
#: into different trajectories
LR = 0.05
UPDATE_TOLERANCE = 0.03


def _llama() -> torch.nn.Module:
    import transformers
    from test_hf_gpt2 import CausalLMLoss

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )  # fmt: skip
    return CausalLMLoss(transformers.LlamaForCausalLM(config))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out.append((ids, ids.masked_fill(torch.rand(BATCH, SEQ, generator=gen) < 0.25, -100)))
    return out


_CAPTURED: dict[int, tuple] = {}


def _captures(model: torch.nn.Module, batch: tuple, microbatches: int) -> tuple:
    """The bfloat16 captures of the whole batch (one device's) and of one micro-batch (a
    stage's), made once per rank process for every case with that many micro-batches:
    capturing is nearly all of a case's time, and the graphs are the same whatever the
    schedule or the mesh."""
    from autoshard import capture_modes
    from autoshard.runtime.pipeline import microbatch_example

    if microbatches not in _CAPTURED:
        micro = microbatch_example(batch, None, microbatches)[0]
        _CAPTURED[microbatches] = tuple(
            capture_modes(model, example, dtype=torch.bfloat16) for example in (batch, micro)
        )
    return _CAPTURED[microbatches]


def _against_one_device(mesh: dict, **pipeline: Any) -> str:
    """SGD steps under the pipeline and on one device, both in bfloat16; '' when every
    loss and every parameter's update agree at bfloat16's tolerance, else what differs."""
    from autoshard import parallelize, single_device

    model, batches = _llama(), _batches()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    whole, micro = _captures(model, batches[0], pipeline["microbatches"])
    ref = single_device(copy.deepcopy(model), batches[0], precision="bf16", captured=whole)
    pm = parallelize(model, batches[0], mesh, precision="bf16", captured=micro, **pipeline)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    for step, batch in enumerate(batches):
        loss, want = pm(*batch), ref(*batch)
        if loss.dtype != torch.float32:
            return f"{mesh} {pipeline}: the loss is {loss.dtype}, the model's is float32"
        loss.backward(), want.backward()
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        if abs(float(loss) - float(want)) > LOSS_RTOL * abs(float(want)):
            return f"{mesh} {pipeline}: step {step} loss {float(loss)} != {float(want)}"
    full, full_ref = pm.full_state_dict(), ref.full_state_dict()
    for key, before in start.items():
        moved, moved_ref = full[key] - before, full_ref[key] - before
        error = float((moved - moved_ref).norm() / moved_ref.norm().clamp_min(1e-12))
        if error > UPDATE_TOLERANCE:
            return f"{mesh} {pipeline}: {key}'s update differs by {error:.1%}"
    return ""


def _cases_world2() -> list[str]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = [
        _against_one_device({"pp": 2}, schedule="1f1b", microbatches=2),
        _against_one_device({"pp": 2}, schedule="zbv", microbatches=2),
    ]
    return [o for o in out if o]


def _cases_world4() -> list[str]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = [_against_one_device({"dp": 2, "pp": 2}, schedule="1f1b", microbatches=2)]
    return [o for o in out if o]


def test_bf16_across_two_stages_equals_one_device() -> None:
    for problems in run_ranks(_cases_world2, 2, timeout=600):
        assert problems == []


def test_bf16_across_stages_with_data_parallel_equals_one_device() -> None:
    for problems in run_ranks(_cases_world4, 4, timeout=600):
        assert problems == []
