"""The shape-aware compute model (dtlib.plan.gemm, dtlib.plan.eager), each case computed by hand:
tile and wave quantization, the roofline, FP8 peaks, the power cap, a layer's GEMM shapes after TP."""
import math
from dataclasses import replace

import numpy as np
import pytest

from dtlib.analytic.hardware import cluster, get_gpu
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.models import TransformerConfig
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY
from dtlib.plan.eager import eager_bytes, eager_forward_bytes
from dtlib.plan.gemm import FLASH_BACKWARD, clock_scale, gemm_time
from dtlib.plan.steptime import StepOptions, step_time

H100 = get_gpu("h100-sxm")
ONE_TILE = ((256, 128),)
FAST_HBM = replace(H100, memory_bandwidth=1e30)  # math only


def one_tile_time(k, gpu=H100, dtype="bf16"):
    """One SM computing one 256 x 128 tile over K: 2 x 256 x 128 x K FLOPs at peak / SMs."""
    return 2 * 256 * 128 * k / (gpu.peak(dtype) / gpu.sms)


def test_a_gemm_with_one_tile_more_than_the_sms_takes_two_waves():
    k = 4096
    # 132 tiles (12 x 11) fill the 132 SMs once; 133 tiles (133 x 1) need a second wave
    full = gemm_time(256 * 12, 128 * 11, k, FAST_HBM, tiles=ONE_TILE)
    one_more = gemm_time(256 * 133, 128, k, FAST_HBM, tiles=ONE_TILE)
    assert full == pytest.approx(one_tile_time(k), rel=1e-12)
    assert one_more == pytest.approx(2 * one_tile_time(k), rel=1e-12)


def test_a_partial_tile_costs_a_whole_one():
    k = 1024
    # 257 rows need two 256-row tiles: same time as 512 rows (both one wave on 132 SMs)
    assert gemm_time(257, 128, k, FAST_HBM, tiles=ONE_TILE) == gemm_time(512, 128, k, FAST_HBM, tiles=ONE_TILE)
    # 264 tiles = 2 full waves; 265 = 3
    assert gemm_time(256 * 264, 128, k, FAST_HBM, tiles=ONE_TILE) == pytest.approx(2 * one_tile_time(k))
    assert gemm_time(256 * 264 + 1, 128, k, FAST_HBM, tiles=ONE_TILE) == pytest.approx(3 * one_tile_time(k))


def test_the_fastest_tile_is_taken_and_efficiency_divides_the_math():
    k = 2048
    # 132 x 128 rows by 256 columns: 256x128 tiles give 66 x 2 = 132 tiles (1 wave); 128x256 give
    # 132 x 1 = 132 tiles (1 wave) too; 128x128 give 264 tiles = 2 waves of half the work each
    t = gemm_time(128 * 132, 256, k, FAST_HBM)
    assert t == pytest.approx(one_tile_time(k), rel=1e-12)
    assert gemm_time(128 * 132, 256, k, FAST_HBM, efficiency=0.5) == pytest.approx(2 * t, rel=1e-12)


def test_small_k_is_memory_bound_at_the_hbm_bandwidth():
    m, n, k = 8192, 8192, 16
    t = gemm_time(m, n, k, H100)
    assert t == pytest.approx((m * k + k * n + m * n) * 2 / H100.memory_bandwidth, rel=1e-12)
    assert gemm_time(m, n, k, H100, batch=3) == pytest.approx(3 * t, rel=1e-12)


def test_fp8_runs_at_the_fp8_peak_and_a_gpu_without_sms_gets_the_roofline():
    k = 4096
    assert gemm_time(256 * 12, 128 * 11, k, FAST_HBM, dtype="fp8", tiles=ONE_TILE) == pytest.approx(
        one_tile_time(k, dtype="fp8"), rel=1e-12)
    plain = replace(FAST_HBM, sms=None)
    assert gemm_time(1000, 1000, 1000, plain) == pytest.approx(2e9 / H100.peak("bf16"), rel=1e-12)


def test_a_power_cap_scales_the_clock_by_the_cube_root():
    assert clock_scale(H100) == 1.0
    assert clock_scale(H100, 500) == pytest.approx((500 / 700) ** (1 / 3), rel=1e-12)
    assert clock_scale(H100, 900) == 1.0  # above the TDP the rated clock is the limit
    assert clock_scale(H100, 350, exponent=1) == pytest.approx(0.5)
    capped = gemm_time(256 * 12, 128 * 11, 4096, FAST_HBM, tiles=ONE_TILE, clock=clock_scale(H100, 500))
    assert capped == pytest.approx(one_tile_time(4096) / (500 / 700) ** (1 / 3), rel=1e-12)
    # memory-bound GEMMs do not slow down: HBM has its own clock
    assert gemm_time(8192, 8192, 16, H100, clock=0.5) == gemm_time(8192, 8192, 16, H100)


