"""The fixed cost of every kernel a transformer layer launches: what dominates when a GPU holds little work.

Each term of :mod:`dtlib.plan.steptime` is work over a rate (FLOPs over the tensor cores, bytes over
HBM or a link); a collective also pays a latency per call (the alpha of the alpha-beta model,
:mod:`dtlib.analytic.comm`). A kernel pays one too: even with the launch queue full, the GPU takes a
few microseconds per kernel to fetch, set up and retire it, whatever its work. NVIDIA measured
that floor on null kernels at about :data:`KERNEL_LAUNCH_S` = 3 us on recent hardware and software
(N. Juffa, NVIDIA developer forums, "Too much time for kernel launch latency", 2022:
https://forums.developer.nvidia.com/t/too-much-time-for-kernel-launch-latency/233645/3, "the launch
overhead of null kernels ... about 3 microseconds ... a new speed of light"). At 8K tokens per
micro-batch a layer's GEMMs take milliseconds and 3 us per kernel is noise; at a few hundred
tokens per GPU (an 8B model with one eighth of a sequence per GPU) a layer's kernels each run for
tens of microseconds and the floor is a tenth of the step. The figure is the device's
(:attr:`dtlib.analytic.hardware.Accelerator.kernel_launch_s`): the catalogue's GPUs have NVIDIA's,
a calibrated machine its own, measured by ``dtlib calibrate`` (on CPU ranks, eager PyTorch's
per-operator dispatch and autograd cost, :mod:`dtlib.plan.calibrate`).

Kernels per layer, forward (:data:`FORWARD_KERNELS`, or the count of the model's own, the
``forward`` argument: ``dtlib calibrate`` counts ``dtlib train``'s TinyGPT's operators), for a Llama
block as the stacks launch it:

* ``fused`` (Megatron-Core + Transformer Engine, or ``torch.compile``): LayerNormLinear's norm and
  QKV GEMM, fused RoPE, attention, the output projection, bias-dropout-add, LayerNormMLP's norm,
  FC1, SwiGLU and FC2, the second bias-dropout-add: 11 (Megatron-Core ``TransformerLayer`` with
  ``TELayerNormColumnParallelLinear``, ``TEDotProductAttention``, ``TERowParallelLinear``);
* ``eager`` (PyTorch without fusion, torchtitan's Llama): the 7 weight GEMMs (wq, wk, wv, wo, w1,
  w2, w3), attention, and the memory-bound operators one kernel each as :mod:`dtlib.plan.eager`
  counts them: 6 per RMSNorm (x2), 3 per RoPE tensor (x2), 2 for SwiGLU, 1 per residual add (x2),
  1 per repeat of K and V (x2) and the attention output's copy: 33.

Backward launches two kernels for each forward one (each GEMM's dgrad and wgrad; each
elementwise kernel's gradient reads and writes what the forward did, :data:`dtlib.plan.eager.PASSES`),
so forward + backward is 3 x the forward, and full recompute adds one forward. FP8 matmuls add the
quantization of each GEMM's input forward and of its output gradient backward, one kernel each
(Transformer Engine fuses the scaling into the cast: 4 GEMMs x 2). The experts of an MoE layer have
their own per-expert launches (:func:`dtlib.plan.moe.grouped_gemm_overhead`); collectives pay NCCL's
latency (:func:`dtlib.analytic.comm.nccl_time`). Neither is counted here.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic.hardware import KERNEL_LAUNCH_S
from dtlib.plan.eager import PASSES

__all__ = ["KERNEL_LAUNCH_S", "FORWARD_KERNELS", "FP8_CASTS", "layer_kernels", "launch_time"]

FORWARD_KERNELS = {"fused": 11, "eager": 33}
FP8_CASTS = 4 * 2  # forward input and backward output-gradient casts of the 4 weight GEMMs


def layer_kernels(fused: Any, dtype: str, recompute: str, forward: int | None = None) -> Any:
    """Kernels one layer launches per micro-batch, forward and backward (see the module docstring);
    ``forward``: the layer's forward kernels if counted (default :data:`FORWARD_KERNELS` by ``fused``)."""
    if forward is None:
        forward = np.where(fused, FORWARD_KERNELS["fused"], FORWARD_KERNELS["eager"])
    repeated = {"none": 0, "selective": 0, "full": 1}.get(recompute, 0)
    return (PASSES + repeated) * forward + (FP8_CASTS if dtype == "fp8" else 0)


def launch_time(layers: Any, num_microbatches: Any, fused: Any, dtype: str, recompute: str,
                seconds_per_kernel: float = KERNEL_LAUNCH_S, forward: int | None = None) -> Any:
    """Seconds the kernels of ``layers`` layers cost beyond their work, over ``num_microbatches``."""
    return layers * num_microbatches * layer_kernels(fused, dtype, recompute, forward) * seconds_per_kernel
