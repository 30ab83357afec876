"""The published H100 runs ``python -m bench published`` prices apart from the A100 ones.

Sources (the numbers are theirs; the code that reads them is this file):

- Megatron-LM's README, "Training Speed and Scalability" (NVIDIA/Megatron-LM, the model table
  ``images/model_table.png`` added in commit f2e5db402c, 2024-07-15, kept unchanged since): the
  weak-scaling GPT runs from 1.7B to 462B parameters on up to 6144 H100s with Megatron-Core
  r0.8.0 (the strong-scaling figure's label), vocabulary 131072, sequence 4096, bf16; per run
  the heads, hidden size, layers, tensor, pipeline and data-parallel sizes, GPUs, batch and
  the achieved teraFLOP/s per GPU. The model sizes it names are those of a GPT whose output
  layer has its own weight (``--untie-embeddings-and-output-weights``: 1.7B is 1.21B in the
  blocks and two 0.27B vocabulary matrices, 1.48B tied; so for every row), planned untied.
  Megatron-Core lays its fused query-key-value projection out by head (each head's query,
  key and value side by side), so that a tensor-parallel split of it holds whole heads: the
  runs are planned on autoshard's GPT with that attention (``mcore_gpt``, through
  ``--model-fn``). Its throughput counts the FLOPs of Megatron-LM's
  ``num_floating_point_operations`` of that commit, 12 B s l h^2 (1 + g/a + s/h + f/h +
  V/(2 l h)) for a GPT of f = 4h and g = a (no recompute counted); the step time is those
  FLOPs over the GPUs' achieved FLOP/s. The README names the software's overlaps: the
  data-parallel gradient reduce-scatter and parameter all-gather (``--overlap-grad-reduce
  --overlap-param-gather``, which run Megatron's distributed optimizer: ZeRO 1), the
  tensor-parallel communication (``--tp-comm-overlap``, which runs sequence parallelism:
  described as the cluster's ``tp_comm_overlap``) and the pipeline's. It is silent on the
  micro-batch, the schedule and recompute. Megatron-LM has no default micro-batch
  (``--micro-batch-size`` defaults to None and must be given): one sequence a micro-batch is
  taken from the GPT-3 example of that release (``examples/gpt3/train_gpt3_175b_distributed.sh``
  at core_v0.8.0: ``--micro-batch-size 1``); 1F1B is its schedule without virtual stages;
  recompute is left to the search (Megatron's default is none). Megatron-Core
  r0.8.0 sums bf16 runs' gradients in float32 (``accumulate_allreduce_grads_in_fp32`` forced
  on), computes its vocabulary-parallel cross-entropy in float32, and runs attention through
  Transformer Engine, which prefers cuDNN's fused kernel on Hopper.
- torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (pytorch/torchtitan), Tables 1
  and 3: Llama 3.1 8B with FSDP on 8 and 128 H100s (Grand Teton: 96 GB HBM2e at 2.4 TB/s,
  NVLink in a host, 400 Gb/s RDMA a GPU, a 500 W power limit), local batch 2, selective
  activation checkpointing, tokens a second a GPU; the rows without torch.compile or Float8
  (bf16, the eager operators autoshard prices). The sequence (8192) and the selective policy
  (``selective_ac_option = 'op'``: the matrix products' outputs kept, the rest run again, as
  autoshard's ``selective``) are those of ``train_configs/llama3_8b.toml`` at the benchmark's
  torchtitan commit 9dec370. That policy also keeps the attention's output and recomputes
  every second matrix product of a block, which autoshard's ``selective`` does not (under 1%
  of the step at the cost model's prices). The benchmark's note 2 puts its H100s' peak
  between the NVL's and the SXM's (835 and 989 dense bf16 TFLOP/s): the middle, 912, is
  taken. torch's SDPA ran FlashAttention-2 then (cuDNN's kernel was off by default,
  pytorch/pytorch#142132); the loss is ``cross_entropy(pred.float(), labels)``, the optimizer
  torch's foreach AdamW. Its RMSNorm (``torchtitan/models/norms.py`` at that commit,
  ``norm_type = "rmsnorm"``) computes in float32: the run is planned on autoshard's Llama with
  that norm (``titan_llama``, through ``--model-fn``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from autoshard.models.gpt import GPT, CausalSelfAttention, GPTConfig
from autoshard.models.llama import Llama, LlamaConfig, RMSNorm

#: Megatron-LM README, model table: (name, heads, hidden, layers, tp, pp, dp, GPUs, batch,
#: achieved teraFLOP/s per GPU)
MEGATRON_CORE = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
MEGATRON_SEQ, MEGATRON_VOCAB = 4096, 131072

#: torchtitan's H100 benchmarks, Tables 1 and 3 (FSDP rows, no torch.compile nor Float8):
#: (table, GPUs, global batch, tokens a second a GPU)
TORCHTITAN = [("Table 1", 8, 16, 5762), ("Table 3", 128, 256, 5605)]
LLAMA3_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
             "vocab": 128256, "seq": 8192}  # fmt: skip


#: bytes a logit element moves through memory in the runs' cross-entropy, forward and
#: backward, counted from their code. Megatron-Core r0.8.0's vocab-parallel cross-entropy
#: (``tensor_parallel/cross_entropy.py``): forward a float32 copy of the bf16 logits (read 2,
#: write 4), the max (read 4), the shift, the exponential and the division in place (read and
#: write 4 each), the sum (read 4); backward the product with the loss's gradient in place
#: (8) and autograd's cast of the float32 gradient to the bf16 logits' (read 4, write 2).
#: torchtitan's ``cross_entropy(pred.float(), labels)``: forward the copy (6) and the
#: log-softmax (three reads, one write: 16); backward nll's zero-filled gradient (write 4),
#: log-softmax's backward (three reads, one write: 16) and the cast back (6).
MCORE_LOSS_BYTES = [6.0 + 4 + 8 + 8 + 4 + 8, 8.0 + 6]
TITAN_LOSS_BYTES = [6.0 + 16, 4.0 + 16 + 6]


#: the share of the H100 SXM's 989 dense bf16 TFLOP/s each run's attention kernel reaches,
#: forward (causal) and backward, head size 128, as FlashAttention-3's paper (Shah et al.
#: 2024, arXiv 2407.08608, Figures 5-6, H100 80GB SXM5) measured them: cuDNN's fused
#: attention, which Transformer Engine runs on Hopper in preference to FlashAttention
#: (Megatron-Core's), 518 and 499 TFLOP/s at sequence 4096; FlashAttention-2, torch's SDPA
#: kernel of December 2024 (cuDNN's then off by default: pytorch/pytorch#142132), 333 and
#: 318 at sequence 8192 (torchtitan's). Read again from the figures' bar labels: the forward
#: numbers are those of the lower of the paper's two head-size-128 forward panels (the other,
#: without the causal mask, gives cuDNN 609 and FlashAttention-2 368 at 4096); the backward
#: ones are its head-size-128 backward panel's, whose mask the labels do not say
CUDNN_ATTENTION = [518 / 989, 499 / 989]

#: the H100 SXM's datasheet HBM3 bandwidth, of which the ``dgx-h100`` preset's 3.0 TB/s is
#: what streaming copies reach (docs/cost.md, Presets)
H100_SXM_HBM = 3.35e12
FLASH2_ATTENTION = [333 / 989, 318 / 989]


class HeadGroupedAttention(CausalSelfAttention):
    """Megatron-Core's self-attention (``megatron/core/transformer/attention.py``,
    ``get_query_key_value_tensors``, r0.8.0): its fused projection's output is laid out by
    head, each head's query, key and value side by side, and viewed ``[.., heads, 3 x head]``
    before the split, so a tensor-parallel split of the projection's columns holds whole
    heads (autoshard's GPT lays the three out one after the other)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, h = x.shape
        head_dim = h // self.num_heads
        qkv = self.c_attn(x).view(B, S, self.num_heads, 3 * head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(head_dim, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(B, S, h)
        return self.resid_dropout(self.c_proj(y))


def mcore_gpt(heads: int, hidden: int, layers: int) -> dict:
    """A weak-scaling run's GPT as Megatron-Core runs it, for ``autoshard plan --model-fn``:
    autoshard's GPT, its output layer untied, with Megatron-Core's head-grouped attention,
    on the meta device (``--batch`` sizes its example batch)."""
    config = GPTConfig(
        vocab_size=MEGATRON_VOCAB, block_size=MEGATRON_SEQ, num_layers=layers, num_heads=heads,
        hidden=hidden, tie_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = GPT(config)
        for block in model.layers:
            block.attn = HeadGroupedAttention(config)
    return {"model": model, "batch": config.example_batch(1)}


#: each Megatron-Core run's ``--model-fn`` name in this module (``mcore_gpt_1_7b``, ...)
MCORE_FNS = {row[0]: "mcore_gpt_" + row[0].lower().replace(".", "_") for row in MEGATRON_CORE}
for _name, _heads, _hidden, _layers, *_ in MEGATRON_CORE:
    globals()[MCORE_FNS[_name]] = functools.partial(mcore_gpt, _heads, _hidden, _layers)


class Float32RMSNorm(RMSNorm):
    """torchtitan's ``RMSNorm`` of the benchmark's commit (``torchtitan/models/norms.py``,
    ``norm_type = "rmsnorm"`` in ``llama3_8b.toml``): the input cast to float32, normalized
    in float32, cast back, then scaled by the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight  # its type_as(x): a cast to x's dtype


def titan_llama() -> dict:
    """Llama 3.1 8B as torchtitan's benchmark ran it, for ``autoshard plan --model-fn``:
    autoshard's Llama with torchtitan's float32 RMSNorm, on the meta device (``--batch`` and
    ``--seq`` size its example batch)."""
    s = LLAMA3_8B
    config = LlamaConfig(
        vocab_size=s["vocab"], max_seq=s["seq"], num_layers=s["layers"], num_heads=s["heads"],
        num_kv_heads=s["kv_heads"], hidden=s["hidden"], ffn_hidden=s["ffn"],
        rope_theta=500000.0,
    )  # fmt: skip
    with torch.device("meta"):
        model = Llama(config)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, RMSNorm):
                    setattr(module, name, Float32RMSNorm(config.hidden, config.norm_eps))
    return {"model": model, "batch": config.example_batch(1)}


def _megatron_seconds(hidden, layers, gpus, batch, tflops) -> float:
    s, v, h, n = MEGATRON_SEQ, MEGATRON_VOCAB, hidden, layers
    flops = 12 * batch * s * n * h * h * (1 + 1 + s / h + 4 + v / (2 * n * h))
    return flops / (gpus * tflops * 1e12)


def runs() -> list[dict]:
    """Every published H100 run: its source, shape, configuration and step seconds."""
    out = []
    for name, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops in MEGATRON_CORE:
        assert tp * pp * dp == gpus
        out.append({
            "source": "megatron-core-readme", "run": name, "model": "gpt", "heads": heads,
            "hidden": hidden, "layers": layers, "seq": MEGATRON_SEQ, "vocab": MEGATRON_VOCAB,
            "tp": tp, "pp": pp, "gpus": gpus, "batch": batch,
            "microbatches": batch // dp, "schedule": "1f1b", "virtual_stages": 1,
            "recompute": None, "sequence_parallel": tp > 1, "zero": 1, "precision": "bf16",
            "model_fn": f"bench.published_h100:{MCORE_FNS[name]}",
            "cluster": "mcore", "seconds": _megatron_seconds(hidden, layers, gpus, batch, tflops),
        })  # fmt: skip
    for table, gpus, batch, tps in TORCHTITAN:
        out.append({
            "source": "torchtitan-2024-12", "run": f"8B FSDP {gpus} ({table})", "model": "llama",
            "model_fn": "bench.published_h100:titan_llama",
            **LLAMA3_8B, "tp": 1, "pp": 1, "gpus": gpus, "batch": batch, "microbatches": 1,
            "schedule": "1f1b", "virtual_stages": 1, "recompute": "selective",
            "sequence_parallel": False, "zero": 3, "precision": "bf16", "cluster": "titan",
            "seconds": batch * LLAMA3_8B["seq"] / (gpus * tps),
        })  # fmt: skip
    return out


def clusters(folder: Path) -> dict[str, Path]:
    """The H100 clusters the runs ran on, as cluster spec files: the ``dgx-h100`` preset for
    Megatron-Core's runs with their tensor-parallel overlap (``--tp-comm-overlap``), and
    Grand Teton's memory, network and peak for torchtitan's."""
    from autoshard.cost import cluster_spec

    base = cluster_spec("dgx-h100").to_json()
    # the README's --tp-comm-overlap; the loss as Megatron-Core r0.8.0's vocab-parallel
    # cross-entropy runs it (LOSS_BYTES)
    mcore = base | {
        "tp_comm_overlap": True, "loss_bytes": MCORE_LOSS_BYTES,
        "attention_efficiency": CUDNN_ATTENTION,
    }  # fmt: skip
    # its H100s' dense bf16 peak lies between the NVL's 835 and the SXM's 989 TFLOP/s (the
    # benchmark's note 2): the middle of that range
    peak = (835e12 + 989e12) / 2
    flops = base["flops"] | {"bfloat16": peak, "float16": peak}
    # the benchmark's hardware: 96 GB of HBM2e at 2.4 TB/s a GPU, 400 Gb/s a GPU across hosts,
    # both datasheet rates: taken at the shares of them the preset takes of the SXM's (HBM:
    # 3.0 of its 3.35 TB/s, what streaming copies reach; the same 400 Gb/s NIC: 46 GB/s)
    hbm = 2.4e12 * base["memory_bandwidth"] / H100_SXM_HBM
    titan = base | {
        "memory_bytes": 96e9, "memory_bandwidth": hbm, "flops": flops,
        "loss_bytes": TITAN_LOSS_BYTES, "optimizer_passes": 20.0,  # foreach AdamW
        "attention_efficiency": FLASH2_ATTENTION,
    }  # fmt: skip
    out = {}
    for name, data in (("mcore", mcore), ("titan", titan)):
        path = folder / f"h100-{name}.json"
        path.write_text(json.dumps(data))
        out[name] = path
    return out


#: how each H100 source's software and hardware is described in the table's text
DESCRIBED = (
    'Published H100 runs: Megatron-LM\'s README ("Training Speed and Scalability", the model '
    "table added in commit f2e5db402c: GPT weak scaling on Megatron-Core r0.8.0, vocabulary "
    "131072, sequence 4096, bf16, the output layer's weight its own as the table's model sizes "
    "count it; teraFLOP/s per GPU turned into seconds an iteration by Megatron-LM's FLOPs count "
    "of that commit) and torchtitan's `benchmarks/llama3_h100_202412_torchtitan.md` (Tables 1 "
    "and 3: Llama 3.1 8B, FSDP, selective activation checkpointing, sequence 8192 from its "
    "`llama3_8b.toml`, the eager bf16 rows; tokens a second a GPU). Megatron-Core's runs "
    "planned as given on the `dgx-h100` preset, the model through `--model-fn "
    "bench.published_h100:mcore_gpt_<size>` (autoshard's GPT, its output layer untied, with "
    "Megatron-Core's attention, whose fused query-key-value projection is laid out by head "
    "so that a tensor-parallel split holds whole heads), and the software described "
    "(`h100-mcore.json`): attention by cuDNN's fused kernel, which Transformer Engine "
    "runs on Hopper, at the shares FlashAttention-3's paper measured for it (518 and 499 of 989 "
    "TFLOP/s forward and backward, head size 128, sequence 4096); the loss by Megatron-Core's "
    "vocabulary-parallel cross-entropy, float32 passes over the logits (`loss_bytes` 38 and 14 "
    "a logit, counted from its code); `tp_comm_overlap` for the README's `--tp-comm-overlap` (a "
    "tensor-parallel all-gather or reduce-scatter beside a matrix product runs in chunks under "
    "it); the distributed optimizer (`--zero 1`, its gradients reduce-scattered in float32 as "
    "Megatron does under bf16) and sequence parallelism where tp > 1 (`--sequence-parallel`, "
    "which `--tp-comm-overlap` runs); where the README is silent: one sequence a micro-batch "
    "as the GPT-3 example script of Megatron-Core r0.8.0 runs (`--micro-batch-size 1`; "
    "Megatron-LM itself has no default), 1F1B, recompute left to the search (Megatron's "
    "default is none). torchtitan's on Grand Teton (`h100-titan.json`: 96 GB of HBM2e at "
    "2.4 TB/s and 400 Gb/s a GPU, datasheet rates taken at the shares the `dgx-h100` preset "
    "takes of its own, 2.15 TB/s streamed (3.0 of 3.35) and 46 GB/s; a peak of 912 dense bf16 "
    "TFLOP/s, the middle of the NVL-to-SXM range the benchmark's note 2 gives for its 500 W "
    "H100s; FlashAttention-2, torch's SDPA kernel then, at the paper's 333 and 318 of 989 at "
    "sequence 8192; its `cross_entropy` of the logits cast to float32, `loss_bytes` 22 and 26; "
    "foreach AdamW, 20 passes) with `--zero 3 --recompute selective`. Its `op` policy keeps the "
    "attention's output and recomputes every second matrix product of a block (wk, wo, w3), "
    "where autoshard's `selective` keeps every product and recomputes the attention: 4.1 "
    "against 3.6 ms a layer at the cost model's prices, under 1% of the step, not priced. Its "
    "model is planned through `--model-fn bench.published_h100:titan_llama`: autoshard's Llama "
    "with torchtitan's RMSNorm, which casts its input to float32, normalizes and casts back "
    "(its rotary embedding's float32 complex product stays priced as autoshard's bf16 one). "
    "No parameter was set from these runs."
)
