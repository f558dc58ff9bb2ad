"""Measured GEMM and FlashAttention throughput against the planner's compute model (needs CUDA).

    python benchmarks/gpu_gemm.py [--gpu h200] [--repeats 20]

For each shape, the measured time of a BF16 ``torch.matmul`` (CUDA events, median of ``--repeats``
after warm-up) next to :func:`dtlib.plan.gemm.gemm_time` at efficiency 1 (the tile- and
wave-quantized tensor-core time, or the HBM roofline) -- their ratio is the measured GEMM
efficiency, to compare with the one fitted number :data:`dtlib.plan.calibration.GEMM_EFFICIENCY`.
Shapes: square sizes; a wave-quantization trio (exactly one wave of 256x128 tiles on the GPU's
SMs, then one tile column more, which needs a second wave, then a single element more: an odd
``N`` that the model counts as one more tile column but which also breaks the rows' alignment); and the weight GEMMs (forward and both backward
GEMMs) of one Llama-3-8B and one GPT-3-175B layer on one tensor-parallel rank, as
:func:`dtlib.plan.gemm.transformer_compute` times them. Then causal FlashAttention
(``scaled_dot_product_attention`` with the flash backend) forward + backward against the model's
``0.5 x 4 b s^2 h`` forward work x (1 + 2.5) at the BF16 peak: the measured attention efficiency,
to compare with :data:`dtlib.plan.calibration.ATTENTION_EFFICIENCY`.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from dtlib.analytic.hardware import get_gpu
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY
from dtlib.plan.gemm import FLASH_BACKWARD, gemm_time


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, each timed by CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _shapes(sms: int) -> list[tuple[str, int, int, int]]:
    shapes = [(f"square {n}", n, n, n) for n in (1024, 2048, 4096, 8192, 16384)]
    # one full wave of 256x128 tiles, then one tile column more (a second, partial wave), then
    # one element more than a wave: N odd breaks cuBLAS's 16-byte alignment of rows
    rows, cols = 12, sms // 12
    shapes += [(f"one wave ({rows * cols} tiles)", 256 * rows, 128 * cols, 8192),
               (f"one wave + 1 tile column", 256 * rows, 128 * (cols + 1), 8192),
               (f"one wave + 1 element (odd N)", 256 * rows, 128 * cols + 1, 8192)]
    for model, h, ffn, kv_dim, tp, tokens in (("llama3-8b", 4096, 14336, 1024, 1, 8192),
                                              ("llama3-8b", 4096, 14336, 1024, 4, 8192),
                                              ("gpt3-175b", 12288, 49152, 12288, 8, 2048)):
        tag = f"{model} tp{tp}"
        qkv_n = (h + 2 * kv_dim) // tp
        shapes += [(f"{tag} qkv fwd", tokens, qkv_n, h), (f"{tag} qkv dX", tokens, h, qkv_n),
                   (f"{tag} qkv dW", h, qkv_n, tokens),
                   (f"{tag} proj fwd", tokens, h, h // tp),
                   (f"{tag} fc1 fwd", tokens, (2 if model.startswith("llama") else 1) * ffn // tp, h),
                   (f"{tag} fc2 fwd", tokens, h, ffn // tp), (f"{tag} fc2 dW", ffn // tp, h, tokens)]
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h200", help="catalogue name whose peak and SMs model this GPU")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    gpu = get_gpu(args.gpu)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"model: {gpu.name}, {gpu.sms} SMs, {gpu.peak('bf16') / 1e12:.1f} TFLOP/s dense bf16")
    print(f"{'shape':<28} {'M':>6} {'N':>6} {'K':>6} {'ms':>8} {'TFLOP/s':>8} {'model ms':>9} {'efficiency':>10}")
    efficiencies = []
    for name, m, n, k in _shapes(gpu.sms):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = _time(lambda: a @ b, args.repeats)
        model = float(gemm_time(m, n, k, gpu))  # efficiency 1: quantized peak or HBM roofline
        efficiencies.append(model / seconds)
        print(f"{name:<28} {m:>6} {n:>6} {k:>6} {seconds * 1e3:8.3f} {2 * m * n * k / seconds / 1e12:8.1f} "
              f"{model * 1e3:9.3f} {model / seconds:10.2f}")
        del a, b
    print(f"GEMM efficiency (model time at efficiency 1 / measured): median {statistics.median(efficiencies):.2f}, "
          f"range {min(efficiencies):.2f}-{max(efficiencies):.2f}; fitted GEMM_EFFICIENCY {GEMM_EFFICIENCY}")

    _fp8(gpu, args.repeats)
    _attention(gpu, args.repeats)


def _fp8(gpu, repeats: int) -> None:
    """FP8 (e4m3) GEMMs through ``torch._scaled_mm`` against the catalogue's dense FP8 peak."""
    if not hasattr(torch, "float8_e4m3fn") or gpu.peak("fp8") is None:
        return
    print(f"\n{'fp8 e4m3 GEMM':<28} {'ms':>8} {'TFLOP/s':>8} {'of fp8 peak':>11}")
    for n in (4096, 8192, 16384):
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt needs
        one = torch.tensor(1.0, device="cuda")
        seconds = _time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), repeats)
        rate = 2 * n ** 3 / seconds
        print(f"square {n:<21} {seconds * 1e3:8.3f} {rate / 1e12:8.1f} {rate / gpu.peak('fp8'):11.2f}")


def _attention(gpu, repeats: int) -> None:
    """Causal attention forward + backward per SDPA backend, as a fraction of the BF16 peak."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print(f"\n{'causal attention':<34} {'backend':>8} {'ms fwd+bwd':>10} {'efficiency':>10}")
    results: dict[str, list[float]] = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for b, s, heads, d in ((1, 8192, 32, 128), (2, 4096, 32, 128), (1, 2048, 96, 128)):
            q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))

            def step() -> None:
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(torch.ones_like(out))

            try:
                seconds = _time(step, repeats)
            except RuntimeError as exc:  # a backend this build or GPU lacks
                print(f"{backend.name}: not available ({str(exc).splitlines()[0][:80]})")
                break
            work = 0.5 * 4 * b * s * s * heads * d * (1 + FLASH_BACKWARD)  # as dtlib.plan.gemm counts it
            efficiency = work / seconds / gpu.peak("bf16")
            results.setdefault(backend.name, []).append(efficiency)
            print(f"b={b} s={s} heads={heads} d={d}{'':<9} {backend.name[:8]:>8} {seconds * 1e3:10.3f} {efficiency:10.2f}")
    for name, values in results.items():
        print(f"attention efficiency {name}: median {statistics.median(values):.2f}")
    print(f"fitted ATTENTION_EFFICIENCY {ATTENTION_EFFICIENCY}")

if __name__ == "__main__":
    main()
