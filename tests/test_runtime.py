"""Equivalence of parallel training with one device (DESIGN.md invariant 1).

Every case trains a reference model for 5 AdamW steps in float64 with dropout on, on one device
(``single_device``: the same dropout masks as any split) and under a plan, and compares the loss
of every step and every parameter at the end with ``assert_close`` defaults. Some cases take
plain PyTorch as the reference instead (``PYTORCH``: the eager model stepped by
``torch.optim``, dropout off), an oracle that shares no code with autoshard. Ranks capture each
model once and run many plans, because spawning and exporting dominate the time.
"""

from __future__ import annotations

import copy
import operator
import random
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autoshard import (
    Factored,
    PlanMismatchError,
    gather_tensor,
    parallelize,
    shard_inputs,
    single_device,
)
from autoshard.cost import cluster_spec, estimate
from autoshard.graph.capture import capture_modes
from autoshard.mesh import mesh_info
from autoshard.models import GPTConfig, LlamaConfig, reference_config
from autoshard.models import build as build_model
from autoshard.ops import SpaceRule, rule_for, tensor_inputs
from autoshard.testing import run_ranks

STEPS = 5
BATCH = 4
#: a case's reference: autoshard's own program on one device (dropout on, the masks any split
#: draws), or plain PyTorch (the eager model and its ``torch.optim`` optimizer, dropout off)
ONE_DEVICE, PYTORCH = "single_device", "pytorch"


class SmallCNN(nn.Module):
    """conv -> batch norm -> conv -> linear, returning the loss (as many vision models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.relu(self.conv2(h))
        return F.cross_entropy(self.head(h.flatten(1)), target)


class CNNConfig:
    def example_batch(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, 3, 4, 4, generator=gen), torch.randint(
            0, 4, (batch,), generator=gen
        )


class Regressor(nn.Module):
    """An MLP returning ``F.mse_loss`` (torch.export keeps its ``broadcast_tensors``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), target)


class RegressorConfig:
    def example_batch(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, 16, generator=gen), torch.randn(batch, 8, generator=gen)


def build(name: str, dropout: float) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    if name == "cnn":
        return SmallCNN(), CNNConfig()
    if name == "regression":
        return Regressor(), RegressorConfig()
    sizes = {"heads": 8, "kv_heads": 4} if name == "llama" else {}
    config = reference_config(name, dropout=dropout, **sizes)
    return build_model(config), config


