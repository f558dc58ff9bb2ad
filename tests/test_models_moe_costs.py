"""What MoE, MLA, head_dim and sliding-window models cost: FLOPs (against Megatron-Core's
``num_floating_point_operations``), activation bytes per layer, parameters per pipeline stage and
GPU, and the GEMM shapes the step time sees (docs/models.md)."""
import numpy as np
import pytest

from dtlib.analytic.activations import layer_bytes, mean_layer_bytes
from dtlib.analytic.config import TransformerConfig, norm_params
from dtlib.analytic.flops import (flops_report, keys_per_query, layers_matmul_params,
                                  attention_flops_per_token, matmul_params_per_layer)
from dtlib.analytic.hardware import get_gpu
from dtlib.analytic.memory import memory_per_gpu, stage_parameters
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.vectorised import flops_batch, memory_batch
from dtlib.analytic.hardware import cluster
from dtlib.plan.gemm import attention_projections, transformer_compute
from dtlib.plan.search import search


def megatron_flops(cfg: TransformerConfig, batch: int) -> float:
    """A transcription of Megatron-LM's ``num_floating_point_operations`` (megatron/training/
    training.py, ``transformer_flops``, NVIDIA/Megatron-LM @ 001b00c) for a SwiGLU model with no
    MTP layers: the MLA branch when ``kv_lora_rank > 0``, else the GQA branch with ``kv_channels
    = head_dim``; ``moe_shared_expert_intermediate_size = shared x moe_ffn``; padded vocab = vocab."""
    h, s, a, L = cfg.hidden, cfg.seq, cfg.heads, cfg.layers
    fb, fma, ffn_expansion = 3, 2, 3
    pattern = [1 if (i >= cfg.moe_dense_layers and (i - cfg.moe_dense_layers) % cfg.moe_layer_freq == 0)
               and cfg.moe_experts else 0 for i in range(L)]
    num_moe, num_dense = sum(pattern), L - sum(pattern)
    if cfg.kv_lora_rank:
        qk, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank == 0:
            q_term = h * a * (qk + rope)
        else:
            q_term = cfg.q_lora_rank * (h + a * (qk + rope) + 1)
        attn = fb * fma * (q_term + cfg.kv_lora_rank * (h + a * (qk + v) + 1) + h * rope + (a * v) * h
                           + s * (a * (qk + rope)) / 2 + s * a * v / 2)
    else:
        q, kv = cfg.head_dim * a, cfg.head_dim * cfg.kv_heads
        attn = fb * fma * (h * (q + kv + kv) + q * s / 2 * 2 + q * h)
    shared_ffn = cfg.moe_shared_experts * (cfg.moe_ffn or 0)
    return batch * s * (fb * fma * h * ((cfg.ffn * ffn_expansion) * num_dense
                                        + ((cfg.moe_ffn or cfg.ffn) * cfg.moe_top_k * ffn_expansion) * num_moe
                                        + (shared_ffn * ffn_expansion) * num_moe)
                        + attn * L + fb * fma * h * cfg.vocab)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_model_flops_reproduce_megatron_core(name):
    """dtlib's causal count equals Megatron-Core's up to two terms it states: Megatron also counts
    each MLA latent RMSNorm as one FLOP per element per pass (its ``+ 1``), and dtlib also counts
    the h x E router matmul."""
    cfg, batch = get_preset(name), 3
    ours = flops_report(cfg, batch, attention="causal")["model_flops_per_step"]
    tokens = batch * cfg.seq
    norms = 6 * tokens * cfg.layers * (cfg.q_lora_rank + cfg.kv_lora_rank)
    router = 6 * tokens * cfg.moe_layers * cfg.hidden * cfg.moe_experts
    assert ours == pytest.approx(megatron_flops(cfg, batch) - norms + router, rel=1e-12)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b", "gpt-oss-120b", "mixtral-8x7b"])
