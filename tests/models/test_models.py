"""Reference models: shapes, losses, weight tying, export, meta construction, GQA and rotary."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard.models
from autoshard.models import GPT, MLP, GPTConfig, Llama, LlamaConfig, MLPConfig, reference_config
from autoshard.models import build as build_model
from autoshard.models.llama import apply_rotary

CONFIGS = {"mlp": MLPConfig, "gpt": GPTConfig, "llama": LlamaConfig}
MODELS = {"mlp": MLP, "gpt": GPT, "llama": Llama}
NAMES = sorted(CONFIGS)


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model with default config, in eval mode, and a batch of 3 for it."""
    config = CONFIGS[name]()
    torch.manual_seed(seed)
    model = MODELS[name](config).eval()
    x, targets = config.example_batch(3, torch.Generator().manual_seed(seed))
    return model, x, targets


def test_public_surface():
    assert sorted(autoshard.models.__all__) == sorted(
        ["MLP", "MLPConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MoE", "MoEConfig"]
        + ["DLRM", "DLRMConfig"]
        + ["REFERENCE_MODELS", "build", "reference_config"]
    )


def test_reference_config_maps_sizes_and_rejects_unknown_ones():
    llama = reference_config("llama", layers=3, hidden=64, heads=8, vocab=100, seq=32)
    assert (llama.num_layers, llama.hidden, llama.num_heads, llama.vocab_size) == (3, 64, 8, 100)
    assert llama.num_kv_heads == 8 and llama.ffn_hidden == 256  # follow heads and 4 x hidden
    assert reference_config("llama", heads=8, kv_heads=2).num_kv_heads == 2
    mlp = reference_config("mlp", hidden=20, vocab=5, seq=7)  # an MLP has no sequence
    assert (mlp.in_features, mlp.hidden, mlp.out_features) == (20, 80, 5)
    assert isinstance(build_model(reference_config("gpt", hidden=16, heads=2)), GPT)
    with pytest.raises(ValueError, match="unknown model 'bert'"):
        reference_config("bert")
    with pytest.raises(ValueError, match="unknown size 'depth'"):
        reference_config("gpt", depth=3)


@pytest.mark.parametrize(
    ("name", "shape"), [("mlp", (3, 8)), ("gpt", (3, 16, 64)), ("llama", (3, 16, 64))]
)
def test_logits_shape(name, shape):
    model, x, _ = build(name)
    assert model(x).shape == shape


@pytest.mark.parametrize("name", NAMES)
def test_loss_is_cross_entropy_of_logits(name):
    model, x, targets = build(name)
    logits = model(x)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    torch.testing.assert_close(model(x, targets), expected)


def test_sequences_shorter_than_the_block_work():
    model, idx, _ = build("gpt")
    assert model(idx[:, :5]).shape == (3, 5, 64)
    model, idx, _ = build("llama")
    torch.testing.assert_close(model(idx[:, :5]), model(idx)[:, :5])


@pytest.mark.parametrize("name", NAMES)
def test_init_is_seeded_and_follows_the_recipe(name):
    a, b = build(name, seed=1)[0], build(name, seed=1)[0]
    for (key, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=key)
        if key.endswith("bias"):
            assert not pa.any(), key
        elif "norm" in key or "ln_" in key:
            assert (pa == 1).all(), key
        else:
            assert 0.015 < pa.std() < 0.025, key


def test_gpt_lm_head_is_tied_to_wte():
    model = build("gpt")[0]
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert "wte.weight" in names and "lm_head.weight" in names
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_llama_ties_output_only_when_asked():
    assert Llama(LlamaConfig()).output.weight is not Llama(LlamaConfig()).tok_embeddings.weight
    tied = Llama(LlamaConfig(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_exported_program_matches_eager(name, dtype):
    model, x, targets = build(name)
    model = model.to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    program = torch.export.export(model, (x,), {"targets": targets}).run_decompositions({})
    loss = program.module()(x, targets=targets)
    assert loss.dtype == dtype and loss.shape == ()
    torch.testing.assert_close(loss, model(x, targets))


@pytest.mark.parametrize("name", NAMES)
def test_builds_on_meta(name):
    with torch.device("meta"):
        model = MODELS[name](CONFIGS[name]())
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_config_errors_name_the_sizes():
    with pytest.raises(ValueError, match=r"hidden\(30\).*num_heads\(4\)"):
        GPTConfig(hidden=30)
    with pytest.raises(ValueError, match=r"num_heads\(4\).*num_kv_heads\(3\)"):
        LlamaConfig(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"even head size"):
        LlamaConfig(hidden=12)
    with pytest.raises(ValueError, match=r"hidden\(0\)"):
        MLPConfig(hidden=0)


def repeated_kv_attention(attn: nn.Module, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Llama attention with kv heads repeated by repeat_interleave: the usual reference form."""
    B, S, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = apply_rotary(attn.wq(x).view(B, S, nh, hd).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.wk(x).view(B, S, nkv, hd).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(B, S, nkv, hd).transpose(1, 2)
    k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.wo(y.transpose(1, 2).reshape(B, S, nh * hd))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_repeated_heads(num_kv_heads):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_heads=4, num_kv_heads=num_kv_heads)).to(torch.float64)
    attn = model.layers[0].attention
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    cos, sin = model.rope_cos, model.rope_sin
    torch.testing.assert_close(attn(x, cos, sin), repeated_kv_attention(attn, x, cos, sin))


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    model = Llama(LlamaConfig()).to(torch.float64)
    cos, sin = model.rope_cos, model.rope_sin
    q, k = torch.randn(2, 1, 8, dtype=torch.float64).expand(2, 16, 8).unbind(0)
    scores = apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).T
    for shift in range(1, 4):
        # The tables are float32, so the identity holds to float32 rounding only.
        torch.testing.assert_close(
            scores[shift:, shift:], scores[:-shift, :-shift], rtol=1e-6, atol=1e-6
        )
    torch.testing.assert_close(apply_rotary(q, cos, sin)[0], q[0])
