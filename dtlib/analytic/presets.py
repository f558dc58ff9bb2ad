"""Published model shapes, each with where the numbers come from.

Counts are of the decoder description in :mod:`dtlib.analytic.config`; the tests compare each
preset's ``num_parameters()`` with its published total.
"""
from __future__ import annotations

from dataclasses import dataclass

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig

__all__ = ["PRESETS", "get_preset", "Training", "TODAY", "KORTHIKANTI_2022", "ACTIVATION_CONVENTIONS",
           "activation_convention"]

_LLAMA = dict(activation="swiglu", bias=False, norm="rmsnorm", position="rope", tied_embeddings=False)

# The fields that change the model but not its count (rope_theta, rope_scaling and its factor,
# norm_eps, qk_norm, router_score / router_expert_bias / routed_scaling, attention_sinks,
# activation_clamp) are each preset's HF config.json, the one its source names: "rope_theta",
# "rope_scaling" (type yarn, "factor"), "rms_norm_eps" / "layer_norm_epsilon" / "layer_norm_eps",
# Qwen3's q_norm/k_norm (Qwen3Attention), DeepSeek-V3's "scoring_func": "sigmoid", "topk_method":
# "noaux_tc" (the expert bias) and "routed_scaling_factor": 2.5, GPT-OSS's "rope_theta": 150000,
# "rope_scaling" yarn factor 32, attention "sinks" and "swiglu_limit": 7.0. Left at the defaults
# (RoPE base 10000, eps 1e-5, softmax routing) where the config.json has them.
PRESETS: dict[str, TransformerConfig] = {c.name: c for c in [
    TransformerConfig(name="gpt3-175b", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048,
                      tied_embeddings=True,
                      source="Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 "
                             "(GPT-2 vocabulary 50257, tied embeddings)"),
    TransformerConfig(name="megatron-22b", layers=48, hidden=6144, heads=64, vocab=51200, seq=2048,
                      tied_embeddings=True,
                      source="Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large "
                             "Transformer Models', Table 3 (22B)"),
    TransformerConfig(name="llama2-7b", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096,
                      ffn=11008, **_LLAMA,
                      source="Touvron et al. 2023, 'Llama 2', Table 1; HF meta-llama/Llama-2-7b-hf "
                             "config.json (6,738,415,616 parameters)"),
    TransformerConfig(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256,
                      seq=8192, ffn=14336, **_LLAMA,
                      rope_theta=500000.0,
                      source="Llama Team 2024, 'The Llama 3 Herd of Models', Table 3; HF "
                             "meta-llama/Meta-Llama-3-8B config.json"),
    TransformerConfig(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256,
                      seq=8192, ffn=28672, **_LLAMA,
                      rope_theta=500000.0,
                      source="Llama Team 2024, 'The Llama 3 Herd of Models', Table 3; HF "
                             "meta-llama/Meta-Llama-3-70B config.json"),
    TransformerConfig(name="llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                      vocab=128256, seq=8192, ffn=53248, **_LLAMA,
                      rope_theta=500000.0,
                      source="Llama Team 2024, 'The Llama 3 Herd of Models', Table 3 (pre-training "
                             "seq 8192); HF meta-llama/Llama-3.1-405B config.json"),
    TransformerConfig(name="bloom-176b", layers=70, hidden=14336, heads=112, vocab=250880, seq=2048,
                      position="alibi", tied_embeddings=True, embedding_norm=True,
                      source="BigScience 2022, 'BLOOM', Table 3; HF bigscience/bloom config.json "
                             "(176,247,271,424 parameters)"),
    # BERT is an encoder; the decoder description matches its parameter layout except the 2 x h
    # token-type table and the pooler (h^2 + h), which it leaves out (BERT's embedding LayerNorm
    # stands in for the final norm: same size).
    TransformerConfig(name="bert-base", layers=12, hidden=768, heads=12, vocab=30522, seq=512,
                      tied_embeddings=True,
                      norm_eps=1e-12,
                      source="Devlin et al. 2019, 'BERT', Sec. 3 (110M); HF bert-base-uncased "
                             "(BertModel 109,482,240 incl. token types and pooler)"),
    TransformerConfig(name="bert-large", layers=24, hidden=1024, heads=16, vocab=30522, seq=512,
                      tied_embeddings=True,
                      norm_eps=1e-12,
                      source="Devlin et al. 2019, 'BERT', Sec. 3 (340M); HF bert-large-uncased "
                             "(BertModel 335,141,888 incl. token types and pooler)"),
    # ---- mixture of experts, MLA, sliding windows (docs/models.md: the parameter check table) ----
    TransformerConfig(name="mistral-7b", layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000,
                      seq=8192, ffn=14336, sliding_window=4096, **_LLAMA,
                      source="Jiang et al. 2023, 'Mistral 7B', Table 1 (window 4096, context 8192); HF "
                             "mistralai/Mistral-7B-v0.1 config.json (7,241,732,096 parameters)"),
    TransformerConfig(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000,
                      seq=32768, ffn=14336, moe_experts=8, moe_top_k=2, **_LLAMA,
                      rope_theta=1e6,
                      source="Jiang et al. 2024, 'Mixtral of Experts', Table 1 (shape, 32k "
                             "context) and Sec. 1 (47B total, 13B active; Mistral AI's release "
                             "post: 46.7B, 12.9B); HF mistralai/Mixtral-8x7B-v0.1 config.json"),
    TransformerConfig(name="mixtral-8x22b", layers=56, hidden=6144, heads=48, kv_heads=8, vocab=32000,
                      seq=65536, ffn=16384, moe_experts=8, moe_top_k=2, **_LLAMA,
                      rope_theta=1e6,
                      source="Mistral AI 2024, 'Cheaper, Better, Faster, Stronger' (Mixtral 8x22B release "
                             "post: 141B total, 39B active, 64K context); HF mistralai/Mixtral-8x22B-v0.1 "
                             "config.json; NeMo MixtralConfig8x22B (56 layers, hidden 6144, 48 heads, "
                             "FFN 16384, 8 query groups, untied embeddings)"),
    TransformerConfig(name="deepseek-v2-lite", layers=27, hidden=2048, heads=16, vocab=102400,
                      seq=4096, ffn=10944, moe_ffn=1408, moe_experts=64, moe_top_k=6,
                      moe_shared_experts=2, moe_dense_layers=1, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, **_LLAMA,
                      rope_scaling="yarn", rope_scaling_factor=40.0, norm_eps=1e-6,
                      source="DeepSeek-AI 2024, 'DeepSeek-V2', App. B (15.7B total, 2.4B active; "
                             "no query compression); HF deepseek-ai/DeepSeek-V2-Lite config.json "
                             "(q_lora_rank null, first_k_dense_replace 1)"),
    TransformerConfig(name="deepseek-v3", layers=61, hidden=7168, heads=128, vocab=129280,
                      seq=4096, ffn=18432, moe_ffn=2048, moe_experts=256, moe_top_k=8,
                      moe_shared_experts=1, moe_dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, **_LLAMA,
                      rope_scaling="yarn", rope_scaling_factor=40.0, norm_eps=1e-6, router_score="sigmoid", router_expert_bias=True, routed_scaling=2.5,
                      source="DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', Sec. 4.2 (671B total, "
                             "37B active; pre-training seq 4K) and README_WEIGHTS.md (main model "
                             "671B, 36.6B active incl. the 0.9B output head; the MTP module, 11.5B "
                             "unique parameters, left out); HF deepseek-ai/DeepSeek-V3 config.json"),
    TransformerConfig(name="qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4,
                      head_dim=128, vocab=151936, seq=4096, ffn=6144, moe_ffn=768, moe_experts=128,
                      moe_top_k=8, **_LLAMA,
                      rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                      source="Qwen Team 2025, 'Qwen3 Technical Report', Table 2 (MoE shapes; "
                             "pre-training seq 4096, Sec. 3.2); HF Qwen/Qwen3-30B-A3B model card "
                             "(30.5B total, 3.3B active) and config.json (q/k RMSNorms of head_dim)"),
    TransformerConfig(name="qwen3-235b-a22b", layers=94, hidden=4096, heads=64, kv_heads=4,
                      head_dim=128, vocab=151936, seq=4096, ffn=12288, moe_ffn=1536,
                      moe_experts=128, moe_top_k=8, **_LLAMA,
                      rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                      source="Qwen Team 2025, 'Qwen3 Technical Report', Table 2 (MoE shapes); HF "
                             "Qwen/Qwen3-235B-A22B model card (235B total, 22B active) and "
                             "config.json (q/k RMSNorms of head_dim)"),
    TransformerConfig(name="gpt-oss-120b", layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64,
                      vocab=201088, seq=4096, ffn=2880, moe_experts=128, moe_top_k=4,
                      sliding_window=128, global_attention_every=2, activation="swiglu", bias=True,
                      norm="rmsnorm", position="rope", tied_embeddings=False,
                      rope_theta=150000.0, rope_scaling="yarn", rope_scaling_factor=32.0, attention_sinks=True, router_bias=True,
                      activation_clamp=7.0,
                      source="OpenAI 2025, 'gpt-oss-120b & gpt-oss-20b Model Card', Table 1 (116.83B "
                             "total, 5.13B active without the input embedding; window 128 on "
                             "alternate layers; initial context 4096); HF openai/gpt-oss-120b "
                             "config.json (attention_bias true, expert biases, attention sinks and "
                             "the router bias)"),
    # The capstone's model: Llama-2-13B widths with 36 layers -> ~10.2B; heads 40 and kv_heads 8
    # allow TP 1/2/4/8, 36 layers allow PP 1/2/3/4/6/9/12.
    TransformerConfig(name="capstone-10b", layers=36, hidden=5120, heads=40, kv_heads=8, vocab=32000,
                      seq=4096, ffn=13824, **_LLAMA,
                      source="dtlib capstone design (Llama-2 13B widths, 36 layers, GQA 8)"),
]}