def test_the_power_cap_slows_the_compute_term_of_a_step():
    layout = Parallelism(dp=8, micro_batch_size=1)
    c = cluster("h100-sxm", 1, 8)
    model = get_preset("llama3-8b")
    full = step_time(model, layout, c).breakdown["compute"]
    capped = step_time(model, layout, c, options=StepOptions(power_limit_w=500)).breakdown["compute"]
    assert 1 < capped / full <= (700 / 500) ** (1 / 3) + 1e-12


def test_gb200_runs_at_the_clock_b200_sustains_not_its_datasheets():
    """docs/hardware.md, "The clock a part sustains": GB200's peaks are quoted at its maximum clock
    (148 SMs x 8,192 x 2,062 MHz), B200's at 1,856 MHz of its 1,965. Timed, a compute-bound GEMM on
    GB200 is faster than on B200 by the ratio of their maximum clocks (1.049), which the measured MAMF
    ratios bracket (1.044 BF16, 1.053 FP8), not by the datasheets' 1.111; its MFU peak is unchanged."""
    b200, gb200 = get_gpu("b200"), get_gpu("gb200")
    assert gb200.peak("bf16") == pytest.approx(148 * 8192 * 2062e6, rel=1e-3)
    assert b200.peak("bf16") / (148 * 8192) == pytest.approx(1855.8e6, rel=1e-4)
    assert clock_scale(b200) == 1.0 and clock_scale(gb200) == pytest.approx(1855.8 / 1965, rel=1e-4)
    assert clock_scale(gb200, 1000) == pytest.approx(clock_scale(gb200) * (1000 / 1200) ** (1 / 3), rel=1e-12)
    for dtype, mamf in (("bf16", 1822 / 1745), ("fp8", 3615.6 / 3432.5)):
        t = [gemm_time(148 * 256, 128 * 8, 8192, replace(g, memory_bandwidth=1e30), dtype=dtype, tiles=ONE_TILE,
                       clock=clock_scale(g)) for g in (b200, gb200)]
        assert t[0] / t[1] == pytest.approx(2062 / 1965, rel=1e-3)
        assert min(mamf, 2062 / 1965) - 0.006 < t[0] / t[1] < max(mamf, 2062 / 1965) + 0.006, dtype
    layout = Parallelism(dp=8, micro_batch_size=1)
    model = get_preset("llama3-8b")
    times = [step_time(model, layout, cluster(g, 1, 8)).breakdown["compute"] for g in ("b200", "gb200")]
    assert 1.0 < times[0] / times[1] < 2062 / 1965 + 1e-9  # memory-bound kernels gain nothing


