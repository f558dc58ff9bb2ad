"""NVFP4 training (NVIDIA 2025, arXiv:2509.25149; Transformer Engine's NVFP4BlockScaling): the linear
layers' GEMMs at the FP4 peak on Blackwell only, NVFP4 operands and casts, BF16 attention and head,
BF16 layers as Megatron's --first-last-layers-bf16, the cached NVFP4 inputs and weight copies in
memory, and the command line's errors."""
import json

import numpy as np
import pytest

from dtlib.analytic import validate
from dtlib.analytic.activations import stored_layer_bytes
from dtlib.analytic.hardware import NVFP4_GPUS, cluster, get_gpu, matmul_peak
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.precision import NVFP4_BYTES
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.plan.gemm import CAST_BYTES, NVFP4_CAST_BYTES, gemm_time, transformer_compute
from dtlib.plan.steptime import StepOptions, step_time


def test_nvfp4_element_and_cast_bytes():
    # 4-bit E2M1 elements plus one E4M3 scale per 16 (the per-tensor FP32 scale is not counted)
    assert NVFP4_BYTES == 0.5 + 1 / 16
    # amax read + cast read of BF16, then the row-wise and column-wise NVFP4 copies written
    assert NVFP4_CAST_BYTES == 2 + 2 + 2 * 0.5625 == 5.125
    assert CAST_BYTES["bf16"] == 0 and CAST_BYTES["nvfp4"] < CAST_BYTES["fp8"]


@pytest.mark.parametrize("name", NVFP4_GPUS)
def test_nvfp4_runs_at_the_fp4_peak_of_blackwell(name):
    gpu = get_gpu(name)
    assert matmul_peak(gpu, "nvfp4") == gpu.peak("fp4") > gpu.peak("fp8")


@pytest.mark.parametrize("name, why", [("h100-sxm", "bf16 or fp8 on h100-sxm: nvfp4 needs NVIDIA Blackwell"),
                                       ("a100-80gb", "bf16 on a100-80gb: nvfp4 needs"),
                                       ("mi355x", "its FP4 is MXFP4, not NVFP4"),
                                       ("mi350x", "its FP4 is MXFP4, not NVFP4")])
def test_no_nvfp4_without_nvfp4_tensor_cores(name, why):
    with pytest.raises(validate.InvalidArgument, match=why) as err:
        matmul_peak(get_gpu(name), "nvfp4")
    assert err.value.name == "precision" and "b200, gb200, b300, gb300" in str(err.value)


def test_memory_bound_gemm_reads_nvfp4_operands():
    """A GEMV-shaped GEMM (M = 1) is memory-bound: its time is its operands' bytes at the HBM bandwidth,
    9/16 byte per NVFP4 element against 1 for FP8."""
    gpu = get_gpu("gb200")
    m, n, k = 1, 8192, 8192
    elements = m * k + k * n + m * n
    t4 = gemm_time(m, n, k, gpu, dtype="nvfp4", bytes_per_element=NVFP4_BYTES)
    assert t4 == pytest.approx(elements * NVFP4_BYTES / gpu.memory_bandwidth)
    assert gemm_time(m, n, k, gpu, dtype="fp8", bytes_per_element=1.0) / t4 == pytest.approx(1 / NVFP4_BYTES)


def _compute(dtype, **kw):
    n = get_preset("llama3-70b").numbers() | Parallelism(dp=8, tp=2, num_microbatches=4).numbers()
    return n, transformer_compute(n, get_gpu("gb300"), recompute="none", dtype=dtype, flash_attention=True,
                                  gemm_efficiency=0.6, attention_efficiency=0.5, **kw)