def get_preset(name: str) -> TransformerConfig:
    """The preset called ``name``, ignoring case, '-', '_' and spaces ("Llama-3 8B" -> llama3-8b)."""
    squash = lambda s: "".join(ch for ch in s.lower() if ch.isalnum())  # noqa: E731
    key = {squash(k): k for k in PRESETS}.get(squash(name))
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[key]


@dataclass(frozen=True)
class Training:
    """How the activations of a training run are counted, where that changes their memory: a
    FlashAttention-style kernel (Dao et al. 2022) never stores the s x s attention scores, which
    is the footprint of selective recompute (Korthikanti et al. 2022, Sec. 5: it drops exactly the
    5as/h term), and a model trained without dropout keeps no dropout masks."""
    flash_attention: bool
    dropout: bool
    source: str


# What dtlib assumes unless told otherwise, for presets and custom shapes alike: every framework
# in use trains with fused attention, and today's pre-training recipes use no dropout.
TODAY = Training(
    flash_attention=True, dropout=False,
    source="PyTorch SDPA, Transformer Engine DotProductAttention and flash-attn keep no s x s "
           "scores; HF Llama/Mistral/Qwen configs: attention_dropout 0.0, Megatron-Bridge recipes: "
           "hidden_dropout 0, attention_dropout 0")