@pytest.mark.parametrize("call,message", [
    (lambda: clock_scale(H100, 0), "power_limit_w must be a finite number > 0, got 0"),
    (lambda: clock_scale(H100, float("nan")), "power_limit_w must be a finite number > 0"),
    (lambda: clock_scale(replace(H100, tdp_w=None), 500), "power_limit_w must be None for"),
    (lambda: replace(H100, sustained_clock=1.5), "sustained_clock must be a finite number > 0 and <= 1, got 1.5"),
    (lambda: gemm_time(-1, 2, 3, H100), "m must be a finite number >= 0, got -1"),
    (lambda: gemm_time(1, 2, 3, H100, efficiency=0), "efficiency must be a finite number > 0 and <= 1"),
    (lambda: gemm_time(1, 2, 3, H100, efficiency=1.5), "efficiency must be"),
    (lambda: StepOptions(gemm_efficiency=2.0), "gemm_efficiency must be a finite number > 0 and <= 1"),
    (lambda: StepOptions(attention_efficiency=0.0), "attention_efficiency must be"),
    (lambda: StepOptions(power_limit_w=-5), "power_limit_w must be a finite number > 0"),
    (lambda: StepOptions(fused_elementwise="no"), "fused_elementwise must be True or False"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_a_layers_gemms_are_megatrons_shapes_after_tp():
    # one GPU's share of tp=2: QKV (b s, 3h/2, h), proj (b s, h, h/2), fc1 (b s, 4h/2, h), fc2 (b s, h, 4h/2),
    # head (b s, V/2, h); each forward GEMM (M, N, K) has backward GEMMs (M, K, N) and (K, N, M)
    gpt = TransformerConfig(name="g", layers=2, hidden=1024, heads=16, vocab=51200, seq=2048, tied_embeddings=True)
    layout = Parallelism(tp=2, micro_batch_size=2, num_microbatches=3)
    c = cluster("h100-sxm", 1, 2)
    r = step_time(gpt, layout, c, options=StepOptions(flash_attention=True), dropout=False)
    g = dict(gpu=H100, efficiency=GEMM_EFFICIENCY)

    def fwd_bwd(m, n, k):
        return gemm_time(m, n, k, **g) + gemm_time(m, k, n, **g) + gemm_time(k, n, m, **g)
    t, h = 2 * 2048, 1024
    layer = fwd_bwd(t, 3 * h / 2, h) + fwd_bwd(t, h, h / 2) + fwd_bwd(t, 4 * h / 2, h) + fwd_bwd(t, h, 4 * h / 2)
    gemm = 3 * (2 * layer + fwd_bwd(t, 51200 / 2, h))
    # FlashAttention: half of 4 b s s h / tp (causal), backward 2.5x, at the BF16 peak; plus one exponential
    # per score forward and one backward (b s s / 2 causal scores x heads / tp) at the special-function
    # units' rate, H100: BF16 peak / 256 (FlashAttention-3, Sec. 3.1); all at the fitted fraction
    matmul = 3 * 2 * (1 + FLASH_BACKWARD) * 0.5 * 4 * 2 * 2048 * 2048 * h / 2 / H100.peak("bf16")
    exps = 3 * 2 * 2 * (0.5 * 2 * 2048 * 2048 * 16 / 2) / (H100.peak("bf16") / 256)
    attention = (matmul + exps) / ATTENTION_EFFICIENCY
    assert r.breakdown["compute"] == pytest.approx(float(gemm + attention), rel=1e-9)


def test_eager_traffic_is_the_op_count_of_the_docstring():
    # Llama 3 8B: h 4096, kv 8 x 128, ffn 14336
    h, kv, f = 4096, 1024, 14336
    forward = 2 * 36 * h + 20 * (h + kv) + 10 * f + 2 * 6 * h + 4 * (kv + h) + 4 * h
    assert eager_forward_bytes(h, kv, f) == forward == 626_688
    assert eager_bytes(h, kv, f) == 3 * forward
    model = get_preset("llama3-8b")
    layout = Parallelism(dp=8, micro_batch_size=1)
    c = cluster("h100-sxm", 1, 8)
    eager = step_time(model, layout, c, options=StepOptions(fused_elementwise=False)).breakdown["elementwise"]
    assert eager == pytest.approx(3 * forward * 8192 * 32 / H100.memory_bandwidth, rel=1e-12)
    fused = step_time(model, layout, c).breakdown["elementwise"]
    assert eager > 2 * fused


def test_fp8_casts_add_memory_traffic_and_fp8_is_still_faster():
    model = get_preset("llama3-8b")
    layout = Parallelism(dp=8, micro_batch_size=1)
    c = cluster("h100-sxm", 1, 8)
    bf16 = step_time(model, layout, c).breakdown["compute"]
    fp8 = step_time(model, layout, c, options=StepOptions(dtype="fp8")).breakdown["compute"]
    assert bf16 / 2 < fp8 < bf16
    assert math.isfinite(fp8) and np.isfinite(bf16)


def test_eager_traffic_follows_the_block():
    """An MPT block (low-precision LayerNorm, GELU, learned positions, multi-head attention) runs
    one kernel per norm and per activation, no RoPE and no K/V repeat (dtlib.plan.eager)."""
    h, f = 4096, 16384
    forward = 2 * 4 * h + 4 * f + 2 * 6 * h + 4 * h
    assert eager_forward_bytes(h, h, f, rmsnorm=False, swiglu=False, rope=False, kv_repeat=False) == forward
    mpt = TransformerConfig(name="mpt-7b-like", layers=32, hidden=h, heads=32, vocab=50368, seq=2048, ffn=f,
                            tied_embeddings=True)
    layout = Parallelism(dp=8, micro_batch_size=1)
    eager = step_time(mpt, layout, cluster("h100-sxm", 1, 8),
                      options=StepOptions(fused_elementwise=False)).breakdown["elementwise"]
    assert eager == pytest.approx(3 * forward * 2048 * 32 / H100.memory_bandwidth, rel=1e-12)
