"""Memory as Megatron runs it (docs/parallelism/sequence.md): under tensor and sequence
parallelism every term of a layer's activations is a t-th (Korthikanti et al. 2022,
``s*b*h*(34/t + 5*a*s/(h*t))``): the cost model prices it so, and a rank keeps it so, the
column-split linears keeping only their input's sequence part (gathered again in backward).
Dropout draws its mask on the shard's device with nothing the size of its activation kept."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from test_context import _saved_for_backward
from test_runtime import megatron, sequence_parallel

from autoshard import parallelize, shard_inputs
from autoshard.cost import cluster_spec, estimate
from autoshard.graph import capture_modes
from autoshard.mesh import mesh_info
from autoshard.models import build, reference_config
from autoshard.search import plan_graph
from autoshard.testing import run_ranks

S, H, B, HEADS, T = 128, 32, 2, 4, 2
SBH = S * B * H


def _gpt(layers: int, dropout: float = 0.1) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    config = reference_config("gpt", layers=layers, hidden=H, heads=HEADS, ffn=4 * H, vocab=64,
                              seq=S, dropout=dropout)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    return build(config), tuple(torch.randint(0, 64, (B, S), generator=gen) for _ in range(2))


def _priced_layer(og: Any, plan: Any) -> float:
    """The activation bytes the estimate prices for the second block."""
    est = estimate(plan, og, cluster_spec("dgx-h100"))
    block = {n.name for n in og.graph.nodes if og[n].block == ("layers", 1)}
    return sum(terms.memory["activations"] for k, (terms, _) in est.by_node.items() if k in block)


def test_a_layer_under_tensor_and_sequence_parallelism_is_priced_at_a_t_th() -> None:
    """The cost model counts each op's output once (docs/cost.md): per layer, float32, the
    16 ``sbh`` of Korthikanti et al.'s breakdown (the two norms' inputs, the q, k, v input,
    q, k and v, the attention's output, the MLP's input, its GeLU's input and output, as the
    adds', norms', qkv's, attention's, c_fc's and GeLU's outputs) besides the two row-split
    linears' and two dropouts' outputs, and two boolean masks. Under tp + sp each is a t-th:
    the layer norms and dropouts by sequence, the row-split sums as their reduce-scattered
    share, the gathered inputs not kept at all (gathered again in backward)."""
    model, batch = _gpt(2)
    og = capture_modes(model, batch)[True]
    one = _priced_layer(og, plan_graph(og, mesh_info(1)))
    assert one == SBH * (4 * (16 + 4) + 2 * 1)
    tp = mesh_info({"tp": T})
    configured = plan_graph(og, tp, sequence_parallel())  # every norm, add, dropout named
    switched = plan_graph(og, tp, megatron("gpt"), sequence_parallel=True)
    assert _priced_layer(og, configured) == _priced_layer(og, switched) == one / T
    # tensor parallelism alone: the norms, adds, dropouts and their masks stay whole
    # (Korthikanti's 10 sbh of 2-byte values, here 6 float32 sbh and the masks)
    alone = _priced_layer(og, plan_graph(og, tp, megatron("gpt")))
    assert alone == SBH * (4 * 6 + 2) + SBH * 4 * 14 / T


def _kept(layers: int, strategies: Any) -> tuple[int, list, Any]:
    """(bytes a rank keeps for backward, the shapes of what it keeps, the module)."""
    model, batch = _gpt(layers)
    pm = parallelize(model, batch, {"tp": T}, strategies)
    mine = shard_inputs(batch, pm)
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm(*mine)
    return _saved_for_backward(lambda: pm(*mine), pm.local_tensors().values()), shapes, pm


def _recomputed(recompute: str) -> str:
    """Llama under Megatron tp 2 with sequence parallelism and ``recompute``: the block run
    again in backward gathers its input in forward again and then once more for the weight
    gradient; 5 float64 AdamW steps equal plain PyTorch's, losses and parameters."""
    from test_context import _batches, _model, _tensor_parallel

    model, batches = _model("llama", 2), _batches()
    ref = copy.deepcopy(model)
    pm = parallelize(model, batches[0], {"tp": T}, _tensor_parallel("llama"),
                     sequence_parallel=True, recompute=recompute)  # fmt: skip
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, ref)]
    for step, batch in enumerate(batches):
        loss, want = pm(*shard_inputs(batch, pm)), ref(*batch)
        loss.backward()
        want.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if not torch.allclose(loss.detach(), want.detach(), atol=1e-8):
            return f"recompute {recompute}: step {step} loss {float(loss)} != {float(want)}"
    full = pm.full_state_dict()
    bad = [k for k, v in ref.state_dict().items() if not torch.allclose(full[k], v, atol=1e-8)]
    return f"recompute {recompute}: {bad} differ" if bad else ""


def _world() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict[str, Any] = {"failures": [_recomputed("full"), _recomputed("selective")]}
    for name, strategies in (("tp", megatron("gpt")), ("sp", sequence_parallel())):
        one, _, _ = _kept(1, strategies)
        two, shapes, pm = _kept(2, strategies)
        out[name] = two - one
        out[f"{name} shapes"] = shapes
    held = []
    for module in pm.program().modules():
        if type(module).__name__ == "Dropout":
            tensors = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
            tensors += list(module.buffers())
            held.append(sum(t.numel() for t in tensors))
    out["dropout held"] = held
    return out


def test_a_rank_keeps_a_t_th_of_a_layer_under_sequence_parallelism() -> None:
    """Measured by saved-tensor hooks (one layer: two layers' bytes less one layer's),
    float32, tp 2: exactly Korthikanti et al.'s 16 ``sbh`` and two one-byte masks, all a t-th
    (the fused attention keeps its output, the output projection's input, and the rows'
    log-sum-exp in place of their 5as/h of scores), besides the norms' row statistics: their
    ``34/t`` in 2-byte values. No rank keeps a whole sequence's ``[b, s, h]``
    (the column-split linears keep their input's part); plain tensor parallelism keeps both
    norms' outputs whole. Dropout holds no tensor between calls. And the gather again trains
    as PyTorch under full and selective recompute."""
    for mine in run_ranks(_world, 2, timeout=300):
        assert not [f for f in mine["failures"] if f], mine["failures"]
        stats = 2 * 2 * B * S // T * 4 + B * HEADS // T * S * 4  # norms' mean, rstd; lse
        assert mine["sp"] == SBH // T * (4 * 16 + 2) + stats, mine["sp"]
        assert (B, S, H) not in mine["sp shapes"]
        assert (B, S, H) in mine["tp shapes"]
        assert mine["tp"] - mine["sp"] >= SBH * (1 - 1 / T) * (4 * 4 + 2)
        assert mine["dropout held"] and not any(mine["dropout held"]), mine["dropout held"]
