"""Transformer descriptions: exact parameter counts (vs a real TinyGPT), published preset sizes,
validation messages, and TinyGPT's attention against PyTorch's reference implementation."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from dtlib.models import PRESETS, TinyGPT, TransformerConfig, get_preset, num_parameters, tiny_gpt_config
from dtlib.models.gpt import Attention

VARIANTS = [dict(activation=a, kv_heads=kv, bias=b, norm=n, position=p, tied_embeddings=t)
            for a, kv, b, n, p, t in itertools.product(
                ("gelu", "swiglu"), (4, 1), (True, False), ("layernorm", "rmsnorm"),
                ("learned", "rope", "alibi"), (True, False))]


@pytest.mark.parametrize("overrides", VARIANTS + [dict(embedding_norm=True, ffn=100, layers=3),
                                                  dict(hidden=96, heads=6, kv_heads=2, vocab=77, seq=9)])
def test_parameter_count_is_exact(overrides):
    cfg = tiny_gpt_config(**overrides)
    model = TinyGPT(cfg)
    assert cfg.num_parameters() == num_parameters(cfg) == sum(p.numel() for p in model.parameters())


# Published totals. Exact where the source gives an exact count; BERT's count leaves out the
# token-type table (2 x h) and pooler (h^2 + h) of HF's BertModel (see presets.py).
PUBLISHED = {
    "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800, "bloom-176b": 176_247_271_424,
    "mistral-7b": 7_241_732_096, "mixtral-8x7b": 46_702_792_704,
    "bert-base": 109_482_240 - 2 * 768 - (768 ** 2 + 768),
    "bert-large": 335_141_888 - 2 * 1024 - (1024 ** 2 + 1024),
}
APPROXIMATE = {"gpt3-175b": (175e9, 0.005), "megatron-22b": (22e9, 0.01), "capstone-10b": (10e9, 0.03),
               # rounded published totals; tests/test_models_moe.py checks these and their actives
               "deepseek-v2-lite": (15.7e9, 0.005), "deepseek-v3": (671e9, 0.001),
               "qwen3-30b-a3b": (30.5e9, 0.002), "qwen3-235b-a22b": (235e9, 0.002),
               "gpt-oss-120b": (116.83e9, 0.0001), "mixtral-8x22b": (141e9, 0.004)}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_match_published_sizes(name):
    cfg = get_preset(name)
    assert cfg.source, f"{name} has no source"
    if name in PUBLISHED:
        assert cfg.num_parameters() == PUBLISHED[name]
    else:
        value, rel = APPROXIMATE[name]
        assert cfg.num_parameters() == pytest.approx(value, rel=rel)


def test_get_preset_is_case_insensitive_and_lists_valid_names():
    assert get_preset(" Llama3-8B ") is PRESETS["llama3-8b"]
    with pytest.raises(ValueError, match="valid presets: .*llama3-70b"):
        get_preset("llama-9")


def test_defaults_and_moe_counts():
    gelu = tiny_gpt_config()
    assert gelu.kv_heads == gelu.heads and gelu.ffn == 4 * gelu.hidden
    assert get_preset("llama2-7b").with_(ffn=None).ffn == 11008  # Llama's SwiGLU rounding rule
    moe = tiny_gpt_config(moe_experts=8, moe_top_k=2, bias=False)
    dense = tiny_gpt_config(bias=False)
    mlp = 2 * 64 * 256
    assert moe.num_parameters() - dense.num_parameters() == 2 * (7 * mlp + 64 * 8)
    assert moe.active_parameters() == moe.num_parameters() - 2 * 6 * mlp


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "qwen3-30b-a3b", "gpt-oss-120b", "mistral-7b"])
def test_tinygpt_refuses_the_shapes_it_does_not_build(preset):
    """The analytic count follows these models (tests/test_models_moe.py); TinyGPT would build
    another model, so it says so before allocating anything."""
    with pytest.raises(ValueError, match="TinyGPT builds every layer alike .* cannot build"):
        TinyGPT(get_preset(preset).with_(layers=2, hidden=64, heads=4, kv_heads=4, vocab=50, seq=8))


BAD_SHAPES = [
    (dict(hidden=65), "hidden \\(65\\) must be divisible by heads \\(4\\)"),
    (dict(kv_heads=3), "multiple of kv_heads"),
    (dict(layers=0), "layers must be an integer >= 1, got 0"),
    (dict(vocab=-5), "vocab must be an integer >= 1, got -5"),
    (dict(seq=2.5), "seq must be an integer >= 1, got 2.5"),
    (dict(activation="relu"), "activation must be one of 'gelu', 'swiglu', got 'relu'"),
    (dict(bias="no"), "bias must be True or False, got 'no'"),
    (dict(tied_embeddings=1), "tied_embeddings must be True or False, got 1"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(position="sinusoidal"), "position must be one of"),
    (dict(moe_experts=1), "moe_experts must be 0 \\(dense\\) or an integer >= 2"),
    (dict(moe_experts=4, moe_top_k=5), "moe_top_k must be an integer from 1 to 4, got 5"),
    (dict(moe_top_k=2), "moe_top_k must be 0 for a dense model \\(set moe_experts >= 2 for MoE\\), got 2"),
    (dict(hidden=60, heads=4, position="rope", kv_heads=4), "rope needs an even head dimension"),
]


@pytest.mark.parametrize("overrides,message", BAD_SHAPES)
def test_bad_shapes_say_what_is_wrong(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**overrides)


def test_config_is_frozen_and_hashable():
    cfg = tiny_gpt_config()
    with pytest.raises(Exception):
        cfg.layers = 3
    assert cfg == tiny_gpt_config() and hash(cfg) == hash(tiny_gpt_config())


def rope_reference(x, base=10000.0):
    """Rotary embeddings written independently of dtlib, in the complex form of Llama's
    ``apply_rotary_emb`` (Su et al. 2021, eq. 34): a pair of channels is one complex number,
    multiplied by exp(i * pos * theta_k), theta_k = base^(-2k/d). dtlib pairs channel k with
    channel k + d/2 (the half-split "rotate_half" layout of GPT-NeoX and Hugging Face's Llama),
    not adjacent channels (2k, 2k+1) as Meta's original Llama code does; the pairing here is
    the half-split one. ``x``: [..., s, d]; computed in float64."""
    s, d = x.shape[-2], x.shape[-1]
    theta = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]  # [s, d/2]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * torch.polar(
        torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def alibi_bias(heads, s):
    """ALiBi (Press et al. 2022, Sec. 3): head h adds slope_h * (j - i) to the score of query i
    on key j; for n heads (a power of 2) the slopes are the geometric sequence that starts at
    2^(-8/n) with that same ratio, i.e. slope_h = 2^(-8 (h+1) / n)."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    pos = torch.arange(s, dtype=torch.float32)
    return slopes[:, None, None] * (pos[None, :] - pos[:, None])  # [heads, s, s]


@pytest.mark.parametrize("kv_heads,position", [(4, "learned"), (2, "rope"), (1, "learned"), (4, "rope"),
                                               (4, "alibi"), (2, "alibi")])
def test_attention_matches_pytorch_sdpa(kv_heads, position):
    torch.manual_seed(0)
    cfg = tiny_gpt_config(kv_heads=kv_heads, position=position)
    attn = Attention(cfg, dropout=0.0)
    x = torch.randn(2, cfg.seq, cfg.hidden)
    b, s, h, d = *x.shape, cfg.head_dim
    q, k, v = attn.qkv(x).split([h, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(b, s, cfg.heads, d).transpose(1, 2)
    k, v = (t.view(b, s, kv_heads, d).transpose(1, 2) for t in (k, v))
    if position == "rope":
        q, k = rope_reference(q), rope_reference(k)
    groups = cfg.heads // kv_heads  # head j uses KV head j // groups
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if position == "alibi":  # the ALiBi bias plus the causal mask, as one additive float mask
        causal = torch.full((s, s), float("-inf")).triu(1)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(cfg.heads, s) + causal)
    else:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = ref.transpose(1, 2).reshape(b, s, h)
    torch.testing.assert_close(attn(x), attn.proj(ref), atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_the_distance():
    """The defining property of RoPE (Su et al. 2021, Sec. 3.2): with the same query and key
    content at every position, q_i . k_j is a function of i - j only, and it does vary with it."""
    torch.manual_seed(0)
    cfg = tiny_gpt_config(position="rope")
    attn = Attention(cfg, dropout=0.0)
    s, d = cfg.seq, cfg.head_dim
    q = attn._rope(torch.randn(d).expand(s, d), s)
    k = attn._rope(torch.randn(d).expand(s, d), s)
    scores = q @ k.T
    for offset in range(-(s - 1), s):
        diagonal = scores.diagonal(offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-4, rtol=1e-4)
    by_distance = torch.stack([scores.diagonal(o)[0] for o in range(s)])
    assert (by_distance.max() - by_distance.min()) > 0.1 * by_distance.abs().max()
    torch.testing.assert_close(q.norm(dim=-1), torch.full((s,), float(q[0].norm())))  # a rotation


def test_tinygpt_forward_and_errors():
    model = TinyGPT(tiny_gpt_config(), dropout=0.1)
    idx = torch.randint(0, 256, (3, 20))
    assert model(idx).shape == (3, 20, 256)
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))  # no dropout in eval
    with pytest.raises(ValueError, match="exceeds the configured seq=32"):
        model(torch.randint(0, 256, (1, 33)))
    with pytest.raises(ValueError, match="LongTensor"):
        model(torch.zeros(1, 4))
    moe = tiny_gpt_config(moe_experts=4, moe_top_k=2)
    assert sum(p.numel() for p in TinyGPT(moe).parameters()) == moe.num_parameters()
    with pytest.raises(ValueError, match="dropout must be in"):
        TinyGPT(tiny_gpt_config(), dropout=1.5)


def test_tied_embeddings_share_storage():
    model = TinyGPT(tiny_gpt_config(tied_embeddings=True))
    assert model.lm_head.weight is model.wte.weight
    # the description counts the tied matrix once, as the model holds it once
    tied = tiny_gpt_config(tied_embeddings=True)
    untied = tiny_gpt_config(tied_embeddings=False)
    assert num_parameters(tied) == sum(p.numel() for p in model.parameters())
    assert num_parameters(untied) - num_parameters(tied) == untied.vocab * untied.hidden


def test_activation_conventions_today_and_the_papers():
    """Every model, preset or custom, is counted with today's kernels unless asked; the paper's
    GPT convention is one name away, and single flags override either."""
    from dtlib.analytic.presets import ACTIVATION_CONVENTIONS, KORTHIKANTI_2022, TODAY, activation_convention

    assert TODAY.flash_attention and not TODAY.dropout
    assert not KORTHIKANTI_2022.flash_attention and KORTHIKANTI_2022.dropout
    assert set(ACTIVATION_CONVENTIONS) == {"today", "korthikanti-2022"}
    chosen, note = activation_convention()
    assert chosen.flash_attention and not chosen.dropout and "'today'" in note[0]
    chosen, note = activation_convention("korthikanti-2022", dropout=False)
    assert not chosen.flash_attention and not chosen.dropout and "explicit attention" in note[0]
    with pytest.raises(ValueError, match="unknown activation convention 'gpt'; valid: today, korthikanti-2022"):
        activation_convention("gpt")
