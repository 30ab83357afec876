"""Context parallelism equals plain PyTorch: a ``cp`` mesh axis feeds each rank its part of
every sequence, and causal attention over the whole sequence is computed by each method
(``attention="allgather"``, ``"ulysses"``, ``"ring"``). The GPT and Llama reference models and
transformers' Llama (explicit masks, labels shifted across the split) train 5 AdamW steps in
float64 beside the eager model stepped by ``torch.optim``: every step's loss and every
parameter compared (docs/parallelism/sequence.md)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from test_pipeline import _batches, _labels, _model

from autoshard import parallelize, shard_inputs, single_device
from autoshard.graph import capture_modes
from autoshard.ops import StrategyError
from autoshard.ops.contraction import ATTENTION_METHODS
from autoshard.testing import run_ranks

LAYERS = 2
_CAPTURED: dict[str, Any] = {}


def _megatron(name: str) -> dict[str, tuple]:
    """Megatron's tensor parallel over ``tp`` with the sequence dim of every activation the
    linears read over ``cp``."""
    seq = (None, "cp", None)
    col, row = (seq, ("tp", None)), ((None, "cp", "tp"), (None, "tp"))
    if name == "gpt":
        from autoshard import Factored

        qkv = Factored((3, 4, 8), (None, "tp", None))
        return {
            "layers.*.attn.c_attn": (seq, (qkv, None)),
            "layers.*.attn.c_proj": row,
            "layers.*.mlp.c_fc": col,
            "layers.*.mlp.c_proj": row,
        }
    if name == "llama":
        return {
            "layers.*.attention.w[qkv]": col,
            "layers.*.attention.wo": row,
            "layers.*.feed_forward.w[13]": col,
            "layers.*.feed_forward.w2": row,
        }
    from test_copies import _megatron

    return _megatron("cp")


def _striped(og: Any, mesh: dict) -> dict[str, Any]:
    """Every input's sequence (dim 1) split over ``cp`` round-robin: rank ``r`` holds
    positions ``r, r + cp, ...`` (and the batch over ``dp``)."""
    from autoshard import Factored, Layout

    cp, out = mesh["cp"], {}
    for node in og.graph.nodes:
        if node.op == "placeholder" and og[node].kind == "input":
            shape = og[node].shape
            spec = ["dp" if "dp" in mesh else None, Factored((shape[1] // cp, cp), (None, "cp"))]
            out[node.name] = Layout.from_named(shape, spec, mesh, dtype=og[node].dtype)
    return out


def _against_pytorch(
    name: str, mesh: dict, attention: str, striped: bool = False, searched: bool = False
) -> str:
    """Train under ``mesh`` fed each rank's part of the batch and eagerly; '' when every loss
    and parameter agree and each rank was fed ``1/cp`` of every sequence (in blocks, or
    round-robin when ``striped``). ``searched``: the plan ``autoshard.plan`` finds with
    ``attention`` fixed, run from its JSON."""
    model = _model(name, LAYERS)
    ref = copy.deepcopy(model)
    batches = _labels() if name == "hf-llama" else _batches()
    atol = 1e-6 if name == "hf-llama" else 1e-8  # transformers' upcast logits: float32 loss
    captured = _captured(name, model, batches[0])
    strategies = _megatron(name) if "tp" in mesh else None
    inputs = _striped(captured[True], mesh) if striped else None
    if searched:
        from autoshard import plan

        found = plan(model, batches[0], "cpu", mesh=mesh, captured=captured,
                     attention=attention).json  # fmt: skip
        pm = parallelize(model, batches[0], mesh, plan=found, captured=captured)
        # Ulysses: the heads split over cp, the all-to-alls where the search puts them
        text = str(pm.plan)
        want = [attention] if attention != "ulysses" else []
        if [m for m in ATTENTION_METHODS if f": {m} (" in text and m != "ulysses"] != want:
            return f"{name} {mesh}: the searched plan computes attention by another method"
    else:
        pm = parallelize(model, batches[0], mesh, strategies, captured=captured,
                         attention=attention, input_layouts=inputs)  # fmt: skip
    where = f"{name} {mesh} {attention}{' striped' if striped else ''}"

    def fed(batch: Any, mine: Any) -> str:
        got = [tuple(t.shape) for t in mine]
        want = [(t.shape[0] // mesh.get("dp", 1), t.shape[1] // mesh["cp"]) for t in batch]
        return "" if got == want else f"fed {got}, expected {want}"

    return _trained_alike(pm, ref, batches, where, atol, fed)


def _captured(name: str, model: torch.nn.Module, batch: tuple) -> Any:
    """The capture of ``name``'s model on ``batch``, made once per rank process: capturing
    is most of a case's time, and the graph is the same whatever the mesh or attention."""
    if name not in _CAPTURED:
        _CAPTURED[name] = capture_modes(model, batch)
    return _CAPTURED[name]