def batches(config: Any, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        batch = config.example_batch(BATCH, gen)
        if isinstance(config, GPTConfig | LlamaConfig):
            batch[1][:, -2:] = -100  # ignored positions: the loss averages over the others
        out.append(tuple(t.to(dtype) if t.is_floating_point() else t for t in batch))
    return out


#: each rank process's captures by (model, dtype, dropout), shared by every check
_CAPTURES: dict[tuple, Any] = {}


def captured_of(key: tuple, model: torch.nn.Module, example: tuple) -> dict:
    """``model``'s capture on ``example``, made once per rank process for every check of the
    same model (``key``: its name, dtype and dropout): capturing is most of a check's time,
    and the graph is the same whatever the mesh, the strategies or the parameters' values."""
    if key not in _CAPTURES:
        _CAPTURES[key] = capture_modes(model, example)
    return _CAPTURES[key]


# -- strategies ------------------------------------------------------------------------------------


def megatron(name: str, tp: str = "tp") -> dict[str, Any]:
    """Column- then row-split linears, head-split attention, vocab-split embedding and loss."""
    col = ((None, None, None), (tp, None))
    row = ((None, None, tp), (None, tp))
    if name == "mlp":
        return {
            "layers.*.fc1": ((None, None), (tp, None)),
            "layers.*.fc2": ((None, tp), (None, tp)),
            "head": ((None, None), (tp, None)),
        }
    if name == "gpt":
        qkv = Factored((3, 4, 8), (None, tp, None))
        return {
            "layers.*.attn.c_attn": ((None, None, None), (qkv, None)),
            "layers.*.attn.c_proj": row,
            "layers.*.mlp.c_fc": col,
            "layers.*.mlp.c_proj": row,
            "wte": ((tp, None), (None, None)),
            "lm_head": col,
        }
    return {
        "layers.*.attention.w[qkv]": col,
        "layers.*.attention.wo": row,
        "layers.*.feed_forward.w[13]": col,
        "layers.*.feed_forward.w2": row,
        "tok_embeddings": ((tp, None), (None, None)),
        "output": col,
    }


def sequence_parallel(tp: str = "tp") -> dict[str, Any]:
    """GPT under Megatron with its residual stream, norms and embedding sum split by sequence
    over ``tp`` (Megatron's sequence parallelism: all-gather before the column-split linears,
    reduce-scatter of the row-split outputs into the residual adds)."""
    seq = (None, tp, None)
    return megatron("gpt", tp) | {
        "/add.0": (seq, (tp, None)),  # token + position embeddings
        "layers.*/add.0": (seq, seq),
        "layers.*/add.1": (seq, seq),
        "layers.*.ln_[12]": (seq, (None,), (None,)),
        "layers.*.attn.resid_dropout/native_dropout.0": (
            seq,
        ),  # the row-split sums land split: reduce-scatter
        "layers.*.mlp.dropout/native_dropout.0": (seq,),
    }


def attention_rows(axis: str = "tp") -> dict[str, Any]:
    """GPT with every activation split by sequence over ``axis`` and its causal attention's
    query rows too, the keys and values gathered (context parallelism's all-gather method):
    each rank masks from its rows' offset; the gathers' backward reduce-scatters."""
    seq, whole = (None, axis, None), (None, None)
    rows, kv = (None, None, axis, None), (None, None, None, None)
    linears = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    return {f"layers.*.{m}": (seq, whole) for m in linears} | {
        "/add.0": (seq, (axis, None)),
        "layers.*/add.0": (seq, seq),
        "layers.*/add.1": (seq, seq),
        "layers.*.ln_[12]": (seq, (None,), (None,)),
        "layers.*.attn/scaled_dot_product_attention.0": (rows, kv, kv),
    }


def mixed(name: str, dp: int, tp: int) -> dict[str, Any]:
    """MindSpore's tuple form: batch split dp ways and the weight's output dim tp ways."""
    if name == "mlp":
        return {"layers.*.fc1": ((dp, 1), (tp, 1)), "head": ((dp, 1), (tp, 1))}
    keys = (
        ["layers.*.attn.c_*", "layers.*.mlp.c_*"]
        if name == "gpt"
        else ["layers.*.attention.w*", "layers.*.feed_forward.w*"]
    )
    return dict.fromkeys(keys, ((dp, 1, 1), (tp, 1)))


@dataclass(frozen=True)
class RandomStrategies:
    seed: int


@dataclass(frozen=True)
class Searched:
    """A plan searched for dgx-h100 with memory limited to ``fraction`` of the unlimited plan's
    peak (tiny models plan replicated or data parallel otherwise); ``via_json`` passes it to
    ``parallelize`` as the JSON text the command line writes."""

    search: str
    fraction: float | None = None
    via_json: bool = False


def random_strategies(captured: Any, mesh: Any, seed: int) -> dict[str, Any]:
    """A random valid strategy for every op that has an iteration space."""
    rng = random.Random(seed)
    info = mesh_info(mesh)
    out = {}
    for node in captured[True].graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        rule = rule_for(node)
        if isinstance(rule, SpaceRule):
            choices = rule.enumerate(node, info)
            if choices:
                out[node.name] = rng.choice(choices)
    return out


# -- the check, inside ranks -----------------------------------------------------------------------


def train_and_compare(
    name: str,
    mesh: Any,
    strategies: Any,
    dtype: torch.dtype,
    tolerance: dict | None = None,
    reference: str = ONE_DEVICE,
) -> None:
    dropout = 0.1 if reference == ONE_DEVICE else 0.0
    model, config = build(name, dropout)
    model = model.to(dtype)
    data = batches(config, dtype)
    captured = captured_of((name, dtype, dropout), model, data[0])
    if isinstance(strategies, RandomStrategies):
        strategies = random_strategies(captured, mesh, strategies.seed)
    if reference == PYTORCH:
        ref = copy.deepcopy(model)
    else:
        ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    if isinstance(strategies, Searched):
        pm = _searched(model, data, mesh, strategies, captured)
    else:
        pm = parallelize(model, data[0], mesh, strategies, captured=captured)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    tol = tolerance or {}
    for step, batch in enumerate(data):
        loss_ref = ref(*batch)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(
            loss, loss_ref, **tol, msg=lambda m, s=step: f"{name} {mesh} step {s}: {m}"
        )
    full = pm.full_state_dict()
    full_ref = ref.state_dict() if reference == PYTORCH else ref.full_state_dict()
    assert full.keys() == full_ref.keys()
    for k in full_ref:
        torch.testing.assert_close(full[k], full_ref[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
    # Loading a single-device state dict shards it back: the gathered values round-trip.
    pm.load_full_state_dict({k: v + 1 for k, v in full_ref.items()})
    for k, v in pm.full_state_dict().items():
        torch.testing.assert_close(v, full_ref[k] + 1, **tol)
    pm.load_full_state_dict(full_ref)
    pm.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(*shard_inputs(data[0], pm)), ref(*data[0]), **tol)


def _searched(model: Any, data: list, mesh: Any, how: Searched, captured: dict) -> Any:
    import json

    import autoshard

    limit = zero = None
    if how.fraction is not None:
        # without ZeRO, so that the memory limit is met by splitting weights
        zero = 0
        free = autoshard.plan(
            model, data[0], "dgx-h100", num_devices=mesh, captured=captured, zero=zero
        )
        limit = how.fraction * free.predicted.peak_memory
    if how.via_json:
        found = autoshard.plan(
            model, data[0], "dgx-h100", num_devices=mesh, captured=captured, memory_limit=limit,
            zero=zero,
        )  # fmt: skip
        text = json.dumps(found.json)
        pm = parallelize(model, data[0], None, plan=json.loads(text), captured=captured)
    else:
        pm = parallelize(
            model,
            data[0],
            mesh,
            captured=captured,
            search=how.search,
            cluster="dgx-h100",
            memory_limit=limit,
            zero=zero,
        )
    split = [
        f
        for f, p in pm.plan.params.items()
        if p.layout.num_devices > 1 and any(a >= 0 for f_ in p.layout.factors for _, a in f_)
    ]
    if how.fraction is not None and how.fraction < 0.5:
        assert split, f"a plan limited to {how.fraction} of the memory splits some weights"
    return pm


def run_cases(cases: list[tuple]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name, mesh, strategies, dtype, tol, *reference in cases:
        train_and_compare(name, mesh, strategies, dtype, tol, *reference)


MODELS = ["mlp", "gpt", "llama"]
# float32: summation order moves values by ~1e-6 relative; AdamW divides by sqrt(v), which turns
# that noise on gradients whose exact value is 0 (the key bias under softmax) into steps of up
# to lr, so parameters are compared at 2e-4 absolute.
F32_TOL = {"rtol": 1e-3, "atol": 2e-4}


def cases_world2() -> list[tuple]:
    out = []
    for name in MODELS:
        out.append((name, {"dp": 2}, None, torch.float64, None))
        out.append((name, {"tp": 2}, megatron(name), torch.float64, None))
        out.append((name, (2,), RandomStrategies(7), torch.float64, None))
    out.append(("gpt", {"tp": 2}, megatron("gpt"), torch.float32, F32_TOL))
    out.append(("gpt", {"tp": 2}, sequence_parallel(), torch.float64, None))
    conv_out = {"conv1": ((1, 1, 1, 1), (2, 1, 1, 1))}  # output channels (bn follows them)
    conv_in = {"conv2": ((1, 2, 1, 1), (1, 2, 1, 1))}  # input channels: a partial sum
    out.append(("cnn", {"dp": 2}, None, torch.float64, None))  # bn gathers the batch
    # mean squared error over a split batch, and over the splits random strategies draw
    out.append(("regression", {"dp": 2}, None, torch.float64, None))
    out.append(("regression", (2,), RandomStrategies(3), torch.float64, None))
    out.append(("cnn", {"tp": 2}, conv_out | conv_in, torch.float64, None))
    # plain PyTorch as the reference: data, Megatron tensor and sequence parallel (with dropout
    # off there is no dropout op to give a sequence split)
    sequence = {k: v for k, v in sequence_parallel().items() if "dropout" not in k}
    out.append(("gpt", {"dp": 2}, None, torch.float64, None, PYTORCH))
    out.append(("llama", {"tp": 2}, megatron("llama"), torch.float64, None, PYTORCH))
    out.append(("gpt", {"tp": 2}, sequence, torch.float64, None, PYTORCH))
    out.append(("gpt", {"tp": 2}, attention_rows(), torch.float64, None, PYTORCH))
    return out


def cases_world4() -> list[tuple]:
    out = []
    for name in MODELS:
        # (pure data parallel on 4 ranks: test_buckets_train_as_one_device)
        out.append((name, {"tp": 4}, megatron(name), torch.float64, None))
        out.append((name, {"dp": 2, "tp": 2}, megatron(name), torch.float64, None))
        out.append((name, (4,), mixed(name, 2, 2), torch.float64, None))
        out.append((name, {"dp": 2, "tp": 2}, RandomStrategies(1), torch.float64, None))
        out.append((name, {"dp": 2, "tp": 2}, megatron(name), torch.float32, F32_TOL))
        # plans found by the search (docs/search.md), with memory tight enough to split weights
        # (the tiny models' activations are a large share of their memory: a tighter limit than
        # these cannot fit)
        fraction = {"mlp": 0.3, "gpt": 0.45, "llama": 0.48}[name]
        out.append(
            (name, 4, Searched("optimal", fraction, via_json=name == "llama"), torch.float64, None)
        )
    out.append(("gpt", 4, Searched("recursive", 0.5), torch.float64, None))
    # a searched plan that splits weights, passed as JSON, against plain PyTorch
    out.append(("gpt", 4, Searched("optimal", 0.45, via_json=True), torch.float64, None, PYTORCH))
    out.append(("mlp", 4, Searched("propagate"), torch.float64, None))
    return out


def test_equivalence_on_2_ranks(on_2_ranks: list[dict]) -> None:
    assert all("equivalence" in outcome for outcome in on_2_ranks)  # each case asserts on the ranks


def test_equivalence_on_4_ranks(on_4_ranks: list[dict]) -> None:
    assert all("equivalence" in outcome for outcome in on_4_ranks)


# -- communication volume and parameter bytes ------------------------------------------------------


def _megatron_layer_volume() -> None:
    from autoshard import comm
    from autoshard.models.gpt import Block

    torch.set_num_threads(1)
    config = GPTConfig(hidden=32, num_heads=4, dropout=0.0)
    torch.manual_seed(0)
    block = Block(config).to(torch.float64)
    b, s, h = 2, 8, config.hidden
    x = torch.randn(b, s, h, dtype=torch.float64)
    target = torch.randn(b, s, h, dtype=torch.float64)
    strategies = {k: v for k, v in megatron("gpt").items() if k.startswith("layers.*")}
    strategies = {k.removeprefix("layers.*."): v for k, v in strategies.items()}
    pm = parallelize(block, (x, target), {"tp": 2}, strategies, loss_fn=lambda y, t: (y * t).sum())
    with comm.counting() as counted:
        pm(x, target).backward()
    activation = b * s * h * 8
    # Two all-reduces of b*s*h forward (after each row-split linear) and two backward (the
    # gradients of the replicated inputs of the column-split linears); a ring all-reduce on 2
    # ranks sends the tensor's size.
    assert counted == {"all_reduce": {"calls": 4, "bytes": 4 * activation}}, counted
    predicted = sum(n.forward_bytes() + n.backward_bytes() for n in pm.plan.nodes.values())
    assert predicted == 4 * activation
    full = dict(block.named_parameters())
    for fqn, local in pm.local_tensors().items():
        ratio = full[fqn].numel() / local.numel()
        expect = 2 if fqn.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight")) else 1
        if fqn.endswith(("c_attn.bias", "c_fc.bias")):
            expect = 2
        assert ratio == expect, (fqn, ratio)
    # The sharded state dict holds DTensors whose global values are the single-device ones.
    full_sd = pm.full_state_dict()
    for name, value in pm.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), full_sd[name])
    # Sequence parallel (dropout 0: no dropout op to name): forward all-gathers the sequence
    # before each column-split linear and reduce-scatters each row-split output into its add;
    # backward runs their transposes (the all-gather's: a reduce-scatter of the column-split
    # linear's partial gradient, Megatron's, not an all-reduce then a slice) and sums the
    # norms' gradients. The column-split linears keep only their input's sequence part: each
    # backward gathers it again (Megatron's) before its weight gradient. Activations move
    # plain tensor parallelism's bytes and those gathers; the plan predicts them all.
    from autoshard.cost.collectives import regathered
    from autoshard.redistribution import redistribution_plan

    sp = {k.removeprefix("layers.*"): v for k, v in sequence_parallel().items() if "*" in k}
    sp = {k.removeprefix("."): v for k, v in sp.items() if "dropout" not in k}
    pm = parallelize(block, (x, target), {"tp": 2}, sp, loss_fn=lambda y, t: (y * t).sum())
    with comm.recording() as forward:
        loss = pm(x, target)
    with comm.recording() as backward:
        loss.backward()
    half, norms = activation // 2, 4 * h * 8  # ln_1 and ln_2, weight and bias
    gather, scatter = ("all_gather", 2, half), ("reduce_scatter", 2, half)
    assert forward == [gather, scatter] * 2 + [("all_reduce", 2, 8)], forward  # 8: the loss
    # per sublayer: the row-split output's gradient gathered, the input gathered again, the
    # input's gradient reduce-scattered
    assert backward == [gather, gather, scatter] * 2 + [("all_reduce", 2, norms)], backward
    moved = sum(n for kind, _, n in forward + backward if kind != "all_reduce")
    assert moved == 4 * activation + 2 * half
    graph, nodes = pm.plan.graph, [n for n in pm.plan.graph.graph.nodes if n.name in pm.plan.nodes]
    again = sum(
        redistribution_plan(*move).bytes
        for n in nodes
        for move in regathered(n, pm.plan.nodes[n.name])
    )
    predicted = 0
    for n in nodes:  # the block's input needs no gradient: its moves have no backward
        no_grad = [i for i, a in enumerate(tensor_inputs(n)) if not graph[a].requires_grad]
        node_plan = pm.plan.nodes[n.name]
        predicted += node_plan.forward_bytes() + node_plan.backward_bytes(no_grad)
    assert predicted + again == moved, (predicted, again, moved)


def _llama_block_inputs_summed_once() -> dict:
    """Llama's layers split Megatron's way (embedding and output whole): the input of the
    column-split q, k and v (and of w1 and w3) gets one gradient sum, not one per reader."""
    from autoshard import comm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("llama", 0.0)
    model = model.double()
    data = batches(config, torch.float64)
    layers = {k: v for k, v in megatron("llama").items() if k.startswith("layers.*")}
    captured = captured_of(("llama", torch.float64, 0.0), model, data[0])
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(model, data[0], {"tp": 2}, layers, captured=captured)
    with comm.counting() as forward:
        loss = pm(*shard_inputs(data[0], pm))
    with comm.counting() as backward:
        loss.backward()
    ref(*data[0]).backward()
    grads = {fqn: t.grad for fqn, t in pm.local_tensors().items() if t.grad is not None}
    for fqn, t in ref.local_tensors().items():
        if t.grad is not None:
            layout = pm.layout_of(fqn)
            got = gather_tensor(grads[fqn], layout) if layout.num_devices > 1 else grads[fqn]
            torch.testing.assert_close(got, t.grad, msg=lambda m, f=fqn: f"{f}: {m}")
    return {
        "forward": forward["all_reduce"]["calls"],
        "backward": backward["all_reduce"]["calls"],
        "layers": config.num_layers,
        "shared": len(pm.plan.shared_reduce),
    }


def test_megatron_llama_sums_each_block_input_gradient_once(on_2_ranks: list[dict]) -> None:
    for outcome in (r["block_inputs"] for r in on_2_ranks):
        # per layer: after wo and after w2 forward; the inputs of q/k/v and of w1/w3 backward
        assert outcome["forward"] == 2 * outcome["layers"], outcome
        assert outcome["backward"] == 2 * outcome["layers"], outcome
        assert outcome["shared"] == 2 * outcome["layers"], outcome


def _different_plans() -> None:
    warnings.filterwarnings("ignore")
    model, config = build("mlp", 0.0)
    data = batches(config, torch.float64)
    strategies = {"head": ((1, 1), (2, 1))} if dist.get_rank() == 1 else None
    model = model.double()
    captured = captured_of(("mlp", torch.float64, 0.0), model, data[0])
    with pytest.raises(PlanMismatchError, match="rank 0 and rank 1|rank 1 and rank 0"):
        parallelize(model, data[0], 2, strategies, captured=captured)


def test_megatron_layer_moves_the_analytic_volume(on_2_ranks: list[dict]) -> None:
    assert all("volume" in outcome for outcome in on_2_ranks)  # it asserts on the ranks


def test_ranks_with_different_plans_fail_before_training(on_2_ranks: list[dict]) -> None:
    assert all("different_plans" in outcome for outcome in on_2_ranks)


# -- coalesced gradient sums -----------------------------------------------------------------------


def _coalesced_gradients() -> None:
    from autoshard import comm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("mlp", 0.0)
    model = model.double()
    data = batches(config, torch.float64)
    captured = captured_of(("mlp", torch.float64, 0.0), model, data[0])
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(model, data[0], {"dp": 2}, None, captured=captured)
    names = [n for n, _ in ref.named_parameters()]
    # One flat all-reduce for every data-parallel gradient of the backward.
    loss = pm(*shard_inputs(data[0], pm))
    with comm.counting() as counted:
        loss.backward()
    grad_bytes = sum(p.numel() * 8 for p in pm.parameters())  # a 2-rank all-reduce sends its size
    assert counted == {"all_reduce": {"calls": 1, "bytes": grad_bytes}}, counted
    pm.zero_grad()
    # Accumulation over micro-batches sums each backward's contribution once.
    for batch in data[:2]:
        ref(*batch).backward()
        pm(*shard_inputs(batch, pm)).backward()
    for name, p_ref, p in zip(names, ref.parameters(), pm.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m, n=name: f"{n}: {m}")
    # torch.autograd.grad returns the sums too, and leaves .grad alone.
    before = [p.grad.clone() for p in pm.parameters()]
    grads = torch.autograd.grad(pm(*shard_inputs(data[2], pm)), list(pm.parameters()))
    grads_ref = torch.autograd.grad(ref(*data[2]), list(ref.parameters()))
    for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, msg=lambda m, n=name: f"{n}: {m}")
    for p, b in zip(pm.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, b)
    # A backward that raises part way leaves nothing behind for the next one.
    first = next(iter(pm.parameters()))
    handle = first.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        pm(*shard_inputs(data[3], pm)).backward()
    handle.remove()
    pm.zero_grad()
    ref.zero_grad()
    ref(*data[4]).backward()
    pm(*shard_inputs(data[4], pm)).backward()
    for name, p_ref, p in zip(names, ref.parameters(), pm.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_gradient_sums_are_coalesced_and_accumulate(on_2_ranks: list[dict]) -> None:
    assert all("coalesced" in outcome for outcome in on_2_ranks)  # it asserts on the ranks


# -- replicas start equal --------------------------------------------------------------------------


def _perturbed_start(replicas: str) -> dict:
    """Every rank builds the model from seed 0, rank 3 then perturbs its copy."""
    import torch.distributed as dist

    from autoshard.runtime.program.replicas import ReplicaMismatchError

    outcome = {}
    if replicas == "broadcast":  # first, before any group exists:
        # replica groups along both axes, (0,1),(2,3) and (0,2),(1,3)
        torch.manual_seed(0)
        two = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        given = {"0": ((None, None), ("dp", None)), "1": ((None, None), ("tp", None))}
        x, y = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(2))
        pm = parallelize(two, (x, y), {"dp": 2, "tp": 2}, given, torch.nn.functional.mse_loss)
        full = pm.full_state_dict()
        outcome["both axes"] = all(torch.equal(full[k], v) for k, v in two.state_dict().items())
    model, config = build("mlp", 0.0)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    if dist.get_rank() == 3:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    batch = config.example_batch(BATCH, torch.Generator().manual_seed(1))
    captured = captured_of(("mlp", torch.float32, 0.0), model, batch)
    try:
        pm = parallelize(
            model, batch, {"dp": 2, "tp": 2}, megatron("mlp"), replicas=replicas, captured=captured
        )
    except ReplicaMismatchError as err:
        return {"error": str(err)}
    full = pm.full_state_dict()
    outcome["equal"] = all(torch.equal(full[k], reference[k]) for k in reference)
    return outcome