def test_linear_layers_in_nvfp4_attention_and_head_in_bf16():
    n, bf16 = _compute("bf16")
    _, fp8 = _compute("fp8")
    _, fp4 = _compute("nvfp4")
    # attention's batched GEMMs and the LM head stay BF16 (NVIDIA 2025, Sec. 4.1)
    assert fp4["attention"] == fp8["attention"] == bf16["attention"]
    assert fp4["head"] == bf16["head"]
    # the layers' GEMMs: GB300 runs FP4 at 3x FP8 (6x BF16); casts and quantization keep it above a third
    layer4, layer8, layer16 = fp4["dense_layer"], fp8["dense_layer"], bf16["dense_layer"]
    assert layer16 / 6 < layer4 < layer8 / 2


def test_bf16_layers_are_their_share_of_every_layer():
    n, bf16 = _compute("bf16")
    _, fp4 = _compute("nvfp4")
    # every layer kept in BF16: the BF16 step; half of them: halfway
    _, all_kept = _compute("nvfp4", bf16_layers=n["layers"])
    assert all_kept["gemm"] == pytest.approx(bf16["gemm"], rel=1e-12)
    _, half = _compute("nvfp4", bf16_layers=n["layers"] // 2)
    assert half["gemm"] == pytest.approx((fp4["gemm"] + bf16["gemm"]) / 2, rel=1e-12)


def test_step_time_api_and_its_errors():
    model, layout = get_preset("llama3-8b"), Parallelism(dp=8, num_microbatches=2)
    fp4 = step_time(model, layout, cluster("b200"), options=StepOptions(dtype="nvfp4"))
    fp8 = step_time(model, layout, cluster("b200"), options=StepOptions(dtype="fp8"))
    assert fp4.breakdown["compute"] < fp8.breakdown["compute"]
    with pytest.raises(validate.InvalidArgument, match="precision must be bf16 or fp8 on h100-sxm"):
        step_time(model, layout, cluster("h100-sxm"), options=StepOptions(dtype="nvfp4"))
    with pytest.raises(validate.InvalidArgument, match="bf16_layers must be at most the model's 32 layers"):
        step_time(model, layout, cluster("b200"), options=StepOptions(dtype="nvfp4", bf16_layers=33))
    with pytest.raises(ValueError, match="bf16_layers must be an integer >= 0"):
        StepOptions(bf16_layers=-1)


def test_memory_counts_nvfp4_inputs_and_weight_copies():
    """Transformer Engine caches each linear layer's input as column-wise NVFP4 (9/16 byte instead of
    FP8's 1) and keeps the layers' weights quantized row- and column-wise (2 x 9/16 byte/param)."""
    model = get_preset("llama3-8b")
    layout = Parallelism(dp=8, zero=1, num_microbatches=1)
    kw = dict(precision="megatron-bf16", stack="megatron", gpu="b200")
    fp8, fp4 = (memory_per_gpu(model, layout, dtype=d, **kw) for d in ("fp8", "nvfp4"))
    s, h, ffn = model.seq, model.hidden, model.ffn
    # tp 1: the inputs of QKV, the projection, FC1 and FC2 (3 s h + s ffn elements per layer)
    shape = dict(seq=s, micro_batch_size=1, hidden=h, heads=model.heads, kv_heads=model.kv_heads, ffn=ffn,
                 swiglu=True)
    per_layer = (stored_layer_bytes("none", fp8_inputs=True, fused_swiglu=True, **shape)
                 - stored_layer_bytes("none", fp8_inputs=NVFP4_BYTES, fused_swiglu=True, **shape))
    assert per_layer == pytest.approx((1 - NVFP4_BYTES) * (3 * s * h + s * ffn))
    assert fp8.activations - fp4.activations == pytest.approx(model.layers * per_layer, rel=1e-9)
    # the weight copies: every transformer layer's parameters, not the embedding and the (untied) head
    layer_params = model.num_parameters() - 2 * model.vocab * h - h
    assert fp8.temporary == 0 and fp4.temporary == pytest.approx(2 * NVFP4_BYTES * layer_params, rel=1e-9)
    assert any("NVFP4 copies" in note for note in fp4.notes)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--global-batch", "8",
     "--precision", "nvfp4"],
    ["memory", "--model", "llama3-8b", "--gpu", "h100-sxm", "--dp", "8", "--precision", "nvfp4"],
    ["flops", "--model", "llama3-8b", "--gpu", "h100-sxm", "--batch", "8", "--precision", "nvfp4"],
])
def test_cli_refuses_nvfp4_off_blackwell_in_one_line(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--precision must be bf16 or fp8 on h100-sxm" in err and "b200, gb200, b300, gb300" in err


def test_cli_plan_memory_flops_in_nvfp4(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpu", "b200", "--gpus", "8", "--global-batch",
                       "64", "--precision", "nvfp4", "--bf16-layers", "4", "--top", "1", "--json")
    d = json.loads(out)
    assert code == 0 and d["precision"] == "nvfp4" and d["assumed"]["bf16_layers"] == 4 and d["configs"]
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpu", "b200", "--dp", "8", "--precision",
                       "nvfp4", "--json")
    assert code == 0 and json.loads(out)["per_gpu"]["temporary"] > 0
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--gpu", "gb300", "--batch", "8", "--precision",
                       "nvfp4", "--json")
    assert code == 0 and json.loads(out)["peak_flops_per_gpu"] == pytest.approx(15e15)