def _trained_alike(
    pm: Any, ref: torch.nn.Module, batches: Any, where: str, atol: float = 1e-8, fed: Any = None
) -> str:
    """Train ``pm`` (each rank fed its part by ``shard_inputs``) and ``ref`` eagerly, AdamW
    from ``torch.optim`` both; '' when every step's loss and every parameter agree.
    ``fed(batch, mine)``: what is wrong with the part a rank was fed, or ''."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, batch in enumerate(batches):
        mine = shard_inputs(batch, pm)
        wrong = fed(batch, mine) if fed is not None else ""
        if wrong:
            return f"{where}: {wrong}"
        loss = pm(*mine)
        loss.backward()
        expected = ref(*batch)
        expected.backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
        if not torch.allclose(loss.detach(), expected.detach(), atol=atol):
            return f"{where}: step {step} loss {float(loss)} != {float(expected)}"
    full, want_state = pm.full_state_dict(), ref.state_dict()
    for key, value in want_state.items():
        if not torch.allclose(full[key], value, atol=atol):
            return f"{where}: {key} differs"
    return ""


def _cases(meshes: list[dict]) -> list[str]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return [
        _against_pytorch(name, mesh, attention)
        for mesh in meshes
        for name in ("gpt", "llama", "hf-llama")
        for attention in ATTENTION_METHODS
    ]


def _with_dropout() -> str:
    """GPT with dropout on under a ring over ``cp``: the masks any split draws are one
    device's (``single_device``: autoshard's program on one device, the same masks)."""
    from test_runtime import batches, build

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, config = build("gpt", 0.1)
    model = model.to(torch.float64)
    data = batches(config, torch.float64)
    captured = capture_modes(model, data[0])
    ref = single_device(copy.deepcopy(model), data[0], captured=captured)
    pm = parallelize(model, data[0], {"cp": 2}, captured=captured, attention="ring")
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, ref))
    for step, batch in enumerate(data):
        loss, want = pm(*shard_inputs(batch, pm)), ref(*batch)
        loss.backward()
        want.backward()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        if not torch.allclose(loss, want):
            return f"dropout: step {step} loss {float(loss)} != {float(want)}"
    full, want_state = pm.full_state_dict(), ref.full_state_dict()
    bad = [k for k in want_state if not torch.allclose(full[k], want_state[k])]
    return f"dropout: {bad} differ" if bad else ""


# -- activation memory ----------------------------------------------------------------------------

SEQ, HIDDEN = 128, 32


def _saved_for_backward(run: Any, params: Any) -> int:
    """The bytes of the distinct storages a forward saves for backward, parameters left out
    (saved-tensor hooks see every tensor autograd keeps)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _long_gpt(dropout: float = 0.0) -> tuple[torch.nn.Module, tuple]:
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("gpt", layers=2, hidden=HIDDEN, heads=4, ffn=128, vocab=64,
                              seq=SEQ, dropout=dropout)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 64, (2, SEQ), generator=gen) for _ in range(2))
    return build(config), batch