def _perturbed_starts(modes: list[str]) -> list[dict]:
    """Each replicas mode in turn on the same ranks (one spawn)."""
    return [_perturbed_start(mode) for mode in modes]


REPLICAS_MODES = ["broadcast", "check", "none"]


def test_replicas_start_equal_or_the_rank_that_differs_is_named(on_4_ranks: list[dict]) -> None:
    outcomes = [r["replicas"] for r in on_4_ranks]
    broadcast, check, none = ([r[k] for r in outcomes] for k in range(3))
    for outcome in broadcast:
        assert outcome == {"equal": True, "both axes": True}  # rank 3's copy replaced
    assert check[0] == check[1] == check[2] == check[3]  # one decision everywhere
    assert "rank 3 holds other values of" in check[0]["error"]
    assert none[3] == {"equal": False}  # rank 3 keeps its perturbed copy


def test_an_unknown_replicas_mode_is_an_error() -> None:
    from autoshard.runtime.program.replicas import sync_replicas

    with pytest.raises(ValueError, match="replicas='bogus': expected one of broadcast, check"):
        sync_replicas({}, {}, 0, "bogus")


# -- clipping and non-finite gradients -------------------------------------------------------------


def _gpt_against_one_device(mesh: Any, strategies: Any) -> tuple:
    """GPT in float64 on ``mesh`` and on one device, each with its AdamW, and the batches."""
    model, config = build("gpt", 0.0)
    model = model.to(torch.float64)
    data = batches(config, torch.float64)
    captured = captured_of(("gpt", torch.float64, 0.0), model, data[0])
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(model, data[0], mesh, strategies, captured=captured)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    return data, ref, pm, opt_ref, torch.optim.AdamW(pm.parameters(), lr=1e-2)


