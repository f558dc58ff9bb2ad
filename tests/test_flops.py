"""FLOPs and MFU: the analytic count against FlopCounterMode on TinyGPT, the published formulas,
Korthikanti et al.'s 22B MFU, and the conventions."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from dtlib.analytic.flops import (flops_report, forward_flops_per_token, matmul_params_per_layer,
                         megatron_flops_per_step, palm_flops_per_token, shape_of, step_flops, utilization)
from dtlib.analytic.hardware import get_gpu
from dtlib.models import TinyGPT, get_preset, tiny_gpt_config


@pytest.mark.parametrize("overrides", [dict(), dict(activation="swiglu", kv_heads=2, position="rope"),
                                       dict(layers=3, tied_embeddings=True, kv_heads=1, ffn=96)])
def test_count_matches_flop_counter_on_tinygpt(overrides):
    cfg = tiny_gpt_config(**overrides)
    model = TinyGPT(cfg)
    idx = torch.randint(0, cfg.vocab, (3, cfg.seq))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    predicted = step_flops(3 * cfg.seq, **shape_of(cfg))["model"]
    assert predicted == pytest.approx(counter.get_total_flops(), rel=0.02)


@pytest.mark.parametrize("name", ["gpt3-175b", "megatron-22b"])
def test_general_count_equals_megatron_formula_for_gpt_blocks(name):
    """Narayanan et al. 2021 eq. (3) (full recompute, hardware FLOPs) and its no-recompute form."""
    cfg = get_preset(name)
    b, s = 8, cfg.seq
    shape = shape_of(cfg)
    ours = step_flops(b * s, recompute="full", **shape)
    assert ours["hardware"] == pytest.approx(megatron_flops_per_step(b, s, cfg.layers, cfg.hidden, cfg.vocab), rel=1e-12)
    assert ours["model"] == pytest.approx(
        megatron_flops_per_step(b, s, cfg.layers, cfg.hidden, cfg.vocab, recompute=False), rel=1e-12)


def test_general_count_equals_palm_formula():
    """Chowdhery et al. 2022 App. B: 6N + 12 L H Q T, N = non-embedding (matmul) parameters."""
    cfg = get_preset("llama3-70b")
    n = cfg.layers * matmul_params_per_layer(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.mlp_matrices)
    ours = 3 * forward_flops_per_token(count_logits=False, **shape_of(cfg))
    assert ours == pytest.approx(palm_flops_per_token(n, cfg.layers, cfg.heads, cfg.head_dim, cfg.seq), rel=1e-12)


def test_korthikanti_22b_mfu():
    """Korthikanti et al. 2022: 22B on 8 A100s (TP 8), batch 4 x 2048 tokens, 1.10 s per step:
    41.5% MFU. The step time is published to 0.01 s (+-0.45%), i.e. +-0.19 points of MFU, so the
    tolerance is 0.2 points."""
    r = flops_report(get_preset("megatron-22b"), batch=4, step_time=1.10, gpus=8, gpu="a100-80gb",
                     recompute="selective")
    assert 100 * r["mfu"] == pytest.approx(41.5, abs=0.2)
    # selective recompute repeats QK^T and A.V: 2 products x 2 s h FLOPs per token and layer
    cfg = get_preset("megatron-22b")
    extra = 4 * cfg.seq * (4 * cfg.seq * cfg.hidden * cfg.layers)  # batch 4 x seq tokens
    assert r["hardware_flops_per_step"] - r["model_flops_per_step"] == pytest.approx(extra, rel=1e-12)
    assert r["hfu"] / r["mfu"] == pytest.approx(1 + extra / r["model_flops_per_step"], rel=1e-12)


def test_conventions_causal_and_logits():
    shape = shape_of(get_preset("llama3-8b"))
    full = forward_flops_per_token(**shape)
    causal = forward_flops_per_token(attention="causal", **shape)
    assert full - causal == pytest.approx(2 * shape["seq"] * shape["hidden"] * shape["layers"])
    no_logits = forward_flops_per_token(count_logits=False, **shape)
    assert full - no_logits == 2 * shape["hidden"] * shape["vocab"]
    with pytest.raises(ValueError, match="attention must be one of"):
        forward_flops_per_token(attention="sparse", **shape)


def test_recompute_adds_hardware_flops_only():
    shape = shape_of(get_preset("megatron-22b"))
    none, sel, full = (step_flops(1000, recompute=r, **shape) for r in ("none", "selective", "full"))
    assert none["model"] == sel["model"] == full["model"] == none["hardware"]
    assert none["hardware"] < sel["hardware"] < full["hardware"]
    # Korthikanti et al. 2022, Sec. 5: selective recompute repeats the forward attention products
    # QK^T and A.V, 2 x 2 s h FLOPs per token and layer (full score matrix, docs/analytic.md)
    assert sel["hardware"] - none["hardware"] == 1000 * 2 * 2 * shape["seq"] * shape["hidden"] * shape["layers"]
    with pytest.raises(ValueError, match="recompute must be one of"):
        step_flops(1000, recompute="some", **shape)


def test_mfu_uses_the_catalogue_peak():
    a100, h100 = get_gpu("a100-80gb"), get_gpu("h100-sxm")
    ratio = utilization(1e15, 1.0, 8, a100) / utilization(1e15, 1.0, 8, h100)
    assert ratio == pytest.approx(h100.peak("bf16") / a100.peak("bf16"))
    with pytest.raises(ValueError, match="a100-80gb has no fp8 peak"):
        utilization(1e15, 1.0, 8, "a100-80gb", "fp8")


def test_moe_counts_active_experts():
    dense = tiny_gpt_config(bias=False)
    moe = dense.with_(moe_experts=8, moe_top_k=2)
    extra = forward_flops_per_token(**shape_of(moe)) - forward_flops_per_token(**shape_of(dense))
    assert extra == 2 * dense.layers * (dense.hidden * dense.ffn * 2 + dense.hidden * 8)


def test_bare_parameter_count_uses_6n():
    r = flops_report(7e9, batch=2, seq=1024, recompute="full")
    assert r["model_flops_per_step"] == 6 * 7e9 * 2048
    assert r["hardware_flops_per_step"] == 8 * 7e9 * 2048
    with pytest.raises(ValueError, match="needs seq"):
        flops_report(7e9, batch=2)


def test_full_recompute_hardware_flops_match_a_checkpointed_tinygpt():
    """Hardware FLOPs with full recompute = FlopCounterMode on TinyGPT(checkpoint=True). PyTorch's
    non-reentrant checkpoint stops recomputing early by default (it skips each block's last matmul,
    whose output nothing saves), so the comparison turns that off to recompute whole blocks."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    cfg = tiny_gpt_config(layers=3)
    model = TinyGPT(cfg, checkpoint=True)
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq))
    with set_checkpoint_early_stop(False), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    f = step_flops(2 * cfg.seq, recompute="full", **shape_of(cfg))
    assert f["hardware"] == pytest.approx(counter.get_total_flops(), rel=0.02)
    assert f["hardware"] > 1.25 * f["model"]