def _memory(mesh: dict, attention: str | None, strategies: Any = None, dropout: float = 0.0):
    """(measured, predicted) bytes one rank keeps for backward: saved-tensor hooks, and the
    cost model's activation memory of the same plan."""
    from autoshard.cost import cluster_spec, estimate

    model, batch = _long_gpt(dropout)
    captured = _captured(f"long gpt, dropout {dropout}", model, batch)
    pm = parallelize(model, batch, mesh, strategies, attention=attention, captured=captured)
    mine = shard_inputs(batch, pm)
    measured = _saved_for_backward(lambda: pm(*mine), pm.local_tensors().values())
    predicted = estimate(pm.plan, pm.plan.graph, cluster_spec("dgx-h100"))
    return measured, predicted.memory["activations"]


def _memories(cp: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {a: _memory({"cp": cp}, a) for a in ATTENTION_METHODS}
    if cp == 2:
        from test_runtime import megatron, sequence_parallel

        out["tp"] = _memory({"tp": 2}, None, megatron("gpt"), dropout=0.1)
        out["tp+sp"] = _memory({"tp": 2}, None, sequence_parallel(), dropout=0.1)
    return out


def _check_memory(per_rank: list[dict], cp: int) -> None:
    """Ring and Ulysses keep ``1/cp`` of one device's activations, but for the few replicated
    values (the loss's); all-gather keeps the gathered keys and values besides. The cost
    model's prediction of each falls as the measured bytes do."""
    from autoshard.cost import cluster_spec, estimate

    model, batch = _long_gpt()
    one = _saved_for_backward(lambda: model(*batch), model.parameters())
    plan = parallelize(model, batch, 1).plan
    one_predicted = estimate(plan, plan.graph, cluster_spec("dgx-h100")).memory["activations"]
    for mine in per_rank:
        for method in ("ring", "ulysses"):
            measured, predicted = mine[method]
            assert measured <= one / cp * 1.06, (method, measured, one)
            assert one_predicted / predicted == pytest.approx(one / measured, rel=0.1)
        gathered, predicted = mine["allgather"]
        # each layer's whole keys and values (batch 2, float32) less the rank's own part
        kv = 2 * 2 * SEQ * HIDDEN * 4 * (1 - 1 / cp)
        assert gathered >= mine["ring"][0] + 2 * kv, (gathered, mine["ring"])
        assert one_predicted / predicted == pytest.approx(one / gathered, rel=0.1)


def _tensor_parallel(name: str) -> dict[str, tuple]:
    from test_copies import _megatron
    from test_runtime import megatron

    return _megatron() if name == "hf-llama" else megatron(name)


def _sequence_parallel(name: str) -> str:
    """Megatron's tensor parallel strategies alone, with ``sequence_parallel=True``: trains
    as PyTorch, and its activations move what plain tensor parallelism's do (all-gathers and
    reduce-scatters for all-reduces) and the column-split linears' inputs gathered again in
    backward (each keeps only its sequence part), which the plan predicts."""
    from autoshard import comm
    from autoshard.cost.collectives import regathered
    from autoshard.lower.lower import RegatheredLinear
    from autoshard.redistribution import gradient_sum, redistribution_plan

    moved, again = {}, {}
    for sp in (False, True):
        model = _model(name, LAYERS)
        ref = copy.deepcopy(model)
        batches = _labels() if name == "hf-llama" else _batches()
        atol = 1e-6 if name == "hf-llama" else 1e-8
        pm = parallelize(model, batches[0], {"tp": 2}, _tensor_parallel(name),
                         captured=_CAPTURED.get(name), sequence_parallel=sp)  # fmt: skip
        opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, ref))
        for step, batch in enumerate(batches):
            with comm.counting() as counted:
                loss = pm(*shard_inputs(batch, pm))
                loss.backward()
            want = ref(*batch)
            want.backward()
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
            if not torch.allclose(loss.detach(), want.detach(), atol=atol):
                return f"{name} sequence_parallel={sp}: step {step} loss {loss} != {want}"
        # a step's bytes, measured, less the parameters' gradient sums (under sequence
        # parallelism the replicated embedding's and norms' gradients are partial too)
        sums = sum(
            gradient_sum(p.grad_partial, p.layout.with_dtype(p.grad_partial.dtype)).bytes
            for p in pm.plan.params.values()
            if p.grad_partial is not None
        )
        moved[sp] = sum(c["bytes"] for c in counted.values()) - sums
        graph = pm.plan.graph
        again[sp] = sum(
            redistribution_plan(*move).bytes
            for n in graph.graph.nodes
            if n.name in pm.plan.nodes
            for move in regathered(n, pm.plan.nodes[n.name])
        )
        readers = [m for m in pm.program().modules() if isinstance(m, RegatheredLinear)]
        if sp and (not again[sp] or not readers):
            return f"{name}: sequence parallel gathers nothing again in backward"
        kinds = set(counted)
        if sp and not {"all_gather", "reduce_scatter"} <= kinds:
            return f"{name}: sequence parallel ran {kinds}"
        full = pm.full_state_dict()
        bad = [k for k, v in ref.state_dict().items() if not torch.allclose(full[k], v, atol=atol)]
        if bad:
            return f"{name} sequence_parallel={sp}: {bad} differ"
    if again[False]:
        return f"{name}: tensor parallelism gathers {again[False]} bytes again"
    # the labels' shift gathers a few ids besides
    if not moved[False] + again[True] <= moved[True] <= moved[False] * 1.01 + again[True]:
        return (
            f"{name}: sequence parallel moves {moved[True]} bytes, tensor {moved[False]}, "
            f"gathered again {again[True]}"
        )
    return ""