@pytest.mark.parametrize("extra, message", [
    (["--precision", "nvfp4", "--bf16-layers", "40"], "--bf16-layers must be at most the model's 32 layers"),
    (["--bf16-layers", "2"], "--bf16-layers keeps layers in BF16 under --precision fp8 or nvfp4"),
    (["--precision", "nvfp4", "--emit", "megatron", "--rehearse"], "CPU ranks, which have no NVFP4 kernels"),
])
def test_cli_plan_bad_nvfp4_flags(capsys, extra, message):
    code, out, err = run(capsys, "plan", "--model", "llama3-8b", "--gpu", "b200", "--gpus", "8", "--global-batch",
                         "64", *extra)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err


def test_emitted_nvfp4_plans(capsys):
    """Megatron-LM runs NVIDIA's recipe (--fp4-format e2m1 --fp4-recipe nvfp4, its flag table and
    validate_args rules), with the BF16 layers as --first-last-layers-bf16; the other frameworks'
    configs have no NVFP4 and say so by name."""
    from dtlib.frameworks.megatron_args import parse_args, validate as megatron_validate
    from dtlib.plan.emit import TimedPlan, megatron_flags, unsupported
    layout = Parallelism(dp=8, pp=2, num_microbatches=4)
    plan = TimedPlan(layout, get_preset("llama3-8b"), layout.global_batch, StepOptions(dtype="nvfp4", bf16_layers=2),
                     "nvfp4", cluster("b200", 2, 8))
    args = parse_args(megatron_flags(plan))
    megatron_validate(args, layout.gpus)
    assert (args["fp4"], args["fp4_recipe"], args["fp8"], args["bf16"]) == ("e2m1", "nvfp4", None, True)
    assert (args["first_last_layers_bf16"], args["num_layers_at_start_in_bf16"], args["num_layers_at_end_in_bf16"]) \
        == (True, 0, 2)
    for framework, why in (("deepspeed", "bf16 and fp16 only"), ("torchtitan", "not NVIDIA's NVFP4 recipe"),
                           ("jax", "Transformer Engine's, not a mesh's dtype")):
        assert any(why in reason for reason in unsupported(framework, plan)), framework
    with pytest.raises(ValueError, match="fp8 and nvfp4 matmuls are both or neither"):
        TimedPlan(layout, get_preset("llama3-8b"), layout.global_batch, StepOptions(dtype="fp8"), "nvfp4")
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpu", "b200", "--gpus", "16", "--global-batch",
                       "64", "--precision", "nvfp4", "--top", "1", "--emit", "megatron", "--json")
    d = json.loads(out)
    assert code == 0 and "--fp4-format" in d["emitted"]["megatron"]["text"]