def _clipped_training(mesh: Any, strategies: Any, inject: bool) -> dict:
    """GPT (tied embeddings) in float64: 3 steps clipped to a norm it exceeds, against
    torch.nn.utils.clip_grad_norm_ on one device and on the plain eager model (stepped by its
    own AdamW); then an inf on rank 1's gradient."""
    import torch.distributed as dist

    from autoshard import NonFiniteGradientError, clip_grad_norm_

    data, ref, pm, opt_ref, opt = _gpt_against_one_device(mesh, strategies)
    eager, _ = build("gpt", 0.0)  # the same seed: the values pm started from
    eager = eager.to(torch.float64)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    data = data[:3]
    norms, losses = [], []
    for batch in data:
        ref(*batch).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        loss_eager = eager(*batch)
        loss_eager.backward()
        eager_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05)
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        got = clip_grad_norm_(pm, 0.05)
        norms.append((float(got), float(expected)))
        norms.append((float(got), float(eager_norm)))
        losses.append((float(loss), float(loss_eager)))
        for o in (opt_ref, opt, opt_eager):
            o.step(), o.zero_grad()
    full, full_ref = pm.full_state_dict(), ref.full_state_dict()
    assert full.keys() == eager.state_dict().keys()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(full[k], v, msg=lambda m, k=k: f"eager {k}: {m}")
    for k in full_ref:
        torch.testing.assert_close(full[k], full_ref[k], msg=lambda m, k=k: f"{k}: {m}")
    before = pm.full_state_dict()
    pm(*shard_inputs(data[0], pm)).backward()
    if dist.get_rank() == 1:
        next(p for p in pm.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    if inject:
        try:
            clip_grad_norm_(pm, 0.05, error_if_nonfinite=True)
        except NonFiniteGradientError as err:
            return {"norms": norms, "losses": losses, "error": str(err)}
        return {"norms": norms, "losses": losses, "error": None}
    norm = clip_grad_norm_(pm, 0.05)
    skipped = not torch.isfinite(norm)
    if not skipped:
        opt.step()
    opt.zero_grad()
    after = pm.full_state_dict()
    unchanged = all(torch.equal(after[k], before[k]) for k in before)
    pm(*shard_inputs(data[1], pm)).backward()
    if dist.get_rank() == 1:  # a rank without gradients joins the norm's sums all the same
        opt.zero_grad()
    alone = float(clip_grad_norm_(pm, 0.05))
    out = {"norms": norms, "losses": losses, "skipped": skipped, "unchanged": unchanged}
    return {**out, "alone": alone}


def _clipped_meshes(cases: list[tuple]) -> list[dict]:
    """``_clipped_training`` of each (mesh, strategies, inject) in turn (one spawn)."""
    return [_clipped_training(*case) for case in cases]


def _clip_cases() -> list[tuple]:
    meshes = [({"dp": 4}, None), ({"tp": 4}, "tp"), ({"dp": 2, "tp": 2}, "tp")]
    return [
        (mesh, megatron("gpt", tp) if tp else None, inject)
        for mesh, tp in meshes
        for inject in (False, True)
    ]


def test_clipping_equals_one_device_and_a_nonfinite_gradient_skips_everywhere(
    on_4_ranks: list[dict],
) -> None:
    cases = _clip_cases()
    outcomes = [r["clipping"] for r in on_4_ranks]
    for k, (mesh, _, inject) in enumerate(cases):
        got = [r[k] for r in outcomes]
        if inject:
            assert all(r["error"] == got[0]["error"] for r in got), mesh
            assert got[0]["error"].startswith("non-finite gradient on rank 1: "), mesh
            continue
        for outcome in got:
            # norms against one device's and against the plain eager model's
            for norm, expected in outcome["norms"]:
                assert norm == pytest.approx(expected, rel=1e-9), mesh
                assert expected > 0.05  # the clipping was active
            for loss, expected in outcome["losses"]:  # and each step's loss against the eager
                assert loss == pytest.approx(expected, rel=1e-9), mesh
            assert outcome["skipped"] and outcome["unchanged"], mesh
        assert all(r["alone"] == got[0]["alone"] > 0 for r in got), mesh


# -- gradient accumulation with no_sync ------------------------------------------------------------


def _accumulate_with_no_sync(mesh: Any, strategies: Any) -> list[int]:
    """GPT in float64, 3 optimizer steps of 4 micro-batches, the first 3 under no_sync, against
    one device accumulating the same micro-batches; returns the number of all-reduces each
    micro-batch's backward made."""

    data, ref, pm, opt_ref, opt = _gpt_against_one_device(mesh, strategies)
    calls = []
    for step in range(3):
        micro = [data[(step + j) % len(data)] for j in range(4)]
        for i, batch in enumerate(micro):
            (ref(*batch) / len(micro)).backward()
            loss = pm(*shard_inputs(batch, pm)) / len(micro)
            calls.append(_micro_backward(pm, loss, last=i == len(micro) - 1))
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    _assert_same_state(pm, ref)
    return calls


def _micro_backward(pm: Any, loss: torch.Tensor, last: bool) -> int:
    """A micro-batch's backward, under no_sync unless it is the last; its all-reduces."""
    from autoshard import comm

    with comm.counting() as counted:
        if last:
            loss.backward()
        else:
            with pm.no_sync():
                loss.backward()
    return counted.get("all_reduce", {}).get("calls", 0)


def _assert_same_state(pm: Any, ref: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``pm`` equals one device's; the full state."""
    full, full_ref = pm.full_state_dict(), ref.full_state_dict()
    for k in full_ref:
        torch.testing.assert_close(full[k], full_ref[k], msg=lambda m, k=k: f"{k}: {m}")
    return full


@pytest.mark.parametrize(
    "mesh, tp", [({"dp": 2}, None), ({"dp": 2, "tp": 2}, "tp")], ids=["dp", "dp x tp"]
)
def test_no_sync_accumulates_and_sums_once_per_step(mesh: Any, tp: Any, request) -> None:
    # dp x tp: the batch split over dp and the weights over tp, so weights need dp sums
    spawned = request.getfixturevalue("on_4_ranks" if tp else "on_2_ranks")
    for calls in (r["no_sync"] for r in spawned):
        skipped = [c for i, c in enumerate(calls) if i % 4 != 3]
        synced = [c for i, c in enumerate(calls) if i % 4 == 3]
        # the synced backward makes at least the bucket's all-reduce more than the others
        assert all(s > max(skipped) for s in synced), calls
        assert len(set(skipped)) == 1 and len(set(synced)) == 1, calls


# -- gradient buckets that overlap backward --------------------------------------------------------

#: small enough that the reference models' gradients fill several buckets
SMALL_BUCKET_MB = 0.02


class WithUnused(nn.Module):
    """A model with a parameter its forward never reads (a frozen head, an unused expert)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.unused = nn.Linear(4, 4)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args)


def _bucketed_training(name: str, mesh: Any, strategies: Any, micro: int) -> list[int]:
    """``name`` with an unused parameter, in float64 with dropout, on ``mesh`` in small buckets
    against one device: 5 AdamW steps of ``micro`` micro-batches (all but the last under
    no_sync); returns the all-reduces of each step's syncing backward."""

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    inner, config = build(name, 0.1)
    model = WithUnused(inner).to(torch.float64)
    data = batches(config, torch.float64)
    captured = captured_of((f"{name} with an unused parameter", torch.float64, 0.1), model, data[0])
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(
        model, data[0], mesh, strategies, captured=captured, bucket_cap_mb=SMALL_BUCKET_MB
    )
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    calls = []
    for step in range(STEPS):
        for i in range(micro):
            batch = data[(step + i) % len(data)]
            loss_ref = ref(*batch) / micro
            loss_ref.backward()
            loss = pm(*shard_inputs(batch, pm)) / micro
            torch.testing.assert_close(loss, loss_ref, msg=lambda m, s=step: f"step {s}: {m}")
            synced = _micro_backward(pm, loss, last=i == micro - 1)
        calls.append(synced)
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    full = _assert_same_state(pm, ref)
    assert torch.equal(full["unused.weight"], model.unused.weight)  # no gradient, no step
    return calls


def _bucket_cases(cases: list[tuple]) -> list[list[int]]:
    return [_bucketed_training(*case) for case in cases]


#: the bucket cases by the ranks they run on: (model, mesh, strategies, micro-batches)
BUCKET_CASES = {
    2: [("gpt", {"dp": 2}, None, 1), ("llama", {"dp": 2}, None, 2)],
    4: [
        ("gpt", {"dp": 4}, None, 1),
        ("llama", {"dp": 4}, None, 1),
        ("gpt", {"dp": 2, "tp": 2}, "mixed", 1),
        ("llama", {"dp": 2, "tp": 2}, "megatron", 1),
        ("gpt", {"dp": 2, "tp": 2}, "mixed", 3),
    ],
}


def _bucket_given(cases: list[tuple]) -> list[tuple]:
    chosen = {"mixed": mixed, "megatron": lambda name, *_: megatron(name)}
    return [
        (name, mesh, how and {f"inner.{k}": v for k, v in chosen[how](name, 2, 2).items()}, k)
        for name, mesh, how, k in cases
    ]


@pytest.mark.parametrize("world", [2, 4], ids=["2 ranks", "4 ranks"])
def test_buckets_train_as_one_device(world: int, request) -> None:
    """dp and dp x tp, tied embeddings (GPT) and an unused parameter, with gradient
    accumulation under no_sync, each against one device."""
    cases = BUCKET_CASES[world]
    for per_rank in (r["buckets"] for r in request.getfixturevalue(f"on_{world}_ranks")):
        for case, calls in zip(cases, per_rank, strict=True):
            assert len(set(calls)) == 1 and calls[0] >= 2, (case, calls)  # several buckets


def _bucket_starts_during_backward() -> dict:
    """The event order of one backward: each parameter's gradient as autograd completes it,
    and the collectives as the counting layer issues them."""
    from autoshard import comm

    torch.set_num_threads(1)
    model, config = build("gpt", 0.0)
    data = batches(config, torch.float32)
    pm = parallelize(model, data[0], {"dp": 2}, bucket_cap_mb=SMALL_BUCKET_MB)
    loss = pm(*shard_inputs(data[0], pm))
    with comm.recording() as events:
        for name, p in pm.named_parameters():
            p.register_hook(lambda g, name=name: events.append(("gradient", name)))
        loss.backward()
    # the cost model prices the buckets the runtime made (one source of truth)
    cluster = cluster_spec("cpu", 2)
    predicted = estimate(pm.plan, pm._captured[True], cluster, bucket_cap_mb=SMALL_BUCKET_MB)
    return {
        "events": [e[:2] for e in events],
        "sent": [e[2] for e in events if e[0] != "gradient"],
        "predicted": [(o.seconds, o.ready, o.due) for o in predicted.overlapped],
        "latency": cluster.link(False)[1],
        "bandwidth": cluster.link(False)[0],
    }


def test_a_bucket_sum_starts_before_backward_ends(on_2_ranks: list[dict]) -> None:
    for outcome in (r["bucket_starts"] for r in on_2_ranks):
        events = outcome["events"]
        kinds = [e[0] for e in events]
        first_sum = kinds.index("all_reduce")
        last_gradient = len(kinds) - 1 - kinds[::-1].index("gradient")
        assert first_sum < last_gradient, events  # overlapped with the rest of backward
        assert kinds.count("all_reduce") >= 3, events
        # every bucket's sum priced: its bytes on the link and one latency (2 steps of a
        # 2-rank tree), ready in the order backward fills them, due when backward ends
        predicted, sent = outcome["predicted"], list(outcome["sent"])
        for seconds, _, _ in predicted:
            nbytes = (seconds - 2 * outcome["latency"]) * outcome["bandwidth"]
            assert round(nbytes) in sent, (nbytes, sent)
            sent.remove(round(nbytes))
        assert not sent  # the position embedding's gradient too: in a bucket, not in line
        readies = [r for _, r, _ in predicted]
        assert readies == sorted(readies) and readies[-1] <= predicted[0][2] * (1 + 1e-12)


def test_a_bucket_must_hold_bytes() -> None:
    from autoshard.runtime import GradSync

    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        GradSync(0, bucket_cap_mb=0)


def _gradients_of_some_parameters() -> None:
    """torch.autograd.grad for every other parameter: the buckets holding the others are
    summed when backward ends (the sum is elementwise, so their unfilled slots reach nothing)
    and no .grad changes. After backwards under no_sync, torch.autograd.grad cannot sum the
    accumulated .grad and says so."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("gpt", 0.0)
    model = model.double()
    data = batches(config, torch.float64)
    captured = captured_of(("gpt", torch.float64, 0.0), model, data[0])
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(model, data[0], {"dp": 2}, bucket_cap_mb=SMALL_BUCKET_MB, captured=captured)
    names = [n for n, _ in pm.named_parameters()][::2]
    params, params_ref = list(pm.parameters())[::2], list(ref.parameters())[::2]
    for batch in data[:2]:
        grads = torch.autograd.grad(pm(*shard_inputs(batch, pm)), params)
        grads_ref = torch.autograd.grad(ref(*batch), params_ref)
        for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
            torch.testing.assert_close(g, g_ref, msg=lambda m, n=name: f"{n}: {m}")
    assert all(p.grad is None for p in pm.parameters())
    with pm.no_sync():
        pm(*shard_inputs(data[2], pm)).backward()
    with pytest.raises(ValueError, match="torch.autograd.grad after backwards under no_sync"):
        torch.autograd.grad(pm(*shard_inputs(data[3], pm)), list(pm.parameters()))


def test_gradients_of_some_parameters_through_buckets(on_2_ranks: list[dict]) -> None:
    assert all("some_parameters" in outcome for outcome in on_2_ranks)  # it asserts on the ranks


def _bucket_buffers_across_steps() -> dict:
    """Three dp steps of the MLP: the bucket's buffer again once its gradients are dropped; a
    gradient the caller still holds is never written by a later backward."""
    torch.set_num_threads(1)
    model, config = build("mlp", 0.0)
    data = batches(config, torch.float64)
    model = model.double()
    captured = captured_of(("mlp", torch.float64, 0.0), model, data[0])
    pm = parallelize(model, data[0], {"dp": 2}, captured=captured)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    first = next(pm.parameters())
    ptrs, kept = [], None
    for step, batch in enumerate(data[:4]):
        pm(*shard_inputs(batch, pm)).backward()
        ptrs.append(first.grad.data_ptr())
        if step == 2:
            kept, value = first.grad, first.grad.clone()  # held across the next backward
        opt.step()
        opt.zero_grad()
    return {"ptrs": ptrs, "kept_unchanged": bool(torch.equal(kept, value))}


def test_a_bucket_keeps_its_buffer_unless_a_gradient_is_still_held(on_2_ranks: list[dict]) -> None:
    for outcome in (r["bucket_buffers"] for r in on_2_ranks):
        ptrs = outcome["ptrs"]
        assert ptrs[0] == ptrs[1] == ptrs[2], ptrs  # dropped by zero_grad: the same buffer
        assert ptrs[3] != ptrs[2], ptrs  # step 2's gradient still held: a new buffer
        assert outcome["kept_unchanged"]


# -- one spawn for each count of ranks ------------------------------------------------------------


def _checks_on(world: int) -> dict[str, tuple]:
    """This module's checks on ``world`` ranks, each a function and its arguments: one spawn
    runs them all in turn, since spawning and a new process's first capture dominate their
    time."""
    if world == 2:
        return {
            "equivalence": (run_cases, cases_world2()),
            "block_inputs": (_llama_block_inputs_summed_once,),
            "volume": (_megatron_layer_volume,),
            "different_plans": (_different_plans,),
            "coalesced": (_coalesced_gradients,),
            "no_sync": (_accumulate_with_no_sync, {"dp": 2}, None),
            "buckets": (_bucket_cases, _bucket_given(BUCKET_CASES[2])),
            "bucket_starts": (_bucket_starts_during_backward,),
            "some_parameters": (_gradients_of_some_parameters,),
            "bucket_buffers": (_bucket_buffers_across_steps,),
        }
    return {
        "equivalence": (run_cases, cases_world4()),
        "replicas": (_perturbed_starts, REPLICAS_MODES),
        "clipping": (_clipped_meshes, _clip_cases()),
        "no_sync": (_accumulate_with_no_sync, {"dp": 2, "tp": 2}, mixed("gpt", 2, 2)),
        "buckets": (_bucket_cases, _bucket_given(BUCKET_CASES[4])),
    }


def _run_checks(world: int) -> dict[str, Any]:
    return {name: fn(*args) for name, (fn, *args) in _checks_on(world).items()}


@pytest.fixture(scope="module")
def on_2_ranks() -> list[dict]:
    """Every rank's outcome of each check on 2 ranks, by name."""
    return run_ranks(_run_checks, 2, 2, timeout=1200)


@pytest.fixture(scope="module")
def on_4_ranks() -> list[dict]:
    """Every rank's outcome of each check on 4 ranks, by name."""
    return run_ranks(_run_checks, 4, 4, timeout=2400)