def _one_stage_recompute() -> str:
    """The plan the search gives where only recompute fits (a pipeline of one stage, full
    recompute), asked for ring attention over ``cp 2``, trains as PyTorch: losses and
    parameters. (A pipeline takes the whole batch and cuts each rank's part itself.)"""
    from autoshard import plan

    model, batches = _model("llama", LAYERS), _batches()
    ref = copy.deepcopy(model)
    found = plan(model, batches[0], "cpu", mesh={"cp": 2}, pp=1, recompute="full",
                 attention="ring").json  # fmt: skip
    if (found["pipeline"]["pp"], found["pipeline"]["recompute"]) != (1, "full"):
        return f"one stage: planned {found['pipeline']}"
    pm = parallelize(model, batches[0], None, plan=found)
    text = str(pm.plan)
    if ": ring (" not in text or "x[b, s@cp] -> [b, s@cp, hidden]" not in text:
        return "one stage: the plan splits the sequence or computes attention otherwise"
    return _trained_alike(pm, ref, batches, "one stage, full recompute, ring")


def _zero_over_cp() -> str:
    """ZeRO 3 on a ``cp 2`` mesh shards every parameter over the ranks that sum its gradient,
    which are the ``cp`` ranks (no two ranks hold the same rows), and trains as PyTorch."""
    model, batches = _model("llama", LAYERS), _batches()
    ref = copy.deepcopy(model)
    captured = _captured("llama", model, batches[0])
    pm = parallelize(model, batches[0], {"cp": 2}, zero=3, attention="ring", captured=captured)
    doubled = [fqn for fqn, _ in ref.named_parameters() if pm.holders(fqn) > 1]
    if doubled:
        return f"ZeRO over cp: {doubled} held twice"
    return _trained_alike(pm, ref, batches, "ZeRO 3 over cp 2")


def _cut_small(name: str, mesh: dict, attention: str, striped: bool = False) -> str:
    """``_against_pytorch`` with every causal product longer than a row cut in halves, as a
    long sequence's products are (``ops.ring.LEAF``)."""
    from autoshard.ops import ring

    kept, ring.LEAF = ring.LEAF, 1
    try:
        return _against_pytorch(name, mesh, attention, striped)
    finally:
        ring.LEAF = kept


