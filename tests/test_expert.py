"""Expert parallelism equals plain PyTorch: autoshard's MoE reference model and transformers'
Mixtral (built from a config) with their experts spread over an ``ep`` axis, alone and with data,
tensor, ZeRO and pipeline parallelism, trained 5 AdamW steps in float64 beside the eager model
stepped by ``torch.optim``, every step's loss and every parameter compared; each rank holds 1/ep
of every expert weight and the all-to-all bytes it sends are its routed rows times hidden times
the dtype's size."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

import autoshard
from autoshard import comm, parallelize, shard_inputs
from autoshard.graph import ExpertsError, capture, capture_modes, mark_experts
from autoshard.mesh import mesh_info
from autoshard.models import build, reference_config
from autoshard.ops import rule_for
from autoshard.ops.experts import dispatch_group, experts_math
from autoshard.testing import run_ranks

STEPS, BATCH, SEQ, VOCAB, HIDDEN, EXPERTS, TOP_K = 5, 8, 8, 64, 32, 4, 2
COL = (("ep", None, None), ("tp", None))  # Megatron's attention, the batch over ep
ROW = (("ep", None, "tp"), (None, "tp"))
MEGATRON = {"layers.*.attention.w[qkv]": COL, "layers.*.attention.wo": ROW}
EXPERT_TP = {"layers.*.feed_forward.experts": {"space": ("ep", None, "ep", None, "tp")}}
SUMMED = {"layers.*.feed_forward.experts": {"space": ("ep", None, "tp", None, None)}}


def _moe(aux: float = 0.01, capacity: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = reference_config("moe", layers=2, hidden=HIDDEN, heads=4, kv_heads=2, ffn=16,
                              vocab=VOCAB, seq=SEQ, experts=EXPERTS, top_k=TOP_K,
                              aux_loss_coef=aux, capacity_factor=capacity)  # fmt: skip
    return build(config).to(torch.float64)


def _mixtral(implementation: str = "batched_mm", dtype: torch.dtype = torch.float64) -> Any:
    """transformers' Mixtral from a config, its router's balance loss in the loss."""
    import transformers
    from test_hf_gpt2 import CausalLMLoss

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=SEQ, output_router_logits=True,
        router_aux_loss_coef=0.01, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation(implementation)
    return CausalLMLoss(model).to(dtype)


def _batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )  # fmt: skip
        for _ in range(STEPS)
    ]


_CAPTURED: dict[str, Any] = {}


def _capture_of(key: str | None, model: torch.nn.Module) -> Any:
    """``model``'s capture, made once per rank process for the cases of the same model."""
    if key is None:
        return None
    if key not in _CAPTURED:
        _CAPTURED[key] = capture_modes(model, _batches()[0])
    return _CAPTURED[key]