def test_weight_flops_use_the_active_parameters(name):
    """The matmul weights a token meets (all layers + LM head) are the active parameters less what
    is not a matmul: the input embedding, the norms, the biases (two counts written apart)."""
    cfg = get_preset(name)
    n = cfg.numbers()
    norms = (2 * cfg.layers + 1) * norm_params(cfg.hidden, cfg.norm_has_bias)
    norms += (cfg.kv_lora_rank > 0) * cfg.layers * (cfg.q_lora_rank + cfg.kv_lora_rank)
    norms += cfg.qk_norm * cfg.layers * 2 * cfg.head_dim  # Qwen3's q/k RMSNorms
    norms += cfg.attention_sinks * cfg.layers * cfg.heads  # GPT-OSS's sinks: a logit per head, no matmul
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    biases = cfg.bias * cfg.layers * (q + 2 * kv + cfg.hidden)  # attention
    biases += cfg.bias * cfg.moe_layers * cfg.moe_top_k * (2 * cfg.moe_ffn + cfg.hidden)  # experts
    biases += cfg.router_bias * cfg.moe_layers * cfg.moe_experts  # GPT-OSS's router
    matmuls = layers_matmul_params(**n) + cfg.vocab * cfg.hidden
    assert matmuls == cfg.active_parameters(input_embedding=False) - norms - biases


def test_keys_per_query_counts_the_causal_band():
    """Exact identity with the number of unmasked (query, key) pairs of a causal sliding-window
    mask: s x keys = pairs - min(w, s)/2 (the continuous mean differs from the discrete one by
    w/2s keys, which is what keeps w >= s at Megatron's s/2)."""
    for s, w in ((64, 8), (64, 64), (64, 100), (50, 1), (64, 0)):
        i, j = np.indices((s, s))
        mask = (j <= i) & ((w == 0) | (i - j < w))
        span = s if w == 0 else min(w, s)
        assert s * keys_per_query(s, w, "causal") == pytest.approx(mask.sum() - span / 2, abs=1e-9)
        assert keys_per_query(s, w, "full") == span


def test_sliding_window_attention_flops():
    mistral = get_preset("mistral-7b")                       # window 4096 of 8192, every layer
    n = mistral.numbers()
    windowed = attention_flops_per_token(attention="causal", **n)
    full = attention_flops_per_token(attention="causal", **dict(n, sliding_window=0, sliding_layers=0))
    assert windowed / full == pytest.approx((4096 - 4096 ** 2 / (2 * 8192)) / 4096)   # 0.75
    oss = get_preset("gpt-oss-120b")                          # 18 of 36 layers see 128 keys
    n = oss.numbers()
    per_layer = 2 * 64 * (64 + 64)
    expected = per_layer * (18 * 4096 / 2 + 18 * (128 - 128 ** 2 / (2 * 4096)))
    assert attention_flops_per_token(attention="causal", **n) == pytest.approx(expected)


def test_mla_layer_activations_by_hand():
    """One DeepSeek-V3 MLA layer with a dense SwiGLU MLP (s = 4096, b = 1, h = 7168, 128 heads,
    q/kv latents 1536/512, nope 128, rope 64, v 128, f = 18432, 16-bit, no dropout, tp = 1,
    FlashAttention), per token in 2-byte elements: norm output h; heads Q and K 2 x 128 x 192, V
    and output 2 x 128 x 128 = 81,920; latents twice (norm input, up-projection input)
    2 x (1536 + 512) plus the rope key 64 = 4,160; MLP input h and four f-sized tensors 73,728;
    two norm inputs 2h. Total 2 x 4096 x (4h + 159,808) = 1,544,028,160 bytes."""
    cfg = get_preset("deepseek-v3")
    n = dict(cfg.numbers(), micro_batch_size=1, dropout=False)
    assert layer_bytes(recompute="selective", **dict(n, experts=0)) == 1_544_028_160
    # explicit attention stores the 128 x s x s scores; a sliding window stores s x window
    scores = layer_bytes(recompute="none", **dict(n, experts=0)) - 1_544_028_160
    assert scores == 128 * 4096 * 4096 * 2
    windowed = layer_bytes(recompute="none", **dict(n, experts=0, sliding_window=1024)) - 1_544_028_160
    assert windowed == 128 * 4096 * 1024 * 2