def _world2() -> tuple[list[str], dict]:
    failures = _cases([{"cp": 2}]) + [_with_dropout()]
    failures += [_cut_small("gpt", {"cp": 2}, "ring"),
                 _cut_small("llama", {"cp": 2}, "ring", striped=True),
                 _cut_small("llama", {"cp": 2}, "allgather", striped=True)]  # fmt: skip
    failures += [
        _against_pytorch(name, {"cp": 2}, method, striped=True)
        for name in ("gpt", "llama", "hf-llama")
        for method in ("ring", "allgather")
    ]
    failures += [_sequence_parallel(name) for name in ("gpt", "llama", "hf-llama")]
    failures += [
        _against_pytorch(name, {"dp": 1, "cp": 2}, method, searched=True)
        for name in ("gpt", "llama", "hf-llama")
        for method in ATTENTION_METHODS
    ]
    failures += [_one_stage_recompute(), _zero_over_cp()]
    return failures, _memories(2)


def test_context_parallel_on_2_ranks_trains_as_pytorch() -> None:
    """And keeps a cp-th of the activations (docs/parallelism/sequence.md): sequence
    parallelism's regions (norm inputs, dropout masks) a t-th."""
    per_rank = run_ranks(_world2, 2, timeout=600)
    for failures, _ in per_rank:
        assert not [f for f in failures if f], failures
    memories = [m for _, m in per_rank]
    _check_memory(memories, 2)
    for mine in memories:
        (tp, _), (sp, _) = mine["tp"], mine["tp+sp"]
        # Korthikanti et al.'s regions a tp rank splits under sequence parallelism: each
        # layer's two norm inputs (float32) and two dropout masks (bool), sbh each, halved
        regions = 2 * (2 * 4 + 2 * 1) * 2 * SEQ * HIDDEN * (1 - 1 / 2)
        assert tp - sp >= regions, (tp, sp, regions)


def _world4(meshes: list[dict]) -> tuple[list[str], dict]:
    failures = _cases(meshes)
    failures += [_against_pytorch("llama", {"dp": 2, "cp": 2}, "ring", striped=True),
                 _against_pytorch("gpt", {"cp": 4}, "allgather", striped=True),
                 _cut_small("llama", {"cp": 4}, "ring"),
                 _cut_small("gpt", {"dp": 2, "cp": 2}, "allgather")]  # fmt: skip
    return failures, _memories(4)