def _against_pytorch(
    model: torch.nn.Module, mesh: Any, strategies: Any = None, rtol: float = 1.3e-6,
    atol: float = 1e-8, key: str | None = None, **options: Any,
) -> str:  # fmt: skip
    """Train ``model`` under autoshard and eagerly; '' when every loss and parameter agree
    and each rank holds 1/ep of every expert weight. ``key`` names the model for reusing
    its capture."""
    ref = copy.deepcopy(model)
    batches = _batches()
    captured = _capture_of(key, model)
    pm = parallelize(model, batches[0], mesh, strategies, captured=captured, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    name = f"{type(model).__name__} {mesh} {options}"
    for step, batch in enumerate(batches):
        loss = pm(*(batch if pm.whole_batch else shard_inputs(batch, pm)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = ref(*batch)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        if not torch.allclose(loss.detach(), want.detach(), rtol=rtol, atol=atol):
            return f"{name}: step {step} loss {float(loss)} != {float(want)}"
    full = pm.full_state_dict()
    for key, value in ref.state_dict().items():
        if not torch.allclose(full[key], value, rtol=rtol, atol=atol):
            return f"{name}: {key} differs by {float((full[key] - value).abs().max())}"
    ep = mesh_info(mesh).as_dict().get("ep", 1) if mesh is not None else 0
    for fqn, t in pm.local_tensors().items():
        if fqn.endswith(("gate_up_proj", "down_proj")) and ep and not options.get("zero"):
            if t.shape[0] != full[fqn].shape[0] // ep:
                return f"{name}: {fqn} holds {t.shape[0]} of {full[fqn].shape[0]} experts"
    return ""


def _routing(model: torch.nn.Module, batch: tuple) -> list[torch.Tensor]:
    """Each MoE layer's chosen experts ``[tokens, k]`` for ``batch`` (the eager model's)."""
    picked: list[torch.Tensor] = []

    def keep(module: Any, args: Any, out: torch.Tensor) -> None:
        picked.append(torch.topk(torch.softmax(out, -1), TOP_K, dim=-1).indices)

    hooks = [layer.feed_forward.router.register_forward_hook(keep) for layer in model.layers]
    with torch.no_grad():
        model(*batch)
    for hook in hooks:
        hook.remove()
    return picked


def _bytes_are_the_routed_rows() -> str:
    """Under ep 4 (one expert a rank) the all-to-all bytes of a step, forward and backward,
    are each layer's counts exchange plus, twice, the rows this rank's tokens send to other
    ranks' experts and the rows other ranks send to its expert, times hidden times 8."""
    model = _moe()
    batch = _batches()[0]
    pm = parallelize(copy.deepcopy(model), batch, {"ep": 4}, captured=_capture_of("moe", model))
    rank, size = torch.distributed.get_rank(), 4
    with comm.counting() as counted:
        pm(*shard_inputs(batch, pm)).backward()
    expected = 0
    tokens = BATCH * SEQ // size
    for index in _routing(model, batch):
        owner = index  # one expert a rank: expert e lives on rank e
        mine = owner[rank * tokens : (rank + 1) * tokens]
        out = int((mine != rank).sum())
        into = int((owner == rank).sum()) - int((mine == rank).sum())
        expected += (size - 1) * 8 + 2 * (out + into) * HIDDEN * 8
    sent = counted.get("all_to_all", {}).get("bytes", 0)
    return "" if sent == expected else f"all-to-all sent {sent} bytes, routed rows make {expected}"


def _saved_under_ep4_loads_under_ep2(path: str) -> str:
    """2 steps under ep 4, saved; loaded under dp 2 x ep 2 into other values, the next 3 steps
    equal plain PyTorch's steps 3 to 5."""
    model, batches = _moe(), _batches()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for batch in batches:
        loss = ref(*batch)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        want.append(float(loss))
    pm = parallelize(model, batches[0], {"ep": 4}, captured=_capture_of("moe", model))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for batch in batches[:2]:
        pm(*shard_inputs(batch, pm)).backward()
        opt.step()
        opt.zero_grad()
    autoshard.save(path, pm, opt, step=2)
    other = _moe()
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    two = parallelize(other, batches[0], {"dp": 2, "ep": 2}, captured=_capture_of("moe", other))
    opt_two = torch.optim.AdamW(two.parameters(), lr=1e-2)
    autoshard.load(path, two, opt_two)
    for step, batch in enumerate(batches[2:], start=2):
        loss = two(*shard_inputs(batch, two))
        loss.backward()
        opt_two.step()
        opt_two.zero_grad()
        if abs(float(loss) - want[step]) > 1e-9:
            return f"after loading under ep 2, step {step} loss {float(loss)} != {want[step]}"
    full = two.full_state_dict()
    bad = [k for k, v in ref.state_dict().items() if not torch.allclose(full[k], v)]
    return f"after loading under ep 2: {bad[:3]} differ" if bad else ""


def _planned() -> dict:
    """``autoshard.plan`` for 4 cpu devices, the experts' split searched: its JSON."""
    plan = autoshard.plan(_moe(), _batches()[0], "cpu", num_devices=4)
    return json.loads(json.dumps(plan.json))


def _cases(path: str, planned: dict) -> list[str]:
    from test_copies import _megatron

    torch.set_num_threads(1)
    hf_megatron = _megatron(dp="ep", mlp=False)  # COL and ROW on transformers' attention
    out = [
        _against_pytorch(_moe(), {"ep": 4}, key="moe"),
        _against_pytorch(_moe(), {"dp": 2, "ep": 2}, zero=1, key="moe"),
        # expert tensor parallelism: each expert's ffn split over tp, its output a partial sum
        _against_pytorch(_moe(), {"ep": 2, "tp": 2}, MEGATRON | EXPERT_TP, key="moe"),
        # experts summed over tp (which keeps the tokens whole): each rank its experts' share
        _against_pytorch(_moe(), {"ep": 2, "tp": 2}, MEGATRON | SUMMED, key="moe"),
        # the same drop rule as one device: each expert's first C assignments of the batch
        _against_pytorch(_moe(capacity=1.0), {"dp": 2, "ep": 2}),
        _against_pytorch(_moe(aux=0.0), {"pp": 2, "ep": 2}, microbatches=2),
        _against_pytorch(_mixtral(), {"ep": 4}, key="mixtral"),
        _against_pytorch(_mixtral(), {"dp": 2, "ep": 2}, key="mixtral"),
        _against_pytorch(_mixtral(), {"ep": 2, "tp": 2}, hf_megatron, key="mixtral"),
        # transformers' default: torch's grouped matrix product, float32 within rounding
        _against_pytorch(_mixtral("grouped_mm", torch.float32), {"ep": 4}, rtol=1e-4, atol=1e-5),
        _bytes_are_the_routed_rows(),
        _saved_under_ep4_loads_under_ep2(path),
        _against_pytorch(_moe(), None, plan=planned, key="moe"),
    ]
    return [o for o in out if o]


def test_experts_spread_over_ep_train_as_pytorch(tmp_path) -> None:
    planned = _planned()
    for problems in run_ranks(_cases, 4, str(tmp_path / "ckpt"), planned, timeout=900):
        assert problems == []


# -- without ranks ------------------------------------------------------------------------------


def test_capacity_keeps_each_experts_first_assignments_of_the_batch() -> None:
    """With capacity factor 1, 4 experts, top 2 and 64 tokens, each expert takes 32 of the
    batch's 128 assignments, the first in (token, slot) order: the test batches drop some."""
    model = _moe(capacity=1.0)
    layer = model.layers[0].feed_forward
    g = torch.Generator().manual_seed(3)
    index = torch.randint(0, EXPERTS, (BATCH * SEQ, TOP_K), generator=g)
    kept = layer._kept(index, torch.arange(EXPERTS))
    for e in range(EXPERTS):
        hits = (index == e).reshape(-1)
        assert int((kept.reshape(-1) & hits).sum()) == min(32, int(hits.sum()))
        first = torch.nonzero(hits).reshape(-1)[:32]
        assert bool(kept.reshape(-1)[first].all())
    routed = _routing(_moe(), _batches()[0])
    assert any(int((r == e).sum()) > 32 for r in routed for e in range(EXPERTS))


def test_experts_are_captured_as_one_op_each() -> None:
    for model in (_moe(), _mixtral("eager")):  # transformers' eager loop too
        og = capture(model, _batches()[0])
        ops = [n for n in og.graph.nodes if n.target is torch.ops.autoshard.experts.default]
        assert len(ops) == 2


def test_the_experts_op_is_the_modules_math() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.randint(0, 3, (6, 2), generator=g)
    weight = torch.rand(6, 2, dtype=torch.float64, generator=g)
    gate_up = torch.randn(3, 10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    down = torch.randn(3, 8, 5, dtype=torch.float64, generator=g, requires_grad=True)
    want = experts_math(x, index, weight, gate_up, down, "silu")
    got = torch.ops.autoshard.experts(x, index, weight, gate_up, down, "silu")
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (x, gate_up, down))
    wanted = torch.autograd.grad(want.square().sum(), (x, gate_up, down))
    for a, b in zip(grads, wanted, strict=True):
        torch.testing.assert_close(a, b)
    # by hand: token 0 through its two experts
    row = sum(
        weight[0, j]
        * (
            torch.nn.functional.silu(x[0] @ gate_up[index[0, j], :5].T)
            * (x[0] @ gate_up[index[0, j], 5:].T)
        )
        @ down[index[0, j]].T
        for j in range(2)
    )
    torch.testing.assert_close(got[0], row)


def test_a_dispatching_strategy_exchanges_the_rows_it_routes() -> None:
    """The rule's exchanges are the all-to-alls the local form runs: counts, then the rows out
    and back in forward and again in backward, (g - 1) / g of each rank's assignments."""
    og = capture(_moe(), _batches()[0])
    node = next(n for n in og.graph.nodes if n.target is torch.ops.autoshard.experts.default)
    mesh = mesh_info({"dp": 2, "ep": 2})
    both = ("dp", "ep")
    strategy = rule_for(node).from_space(node, (both, None, both, None, None), mesh)
    assert dispatch_group(strategy, 1) == (0, 1, 2, 3)
    over_dp = rule_for(node).from_space(node, ("dp", None, "dp", None, None), mesh)
    assert dispatch_group(over_dp, 1) == (1, 3)  # ranks 1 and 3 hold other tokens
    spread = rule_for(node).from_space(node, (("dp", "ep"), None, "ep", None, None), mesh)
    assert dispatch_group(spread, 1) == (0, 1)
    assert spread.ins[3].local_shape()[0] == EXPERTS // 2
    exchanges = rule_for(node).exchanges(node, spread)
    rows = BATCH * SEQ // 4 * TOP_K / 2
    assert [e.bytes for e in exchanges[1:]] == [rows * HIDDEN * 8] * 4
    assert [e.backward for e in exchanges] == [False, False, False, True, True]
    assert exchanges[0].bytes == 1 * (EXPERTS // 2) * 8
    summed = rule_for(node).from_space(node, ("dp", None, "ep", None, None), mesh)
    assert dispatch_group(summed, 1) == (1,) and not rule_for(node).exchanges(node, summed)
    assert summed.outs[0].partial  # each rank's experts' share of every token
    tp = rule_for(node).from_space(node, ("dp", None, "dp", None, "ep"), mesh)
    assert tp.ins[4].local_shape() == (EXPERTS // 2, HIDDEN, 8)  # ffn 16 over ep
    assert tp.ins[3].local_shape() == (EXPERTS // 2, 16, HIDDEN)  # gate and up rows alike
    assert tp.outs[0].partial and tp.grads[0].partial  # summed over the ffn's axis
    with pytest.raises(ValueError, match="the experts' axes must all split the tokens"):
        rule_for(node).from_space(node, ("dp", None, ("dp", "ep"), None, None), mesh)


def test_experts_a_user_marks_and_ones_the_op_cannot_compute() -> None:
    class Mine(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 6, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 3))

        def forward(self, x: torch.Tensor, index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return experts_math(x, index, w, self.gate_up_proj, self.down_proj, "gelu")

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = mark_experts(Mine(), "gelu")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w, index = torch.topk(x.softmax(-1), 2)
            return self.experts(x, index, w).sum()

    og = capture(Routed(), (torch.randn(5, 4),))
    assert any(n.target is torch.ops.autoshard.experts.default for n in og.graph.nodes)
    with pytest.raises(ExpertsError, match="activation 'tanh'"):
        mark_experts(Mine(), "tanh")
    bad = Mine()
    bad.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))
    with pytest.raises(ExpertsError, match=r"are not \[E, 2F, H\] and \[E, H, F\]"):
        mark_experts(bad)
    mixtral = _mixtral("eager")
    mixtral.model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(ExpertsError, match="has_bias=True are not supported"):
        capture(mixtral, _batches()[0])


def test_the_search_spreads_the_experts_of_a_wide_moe() -> None:
    """Known answer: experts wide enough that moving their tokens costs less than computing
    every expert's share everywhere, on 4 cpu devices: the experts are split."""
    torch.manual_seed(0)
    config = reference_config("moe", layers=1, hidden=64, heads=4, kv_heads=2, ffn=256,
                              vocab=256, seq=32, experts=8, top_k=2)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 256, (8, 32), generator=g) for _ in range(2))
    plan = autoshard.plan(build(config), batch, "cpu", num_devices=4)
    spec = next(v for k, v in plan.json["strategies"].items() if "experts" in k)["space"]
    assert spec[2] is not None