def test_moe_activations_shared_experts_capacity_and_etp():
    base = dict(seq=2048, micro_batch_size=1, hidden=4096, heads=32, kv_heads=8, ffn=14336, swiglu=True,
                dropout=False, experts=64, top_k=4, moe_ffn=1024)
    sbh, sbf = 2048 * 4096 * 2, 2048 * 1024 * 2
    routed_copy = 4 * sbf + sbh                                    # four f-sized tensors + its input
    assert layer_bytes(**base, shared_experts=2) - layer_bytes(**base) == 2 * 4 * sbf
    assert layer_bytes(**base, capacity_factor=1.5) - layer_bytes(**base) == pytest.approx(0.5 * 4 * routed_copy)
    assert layer_bytes(**base, etp=2) - layer_bytes(**base) == 4 * sbh   # each copy gathered over etp
    dense = layer_bytes(**dict(base, experts=0))
    assert mean_layer_bytes(layers=61, moe_layers=58, **base) == pytest.approx(
        (3 * dense + 58 * layer_bytes(**base)) / 61)


def test_stage_parameters_add_up_over_the_pipeline():
    cfg = TransformerConfig(layers=8, hidden=64, heads=4, vocab=100, seq=16, ffn=256, moe_experts=4,
                            moe_top_k=2, moe_ffn=32, moe_shared_experts=1, moe_dense_layers=1,
                            moe_layer_freq=2, activation="swiglu", bias=True, kv_lora_rank=16,
                            q_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    st = stage_parameters(**cfg.numbers(), pp=2)
    # first stage layers 0-3 (MoE at 1, 3), last 4-7 (MoE at 5, 7)
    total = sum(float(st[s][k]) for s in ("first", "last") for k in ("dense", "expert"))
    assert total == cfg.num_parameters()
    expert = 3 * 64 * 32 + 2 * 32 + 64
    assert float(st["first"]["expert"]) == float(st["last"]["expert"]) == 2 * 4 * expert
    single = stage_parameters(**get_preset("deepseek-v3").numbers())
    assert float(single["first"]["dense"] + single["first"]["expert"]) == get_preset("deepseek-v3").num_parameters()


def test_experts_shard_over_ep_and_etp_and_mla_down_projections_replicate():
    cfg = get_preset("deepseek-v3")
    one = stage_parameters(**cfg.numbers())
    split = stage_parameters(**cfg.numbers(), tp=8, ep=8, etp=2)
    routed = 58 * 256 * 3 * 7168 * 2048
    assert float(one["first"]["expert"]) == routed
    assert float(split["first"]["expert"]) == routed / 16
    # per layer: q_a, kv_a and their norms on every TP rank; q_b, kv_b, o split over 8
    replicated = 7168 * 1536 + 1536 + 7168 * 576 + 512
    up = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    attention_saving = cfg.layers * (up - up / 8)
    mlp_saving = (3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048) * 7 / 8   # dense MLPs, shared expert
    vocab_saving = 2 * 129280 * 7168 * 7 / 8
    assert float(one["first"]["dense"] - split["first"]["dense"]) == pytest.approx(
        attention_saving + mlp_saving + vocab_saving, rel=1e-12)
    assert replicated < up / 8 * 3   # the replicated part is small next to the split one


def test_memory_of_moe_presets_through_both_paths():
    """The scalar and the array path give the same bytes for MoE/MLA presets, and a width replaced
    by an array re-derives the head size as with_ does."""
    layout = Parallelism(dp=16, tp=2, pp=4, ep=8, sequence_parallel=True, num_microbatches=8,
                         recompute="selective", pipeline_layout=True)  # 27 layers: a layout string
    for name in ("deepseek-v2-lite", "qwen3-30b-a3b", "gpt-oss-120b"):
        cfg = get_preset(name)
        scalar = memory_per_gpu(cfg, layout).total
        batch = memory_batch(cfg, recompute="selective", dp=[16], tp=[2], pp=[4], ep=[8],
                             sequence_parallel=[True], num_microbatches=[8], pipeline_layout=[1])
        assert batch["total"][0] == pytest.approx(scalar, rel=1e-12)
    llama = get_preset("llama3-8b")
    wide = memory_batch(llama, hidden=[4096, 8192], heads=[32, 64], kv_heads=[8, 8], dp=[1, 1])
    assert wide["total"][1] == pytest.approx(memory_per_gpu(llama.with_(hidden=8192, heads=64)).total, rel=1e-12)
    # fewer layers as an array: the MoE and sliding layer counts follow (3 dense, then MoE)
    deepseek = get_preset("deepseek-v2-lite")
    shallow = flops_batch(deepseek, batch=1, layers=[27, 9])
    assert shallow["model_flops_per_step"][1] == flops_report(deepseek.with_(layers=9), 1)["model_flops_per_step"]
    f = flops_batch(get_preset("deepseek-v3"), batch=[1, 2])
    assert f["model_flops_per_step"][1] == flops_report(get_preset("deepseek-v3"), 2)["model_flops_per_step"]


def test_invalid_rows_of_an_moe_model_stay_finite():
    """Invalid rows get a safe one-dense-layer shape (DeepSeek-V3's 3 dense first layers and 58 MoE
    layers would otherwise make negative layer counts, and negative bytes, in the arithmetic)."""
    cfg = get_preset("deepseek-v3")
    out = memory_batch(cfg, dp=[64, 64], pp=[4, 100], ep=[8, 8], pipeline_layout=[1, 1], on_invalid="nan")
    assert list(out["valid"]) == [True, False] and np.isnan(out["total"][1])
    assert out["total"][0] == pytest.approx(memory_per_gpu(cfg, Parallelism(dp=64, pp=4, ep=8, pipeline_layout=True)).total,
                                            rel=1e-12)
    # the step time of every layout the search tries, invalid ones included
    r = search(get_preset("deepseek-v2-lite").with_(moe_dense_layers=3), cluster("h100-sxm", 2, 8), 64, top=1)
    assert r.configs and r.configs[0]["step_time_s"] > 0


def test_gemm_shapes_of_mla_and_head_dim_and_the_window():
    gpu = get_gpu("h100-sxm")
    kw = dict(gpu=gpu, dtype="bf16", efficiency=0.7, clock=1.0, bytes_per_element=2.0)
    for name in ("deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b"):
        cfg = get_preset(name)
        n = dict(cfg.numbers(), tp=1)
        proj = attention_projections(n, 4096.0, **kw)
        attention_weights = matmul_params_per_layer(**dict(n, experts=0, ffn=0))
        assert proj["weights"] == attention_weights       # the GEMMs hold the counted weights
        tp8 = attention_projections(dict(n, tp=8), 4096.0, **kw)
        assert tp8["forward"] < proj["forward"]
    mistral = get_preset("mistral-7b")
    base = dict(mistral.numbers(), dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch_size=1, num_microbatches=1)
    step = dict(recompute="none", dtype="bf16", flash_attention=True, gemm_efficiency=0.7,
                attention_efficiency=0.4)
    windowed = transformer_compute(base, gpu, **step)
    full = transformer_compute(dict(base, sliding_window=0, sliding_layers=0), gpu, **step)
    assert float(windowed["attention"]) == pytest.approx(0.75 * float(full["attention"]))
    assert float(windowed["gemm"]) == float(full["gemm"])