def test_context_parallel_on_4_ranks_trains_as_pytorch() -> None:
    meshes = [{"cp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "tp": 2}]
    per_rank = run_ranks(_world4, 4, meshes, timeout=900)
    for failures, _ in per_rank:
        assert not [f for f in failures if f], failures
    _check_memory([m for _, m in per_rank], 4)


def test_bad_attention_choices_are_clear_errors() -> None:
    """An unknown method, Ulysses over more ranks than the heads divide into and a ring over
    fewer keys than queries name what was wrong before anything runs (planned here without
    ranks)."""
    from autoshard import plan as autoshard_plan
    from autoshard.mesh import mesh_info
    from autoshard.models import build, reference_config
    from autoshard.ops.contraction import Attention
    from autoshard.search import plan_graph

    model = _model("gpt", 1)
    batch = _batches()[0]
    with pytest.raises(ValueError, match="attention='flash'.*allgather, ulysses, ring"):
        parallelize(model, batch, {"cp": 1}, attention="flash")  # the options' own check
    torch.manual_seed(0)
    two_heads = build(reference_config("gpt", layers=1, hidden=16, heads=2, seq=16, vocab=32))
    ids = torch.randint(0, 32, (2, 16))
    og = capture_modes(two_heads, (ids, ids))[True]
    plan_graph(og, mesh_info({"cp": 2}), attention="ulysses")  # 2 heads over 2 ranks
    with pytest.raises(StrategyError, match="Ulysses splits the 2 heads 4 ways"):
        plan_graph(og, mesh_info({"cp": 4}), attention="ulysses")
    with pytest.raises(ValueError, match="attention='flash'.*allgather, ulysses, ring"):
        autoshard_plan(model, batch, "cpu", num_devices=2, attention="flash")
    # a plan JSON whose keys split otherwise than the rows: not a ring
    attention = next(n for n in og.graph.nodes if "scaled_dot" in str(n.target))
    spec = [None] * 6
    spec[2], spec[3] = "cp", "dp"
    with pytest.raises(StrategyError, match="key length splits only as the query rows do"):
        Attention().from_space(attention, spec, mesh_info({"dp": 2, "cp": 2}))
    cross = capture_modes(_CrossAttention(), (torch.randn(2, 8, 16), torch.randn(2, 4, 16)))
    plan_graph(cross[True], mesh_info({"cp": 2}), attention="allgather")
    with pytest.raises(StrategyError, match="ring attention needs as many keys as queries"):
        plan_graph(cross[True], mesh_info({"cp": 2}), attention="ring")


def test_a_round_robin_sequence_needs_no_deal() -> None:
    """Inputs split round-robin over ``cp`` (rank ``r`` fed positions ``r, r + cp, ...``) keep
    that split to the attention, whose rows are then balanced as they stand: the op moves
    nothing to balance them (no exchange beyond the ring's own). A block split is dealt."""
    from autoshard.mesh import mesh_info
    from autoshard.ops.contraction import Attention, is_striped
    from autoshard.search import plan_graph

    og = capture_modes(_model("gpt", 1), _batches()[0])[True]
    attention = next(n for n in og.graph.nodes if "scaled_dot" in str(n.target))
    for method, mesh in (("ring", {"cp": 4}), ("allgather", {"dp": 2, "cp": 2})):
        cp = mesh["cp"]
        for striped in (True, False):
            inputs = _striped(og, mesh) if striped else None
            plan = plan_graph(og, mesh_info(mesh), attention=method, input_layouts=inputs)
            strategy = plan.nodes[attention.name].strategy
            assert is_striped(strategy.ins[0]) == striped
            sends = Attention().exchanges(attention, strategy)
            ring = 3 * cp - 2 if method == "ring" else 0
            assert len(sends) == ring + (0 if striped else 2), (method, striped, sends)
        for layout in _striped(og, mesh).values():
            assert layout.local_index(cp - 1)[1].tolist()[:2] == [cp - 1, 2 * cp - 1]
    # a scan along a round-robin split takes the dim whole: only blocks add up in order
    scan = capture_modes(_Positions(), (torch.ones(2, 8, dtype=torch.long),))[True]
    plan = plan_graph(scan, mesh_info({"cp": 2}), input_layouts=_striped(scan, {"cp": 2}))
    cumsum = next(n for n in plan.nodes.values() if "cumsum" in n.target)
    assert cumsum.strategy.ins[0].local_shape() == (2, 8), cumsum.strategy.ins[0]


class _Positions(torch.nn.Module):
    """Positions counted from a mask along the sequence (an integer scan)."""

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        return (mask.cumsum(1) * mask).float().sum()


class _CrossAttention(torch.nn.Module):
    """Queries from ``x``, keys and values from ``memory`` (fewer positions): no ring."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(2, 8, 2, 8).transpose(1, 2)
        k, v = self.kv(memory).view(2, 4, 2, 16).transpose(1, 2).split(8, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum()


def _splits_sequence(layout: Any) -> int:
    """How many ways an input's sequence dim (1) is split."""
    return layout.shape[1] // layout.local_shape()[1]


def test_the_search_splits_the_sequence_where_nothing_else_fits_and_not_where_batch_does() -> None:
    """A known answer: one sequence of 1024 tokens on 4 devices with memory for 30% of one
    device's peak can only fit by splitting the sequence 4 ways (its batch is 1; splitting
    weights leaves the residual stream whole); 16 short sequences split by batch instead."""
    import autoshard
    from autoshard.models import build, reference_config

    def model_and_batch(batch: int, seq: int) -> tuple[torch.nn.Module, tuple]:
        torch.manual_seed(0)
        config = reference_config("llama", layers=2, hidden=64, heads=8, kv_heads=8, ffn=128,
                                  vocab=64, seq=seq)  # fmt: skip
        ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(0))
        return build(config), (ids, ids)

    model, batch = model_and_batch(1, 1024)
    one = autoshard.plan(model, batch, "dgx-h100", num_devices=1)
    limit = 0.3 * one.predicted.peak_memory
    tight = autoshard.plan(model, batch, "dgx-h100", num_devices=4, memory_limit=limit)
    assert tight.predicted.peak_memory <= limit
    assert all(_splits_sequence(layout) == 4 for layout in tight.inputs.values()), tight.inputs
    assert "attention over a split sequence" in str(tight)
    model, batch = model_and_batch(16, 64)
    short = autoshard.plan(model, batch, "dgx-h100", num_devices=4)
    assert all(_splits_sequence(layout) == 1 for layout in short.inputs.values()), short.inputs


def test_the_search_under_sequence_parallelism_splits_every_op_over_tp() -> None:
    """``sequence_parallel=True`` in the search (``autoshard plan --sequence-parallel``): every
    op that can be split over the tensor-parallel axis is, the norms by sequence among them;
    the search alone keeps some whole on it here (one sequence: no batch to split, and the
    model too small for tensor parallelism to pay)."""
    from autoshard.cost import cluster_spec
    from autoshard.mesh import mesh_info
    from autoshard.search import run_search

    og = capture_modes(_model("gpt", 1), tuple(t[:1] for t in _batches()[0]))[True]
    mesh = mesh_info({"dp": 2, "tp": 2})  # an option's assign: (dp's dim, tp's dim)

    def whole_on_tp(sequence_parallel: bool) -> list[str]:
        result = run_search(og, 4, cluster_spec("dgx-h100", 4), mesh=mesh,
                            sequence_parallel=sequence_parallel)  # fmt: skip
        graph, out = result.graph, []
        for i, name in enumerate(graph.names):
            chosen = graph.options[i][result.solution.choice[i]]
            if chosen.assign[1] is None and any(o.assign[1] is not None for o in graph.options[i]):
                out.append(name)
        return out

    assert whole_on_tp(False), "the search alone splits every op over tp: nothing to show"
    assert whole_on_tp(True) == []


def _ring_ops_against_sdpa(n: int, length: int, leaf: int) -> list[str]:
    """Both ops' output and gradients on this rank's block of a causal attention over
    ``length`` positions (float64), against ``scaled_dot_product_attention`` on the whole."""
    import torch.distributed as dist

    from autoshard.ops import ring

    kept, ring.LEAF = ring.LEAF, leaf
    rank, failures = dist.get_rank(), []
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, length, 8, dtype=torch.float64, generator=gen) for _ in "qkvg")
    mine = slice(rank * length // n, (rank + 1) * length // n)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True)
    want_grads = torch.autograd.grad(want, whole, g)
    try:
        for method in ("ring", "allgather"):
            rows = q[..., mine, :].clone().requires_grad_()
            if method == "ring":
                keys = [t[..., mine, :].clone().requires_grad_() for t in (k, v)]
                got = ring.ring_attention(rows, *keys, None, range(n), rank, None, True)
            else:
                keys = [t.clone().requires_grad_() for t in (k, v)]
                got = ring.causal_rows_attention(rows, *keys, list(range(n)), rank)
            grads = list(torch.autograd.grad(got, [rows, *keys], g[..., mine, :]))
            if method == "allgather":  # every rank's part of the key and value gradients
                for t in grads[1:]:
                    dist.all_reduce(t)
            pieces = [want[..., mine, :], want_grads[0][..., mine, :]]
            pieces += [t[..., mine, :] if method == "ring" else t for t in want_grads[1:]]
            for name, a, b in zip(("out", "dq", "dk", "dv"), [got, *grads], pieces, strict=True):
                if not torch.allclose(a, b, atol=1e-12):
                    failures.append(f"{method} cp {n} leaf {leaf}: {name} differs")
    finally:
        ring.LEAF = kept
    return failures


def _odd_ring() -> list[str]:
    return _ring_ops_against_sdpa(3, 24, 64) + _ring_ops_against_sdpa(3, 48, 2)


def test_an_odd_ring_deals_its_middle_rank_nothing_and_computes_exactly() -> None:
    """On 3 ranks the middle rank is its own partner in the deal (ops/ring.py ``_Swap``):
    ring and all-gather ops against ``scaled_dot_product_attention``, with products whole
    and cut to 2 rows."""
    for failures in run_ranks(_odd_ring, 3, timeout=300):
        assert not failures, failures