# The paper's GPT convention: explicit attention storing the scores, dropout everywhere.
KORTHIKANTI_2022 = Training(
    flash_attention=False, dropout=True,
    source="Korthikanti et al. 2022, Sec. 4, Table 2: s b h (34 + 5 a s / h) bytes per layer")
ACTIVATION_CONVENTIONS: dict[str, Training] = {"today": TODAY, "korthikanti-2022": KORTHIKANTI_2022}


def activation_convention(convention: str | None = None, flash_attention: bool | None = None,
                          dropout: bool | None = None) -> tuple[Training, list[str]]:
    """The activation counting to use: ``convention`` (a key of :data:`ACTIVATION_CONVENTIONS`,
    default ``today``) with ``flash_attention`` / ``dropout`` overriding it where given. Returns it
    and one line saying what was assumed (for the output of ``dtlib memory`` and ``dtlib plan``)."""
    name = "today" if convention is None else convention
    if name not in ACTIVATION_CONVENTIONS:
        raise ValueError(f"unknown activation convention {name!r}; valid: {', '.join(ACTIVATION_CONVENTIONS)}")
    base = ACTIVATION_CONVENTIONS[name]
    flash = base.flash_attention if flash_attention is None else validate.boolean("flash_attention", flash_attention)
    drop = base.dropout if dropout is None else validate.boolean("dropout", dropout)
    chosen = Training(flash_attention=flash, dropout=drop, source=base.source)
    attention = ("FlashAttention-style attention (s x s scores not stored)" if flash
                 else "explicit attention (s x s scores and softmax stored)")
    note = (f"activations counted as convention {name!r}: {attention}, "
            f"{'dropout masks stored' if drop else 'no dropout'} ({base.source})")
    return chosen, [note]
