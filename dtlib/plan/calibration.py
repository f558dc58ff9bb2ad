"""The planner's few fitted numbers, and where each comes from.

The compute model (:mod:`dtlib.plan.gemm`) times each GEMM from its shape (tile and wave
quantization on the GPU's SMs, roofline against HBM) and attention from FlashAttention's work.
What is left is how close real kernels get to the quantized peak. That is two global numbers,
the same for every GPU generation (no per-family constant):

=====================  =========  ===========================================================
parameter              value      meaning
=====================  =========  ===========================================================
``GEMM_EFFICIENCY``    see below  cuBLAS/CUTLASS GEMM throughput / the quantized tensor-core peak
``ATTENTION_EFFICIENCY``  below   FlashAttention's time at peak / its real time: matmuls at the dense
                                  BF16 peak plus softmax exponentials at the special-function units' rate
=====================  =========  ===========================================================

Both were fitted once by :func:`dtlib.plan.validation.fit` (a grid search minimising the mean
absolute log error of the predicted throughput) on the declared training set
:data:`dtlib.plan.published.PUBLISHED` (every run of every source), and rounded to the grid.
``python -m dtlib.plan.validation`` refits them and prints the in-sample and leave-one-source-out
errors (``docs/validation.md``). A power limit, FP8 and the SM count are physics, not fits: they are
options and catalogue entries (``StepOptions.power_limit_w``, ``dtype``,
:mod:`dtlib.analytic.hardware`).

``efficiency=`` in :class:`dtlib.plan.steptime.StepOptions` still replaces the whole compute
model by the older flat form (hardware FLOPs / (peak x fraction)), as an explicit option.
"""
from __future__ import annotations

__all__ = ["GEMM_EFFICIENCY", "ATTENTION_EFFICIENCY", "FITTED_ON", "efficiency_source"]

# fitted by dtlib.plan.validation.fit on every run of dtlib.plan.published.PUBLISHED
GEMM_EFFICIENCY = 0.60
ATTENTION_EFFICIENCY = 0.50
# the attention kernel of each software stack scales ATTENTION_EFFICIENCY (dtlib.analytic.stacks)
FITTED_ON = ("186 runs of seventeen sources: Narayanan et al. 2021 T1, Korthikanti et al. 2022 T5, BLOOM, torchtitan, "
             "Megatron-Bridge 25.11 (with its GB200/GB300 racks and MoE models) and 26.04.01 (NVFP4), NeMo 2024 "
             "(24.07 and its long-sequence table), NeMo 2024 fine-tuning (24.07 Llama 2 SFT and LoRA), "
             "Megatron-Bridge fine-tuning (26.06 Llama 3 70B SFT and LoRA on GB300, GB200, H100), "
             "NeMo 2025 (25.02 B200, 25.04 GB200), DGX Cloud Benchmarking 25.07 (NeMo 25.04 on H100 and GB200), "
             "MosaicML llm-foundry, "
             "Trainy's torchtitan on H200, DeepSpeed on Azure, Llama 3, DeepSeek-V3, AMD's Primus runs (A100, H100, "
             "H200, H800, B200, GB200, GB300, MI325X and MI355X; dtlib.plan.published)")


def efficiency_source(gpu: str = "") -> str:
    """Where the compute model's numbers come from (the same for every GPU)."""
    return (f"GEMM efficiency {GEMM_EFFICIENCY:.2f} and FlashAttention efficiency {ATTENTION_EFFICIENCY:.2f}, "
            f"the same for every GPU, fitted on {FITTED_ON} (docs/validation.md)")
