"""Multi-copy parallelism equals plain PyTorch: each rank's batch cut into copies whose
collectives overlap each other's compute trains as the eager model stepped by
``torch.optim.AdamW`` does, in float64 over 5 steps, every loss and every parameter compared.

Two spawns: 2 ranks run transformers' Llama under Megatron's tensor parallelism with 2 and 4
copies (its own loss, padding ignored: copies weighted by their counted targets), the MoE
reference model and Mixtral (built from a config) with their experts over ``ep`` with 2
copies, the MoE model on pp 2 under 1F1B with 2 copies inside each of 2 micro-batches, the
batch that does not cut into copies, and a traced step showing the interleaving; 4 ranks run
Llama on dp 2 x tp 2 with sequence parallelism and ZeRO 1 with 2 copies.

Every run equals one device on the whole batch; a MoE router's balance loss (a product of
means over the tokens) too, as one device computes it over every token of the batch (under
pipeline stages, over every token of the micro-batch).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from autoshard.testing import run_ranks  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, HIDDEN, EXPERTS, TOP_K, LR = 5, 8, 8, 64, 32, 4, 2, 1e-2


def _megatron(
    seq: str | None = None,
    dp: str | None = None,
    layer: str = "model.model.layers.*",
    mlp: bool = True,
) -> dict[str, tuple]:
    """Megatron's split of transformers' Llama layers over ``tp``: ``layer`` their path
    (``model.layers.*`` without the loss's wrapper); ``mlp=False``: the attention's alone
    (Mixtral's feed-forward is its experts)."""
    col, row = ((dp, seq, None), ("tp", None)), ((dp, seq, "tp"), (None, "tp"))
    out = {f"{layer}.self_attn.[qkv]_proj": col, f"{layer}.self_attn.o_proj": row}
    if mlp:
        out |= {f"{layer}.mlp.gate_proj": col, f"{layer}.mlp.up_proj": col}
        out[f"{layer}.mlp.down_proj"] = row
    return out


def _llama() -> torch.nn.Module:
    import transformers
    from test_hf_gpt2 import CausalLMLoss

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return CausalLMLoss(transformers.LlamaForCausalLM(config)).double()


def _moe() -> torch.nn.Module:
    from autoshard.models import build, reference_config

    torch.manual_seed(0)
    config = reference_config("moe", layers=2, hidden=HIDDEN, heads=4, kv_heads=2, ffn=16,
                              vocab=VOCAB, seq=SEQ, experts=EXPERTS, top_k=TOP_K,
                              aux_loss_coef=0.01)  # fmt: skip
    return build(config).to(torch.float64)


def _mixtral() -> torch.nn.Module:
    """Mixtral with its router's balance loss in the loss."""
    from test_expert import _mixtral as mixtral

    return mixtral()


MODELS = {"llama": _llama, "moe": _moe, "mixtral": _mixtral}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ids and targets; a few targets of each row ignored (-100), more in some rows than in
    others, so copies hold different counts of counted targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        pad = torch.arange(SEQ) >= SEQ - torch.randint(0, 5, (BATCH, 1), generator=g)
        out.append((ids, targets.masked_fill(pad, -100)))
    return out


# -- plain PyTorch -------------------------------------------------------------------------------


def _eager(model: torch.nn.Module) -> dict[str, Any]:
    """The eager model and AdamW on every batch, whole."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in _batches():
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def _eager_microbatches(model: torch.nn.Module, m: int) -> dict[str, Any]:
    """The eager model and AdamW with each batch's rows in ``m`` micro-batches, their
    gradients accumulated: the step's loss the micro-batches' mean (a loss that is not one
    counted mean over its targets weighs each micro-batch alike), and a statistic over the
    rows inside it (a router's balance loss) each micro-batch's own, as a pipeline's is."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in _batches():
        loss = sum(model(*part) for part in zip(*(x.chunk(m) for x in batch), strict=True)) / m
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def _same(got: dict, want: dict, name: str, rtol: float, atol: float) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=rtol, abs=atol), (
        name,
        got["losses"],
        want["losses"],
    )
    assert got["state"].keys() == want["state"].keys(), name
    for key, value in want["state"].items():
        torch.testing.assert_close(
            got["state"][key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{name} {k}: {m}"
        )


# -- on the ranks --------------------------------------------------------------------------------


_CAPTURED: dict[tuple, Any] = {}


def _captured(name: str, model: torch.nn.Module, batch: tuple, options: dict) -> Any:
    """What ``parallelize`` captures under ``options`` (one copy's rows of one micro-batch),
    made once per rank process for every run of the same model and rows: capturing is most
    of a run's time. A plan file brings its own copies (a plan with stages or a compute dtype
    of its own: None, captured by ``parallelize``)."""
    from autoshard.graph import capture_modes
    from autoshard.runtime.pipeline import microbatch_example
    from autoshard.runtime.program.copies import copy_example

    if "plan" in options:  # a plan file of one program: its copies' capture
        with open(options["plan"]) as f:
            made = json.load(f)
        if "pipeline" in made or (made["options"].get("precision") or {}).get("compute"):
            return None
        options = {"copies": made["options"]["copies"]}
    key = (name, options.get("copies", 1), options.get("microbatches", 1))
    if key not in _CAPTURED:
        micro = microbatch_example(batch, None, key[2])[0]
        _CAPTURED[key] = capture_modes(model, copy_example(micro, None, key[1])[0])
    return _CAPTURED[key]


def _trained(name: str, mesh: dict, strategies: Any = None, **options: Any) -> dict[str, Any]:
    from autoshard import parallelize, shard_inputs

    model = MODELS[name]()
    batches = _batches()
    captured = _captured(name, model, batches[0], options)
    pm = parallelize(model, batches[0], mesh, strategies, captured=captured, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": pm.full_state_dict(), "copies": pm.options.copies}


def _planned(tmp: str) -> dict[str, Any]:
    """A plan file made with 2 copies (``autoshard.plan``, Megatron's strategies), run by
    ``parallelize(plan=...)`` with no copies given: the run takes the plan's."""
    from autoshard import plan

    path = f"{tmp}/plan.json"
    if torch.distributed.get_rank() == 0:
        made = plan(_llama(), _batches()[0], "cpu", mesh={"tp": 2}, strategies=_megatron(),
                    zero=0, copies=2)  # fmt: skip
        with open(path, "w") as f:
            json.dump(made.json, f)
    torch.distributed.barrier()
    return _trained("llama", None, plan=path)


def _indivisible() -> str:
    """A batch of 8 rows cut into 3 copies: the error, at ``parallelize`` and in forward."""
    from autoshard import parallelize

    batch = _batches()[0]
    try:
        parallelize(_llama(), batch, {"tp": 2}, _megatron(), copies=3)
    except ValueError as err:
        return str(err)
    return "no error"


def _traced(name: str, mesh: dict, strategies: Any = None, **options: Any) -> dict[str, Any]:
    """One step with 2 copies: the copies' posts, waits and compute in forward and
    backward, and the collectives issued."""
    from autoshard import comm, parallelize, shard_inputs
    from autoshard.runtime.program.copies import tracing

    batch, model = _batches()[0], MODELS[name]()
    captured = _captured(name, model, batch, {"copies": 2, **options})
    pm = parallelize(model, batch, mesh, strategies, copies=2, captured=captured, **options)
    with tracing() as trace, comm.recording() as issued:
        pm(*shard_inputs(batch, pm)).backward()
    return {"trace": trace, "issued": issued}


def _world2(tmp: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return {
        "llama planned copies 2": _planned(tmp),
        "llama tp copies 2": _trained("llama", {"tp": 2}, _megatron(), copies=2),
        "llama tp copies 4": _trained("llama", {"tp": 2}, _megatron(), copies=4),
        "moe ep copies 2": _trained("moe", {"ep": 2}, copies=2),
        "moe pp copies 2": _trained("moe", {"pp": 2}, **PIPELINE),
        "mixtral ep copies 2": _trained("mixtral", {"ep": 2}, copies=2),
        "indivisible": _indivisible(),
        "traced llama": _traced("llama", {"tp": 2}, _megatron()),
        "traced moe": _traced("moe", {"ep": 2}),
    }


def _world4() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return {
        "llama dp tp sp zero1 copies 2": _trained(
            "llama",
            {"dp": 2, "tp": 2},
            _megatron(dp="dp"),
            copies=2,
            sequence_parallel=True,
            zero=1,
        ),
        "llama pp tp copies 2": _trained("llama", {"pp": 2, "tp": 2}, _megatron(), **PIPELINE),
        "traced llama pp": _traced("llama", {"pp": 2, "tp": 2}, _megatron(), **ONE_F_ONE_B),
    }


ONE_F_ONE_B = {"schedule": "1f1b", "microbatches": 2}
PIPELINE = {"copies": 2, **ONE_F_ONE_B}


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    """Where rank 0 of the 2 ranks writes the plan file ``_planned`` makes."""
    return tmp_path_factory.mktemp("plan")


@pytest.fixture(scope="module")
def on_2_ranks(plan_dir: Path) -> list[dict[str, Any]]:
    return run_ranks(_world2, 2, str(plan_dir), timeout=1200)


# transformers upcasts the logits: its loss is float32's
HF = {"rtol": 1e-6, "atol": 1e-6}


@pytest.mark.parametrize("copies", [2, 4])
def test_llama_under_megatron_tp_with_copies_equals_one_device(on_2_ranks, copies) -> None:
    want = _eager(_llama())
    for result in on_2_ranks:
        _same(result[f"llama tp copies {copies}"], want, f"copies {copies}", **HF)


@pytest.mark.parametrize("name", ["moe", "mixtral"])
def test_experts_over_ep_with_copies_equal_one_device_on_the_whole_batch(on_2_ranks, name) -> None:
    """The router's per-expert loads and mean probabilities are the copies' means before
    the balance loss multiplies them: the whole batch's balance loss, not each copy's."""
    want = _eager(MODELS[name]())
    tolerance = HF if name == "mixtral" else {"rtol": 1.3e-6, "atol": 1e-8}
    for result in on_2_ranks:
        _same(result[f"{name} ep copies 2"], want, name, **tolerance)


def test_experts_on_pp_with_copies_equal_one_device_on_each_micro_batch(on_2_ranks) -> None:
    """Under pipeline stages the router's per-expert loads and mean probabilities are the
    copies' means inside the stage: each micro-batch's balance loss as one device computes
    it over the micro-batch's rows, not a mean of its copies' own."""
    want = _eager_microbatches(_moe(), PIPELINE["microbatches"])
    for result in on_2_ranks:
        _same(result["moe pp copies 2"], want, "moe pp 1f1b copies", rtol=1.3e-6, atol=1e-8)


def test_a_plan_file_s_copies_reach_the_run(on_2_ranks) -> None:
    """``parallelize(plan=...)`` (as ``autoshard train --plan`` calls it) runs the copies
    the plan was made with: its strategies are one copy's, and the run equals one device."""
    want = _eager(_llama())
    for result in on_2_ranks:
        got = result["llama planned copies 2"]
        assert got["copies"] == 2
        _same(got, want, "plan file with copies 2", **HF)


def test_copies_that_differ_from_the_plan_s_are_named(on_2_ranks, plan_dir: Path) -> None:
    """The plan file made with 2 copies (``_planned``, on the ranks) run with copies=4."""
    from autoshard import parallelize

    path = plan_dir / "plan.json"
    with pytest.raises(ValueError, match=r"copies=4, but plan .* was made with copies 2"):
        parallelize(_llama(), _batches()[0], None, plan=str(path), copies=4)


def test_a_batch_that_does_not_cut_into_copies_is_named(on_2_ranks) -> None:
    for result in on_2_ranks:
        message = result["indivisible"]
        assert "copies=3" in message and "8 rows" in message, message


def _between(trace: list, first: tuple, then: tuple, other: str) -> bool:
    """Whether ``trace`` has ``first``, later ``then``, and the other copy's ``other``
    between them."""
    i, j = trace.index(first), trace.index(then)
    return i < j and any(e[0] == other and e[1] != first[1] for e in trace[i:j])


@pytest.mark.parametrize(
    ("name", "kind"), [("llama", "all_reduce"), ("moe", "all_to_all")], ids=["tp", "ep"]
)
def test_a_copys_collective_travels_while_the_other_copy_computes(on_2_ranks, name, kind) -> None:
    """In forward every move a copy posts (Megatron's all-reduces, the experts' dispatch and
    combine) is waited after the other copy computed; in backward every gradient collective
    too, so both directions overlap."""
    for result in on_2_ranks:
        trace = result[f"traced {name}"]["trace"]
        posts = [e for e in trace if e[0] == "post"]
        assert len(posts) >= 8 and {e[1] for e in posts} == {0, 1}, posts
        for _, c, n in posts:
            assert _between(trace, ("post", c, n), ("wait", c, n), "compute"), (c, n)
        grads = [e for e in trace if e[0] == "post_grad"]
        # the moves of what needs a gradient pass it back (not those of ids and targets)
        assert len(grads) >= 8 and {e[1:] for e in grads} <= {e[1:] for e in posts}, grads
        overlapped = [
            (c, n)
            for _, c, n in grads
            if _between(trace, ("post_grad", c, n), ("wait_grad", c, n), "compute_grad")
        ]
        # the first copy's last move has nothing of the other's after it in backward
        assert len(overlapped) >= len(grads) - 2, (overlapped, grads)
        kinds = {e[0] for e in result[f"traced {name}"]["issued"] if isinstance(e[0], str)}
        assert kind in kinds, kinds


@pytest.fixture(scope="module")
def on_4_ranks() -> list[dict[str, Any]]:
    return run_ranks(_world4, 4, timeout=1200)


def test_llama_on_dp_tp_with_sequence_parallelism_and_zero_1_with_copies(on_4_ranks) -> None:
    want = _eager(_llama())
    for result in on_4_ranks:
        _same(result["llama dp tp sp zero1 copies 2"], want, "dp tp sp zero1", **HF)


def test_llama_on_pp_tp_under_1f1b_with_copies_inside_micro_batches(on_4_ranks) -> None:
    """Each stage's micro-batch of 4 rows run as 2 copies of 2, the copies' Megatron
    all-reduces posted in turns inside the stage, forward and backward."""
    want = _eager(_llama())
    for result in on_4_ranks:
        _same(result["llama pp tp copies 2"], want, "pp tp 1f1b copies", **HF)
        trace = result["traced llama pp"]["trace"]
        posts = [i for i, e in enumerate(trace) if e[0] == "post"]
        assert {trace[i][1] for i in posts} == {0, 1}, trace
        # a stage runs once a micro-batch, its moves numbered anew each time: each post's
        # wait is the next of its copy and number
        for i in posts:
            _, c, n = trace[i]
            j = trace.index(("wait", c, n), i)
            assert any(e[0] == "compute" and e[1] != c for e in trace[i:j]), (i, trace[i:j])
        assert sum(e[0] == "post_grad" for e in trace) >= len(posts) // 2, trace


def test_copies_with_a_split_backward_are_refused_by_name() -> None:
    from autoshard import parallelize

    with pytest.raises(ValueError, match=r"copies=2 with schedule='zb-h1': a split backward"):
        parallelize(_llama(), _batches()[0], {"pp": 2, "tp": 2}, copies=2, schedule="zb-h1")


def test_autoshard_train_takes_copies_to_the_ranks_options() -> None:
    from autoshard.cli.args import build_parser
    from autoshard.cli.train import TrainConfig

    commands = ("demo", "redistribute", "plan", "calibrate", "train", "simulate")
    args = build_parser(dict.fromkeys(commands, print)).parse_args(
        ["train", "m:f", "--copies", "2"]
    )
    assert args.copies == 2
    assert TrainConfig("m:f", copies=args.copies).options(per_node=2).copies == 2
    with pytest.raises(ValueError, match="copies=0"):
        TrainConfig("m:f", copies=0).options(per_node=2)
