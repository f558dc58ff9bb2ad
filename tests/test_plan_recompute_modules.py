"""The step time of Megatron-Core's per-module recompute: each module's forward repeated in backward,
by hand from the layer's shapes (dtlib.plan.recompute's docstring)."""
import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.plan.calibration import GEMM_EFFICIENCY
from dtlib.plan.recompute import recompute_module_work
from dtlib.plan.steptime import StepOptions, step_time

V3 = get_preset("deepseek-v3").with_(seq=4096)
OPTIONS = StepOptions(dp_overlap=0.0)


def numbers(model, layout):
    return model.numbers() | layout.numbers()


def test_mla_up_proj_repeats_the_four_up_projections():
    """DeepSeek-V2 Sec. 2.1.2: W^UQ and W^QR from the query latent (q_lora_rank -> heads x
    (nope + rope)), W^UK and W^UV from the KV latent (kv_lora_rank -> heads x (nope + v))."""
    n = numbers(V3, Parallelism(dp=8, ep=8, tp=2, sequence_parallel=True))
    tokens = V3.seq  # micro-batch 1, cp 1
    up = 1536 * 128 * (128 + 64) + 512 * 128 * (128 + 128)
    work = recompute_module_work(("mla_up_proj",), n, 2, False, True)
    assert work["flops"] == pytest.approx(2 * up * tokens / 2, rel=1e-12)
    assert work["bytes"] == 0 and work["attention"] == 0


def test_moe_act_reads_fc1_output_and_writes_fc2_input_in_moe_layers_only():
    """SwiGLU: FC1's output is 2 moe_ffn wide, FC2's input 1: 3 moe_ffn values per routed copy,
    over the 58 of 61 layers that are MoE (3 dense first layers)."""
    n = numbers(V3, Parallelism(dp=8, ep=8))
    routed = 8 * V3.seq
    work = recompute_module_work(("moe_act",), n, 2, False, True)
    assert work["bytes"] == pytest.approx(58 / 61 * routed * 2048 * 3 * 2, rel=1e-12)
    assert work["flops"] == 0


def test_recompute_modules_add_their_forward_to_the_step():
    """mla_up_proj's FLOPs at the BF16 peak and the GEMM efficiency, once per layer of the
    stage and micro-batch; nothing else moves but the bubble's share of it."""
    layout = Parallelism(dp=8, ep=8, num_microbatches=2)
    c = cluster("h100-sxm", 1, 8)
    base = step_time(V3, layout, c, options=OPTIONS)
    more = step_time(V3, layout.with_(recompute_modules=("mla_up_proj",)), c, options=OPTIONS)
    flops = recompute_module_work(("mla_up_proj",), numbers(V3, layout), 2, False, True)["flops"]
    expected = V3.layers * 2 * flops / (c.gpu.peak("bf16") * GEMM_EFFICIENCY)
    assert more.breakdown["compute"] - base.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    for term in ("tp_comm", "ep_comm", "dp_comm", "optimizer", "elementwise"):
        assert more.breakdown[term] == pytest.approx(base.breakdown[term], rel=1e-12)
    assert more.hardware_flops > base.hardware_flops


def test_layernorm_is_recomputed_where_it_is_a_module_of_its_own():
    """MLA's input norm in every layer, the pre-MLP norm in the 58 MoE layers only (the 3 dense
    layers' is fused into FC1): each read and written again, s x b x h elements of BF16."""
    n = numbers(V3, Parallelism(dp=8, ep=8))
    sbh = V3.seq * V3.hidden
    work = recompute_module_work(("layernorm",), n, 2, False, True)
    assert work["bytes"] == pytest.approx(2 * (2 * sbh + 58 / 61 * 2 * sbh), rel=1e-12)


def test_modules_apply_to_the_layers_recompute_layers_leaves_stored():
    """With recompute_layers = half a stage's layers, those repeat their whole forward and the module
    work falls on the other half only: half of what it adds alone (memory counts the same split)."""
    c = cluster("h100-sxm", 1, 8)
    layout = Parallelism(dp=8, ep=8, num_microbatches=2)
    half = V3.layers // 2  # pp 1: one chunk of every layer
    t = {(layers, modules): step_time(V3, layout.with_(recompute_layers=layers, recompute_modules=modules), c,
                                      options=OPTIONS).step_time
         for layers in (None, half) for modules in ((), ("mla_up_proj",))}
    alone = t[None, ("mla_up_proj",)] - t[None, ()]
    assert alone > 0
    share = half / V3.layers
    assert t[half, ("mla_up_proj",)] - t[half, ()] == pytest.approx((1 - share) * alone, rel=1e-9)