def _attention_core_recomputed(ctx, op, *args, **kwargs):
    """Selective recompute policy (Korthikanti et al. 2022, Sec. 5): QK^T and A.V (the batched
    matmuls), the mask and the softmax are recomputed in backward; everything else is kept."""
    aten = torch.ops.aten
    recompute = (aten.bmm.default, aten._softmax.default, aten.masked_fill.Scalar)
    return CheckpointPolicy.PREFER_RECOMPUTE if op in recompute else CheckpointPolicy.MUST_SAVE


class _SelectiveBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, _attention_core_recomputed))


@pytest.mark.parametrize("overrides", [dict(), dict(layers=3, kv_heads=2, position="rope", seq=48)])
def test_selective_recompute_hardware_flops_match_a_tinygpt_that_recomputes_attention(overrides):
    """Hardware FLOPs with selective recompute = FlopCounterMode on a TinyGPT whose blocks run
    under torch.utils.checkpoint with a selective policy that recomputes only the attention core."""
    cfg = tiny_gpt_config(**overrides)
    model = TinyGPT(cfg)
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq))
    with FlopCounterMode(display=False) as plain:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    model.blocks = torch.nn.ModuleList(_SelectiveBlock(b) for b in model.blocks)
    with FlopCounterMode(display=False) as selective:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    f = step_flops(2 * cfg.seq, recompute="selective", **shape_of(cfg))
    assert selective.get_total_flops() > plain.get_total_flops()  # the policy did recompute
    assert f["model"] == pytest.approx(plain.get_total_flops(), rel=1e-9)
    assert f["hardware"] == pytest.approx(selective.get_total_flops(), rel=1e-9)
