"""The achievable fraction of peak: how fast a GPU runs a transformer's matmuls in practice.

The step-time model (:mod:`dtlib.plan.steptime`) divides the hardware FLOPs by
``peak x fraction``. Everything the model does not describe term by term -- kernel efficiency on
real shapes, memory-bound layers (norms, softmax, activations, the loss), launch gaps, the
slowdown of compute that shares the GPU with overlapped communication -- ends up in this one
number. It is an option (``efficiency=``); the defaults below were fitted once, per device
family, on the published runs of :mod:`dtlib.plan.validation` only (no other data), by
:func:`dtlib.plan.validation.calibrate`, and rounded to two digits. They are not predictions for
other software stacks: a different framework, kernel library or power limit moves them.

=============  ========  ==========================================================================
device         fraction  where it comes from
=============  ========  ==========================================================================
a100-40gb      0.56      fitted on Narayanan et al. 2021 Table 1 + Korthikanti et al. 2022 Table 5
a100-80gb      0.56      (Megatron-LM on DGX A100, bf16/fp16, 312 TFLOP/s dense peak)
h100-sxm       0.38      fitted on torchtitan's Llama 3.1 8B / 70B runs (FSDP, bf16, eager) on
                         H100 at a 500 W power limit: a lower bound for a 700 W H100 SXM
h100-pcie      0.38      not calibrated: the H100 SXM value
h200           0.38      not calibrated: the H100 SXM value (same tensor cores)
b200           0.38      not calibrated: the H100 SXM value
mi300x         0.38      not calibrated: the H100 SXM value
other          0.5       not calibrated: a round guess, stated as such
=============  ========  ==========================================================================
"""
from __future__ import annotations

__all__ = ["ACHIEVABLE_FRACTION", "UNCALIBRATED_FRACTION", "default_efficiency", "efficiency_source"]

A100_FRACTION = 0.56
H100_FRACTION = 0.38
UNCALIBRATED_FRACTION = 0.5

ACHIEVABLE_FRACTION: dict[str, tuple[float, str]] = {
    "a100-40gb": (A100_FRACTION, "fitted on Narayanan et al. 2021 Table 1 and Korthikanti et al. 2022 Table 5"),
    "a100-80gb": (A100_FRACTION, "fitted on Narayanan et al. 2021 Table 1 and Korthikanti et al. 2022 Table 5"),
    "h100-sxm": (H100_FRACTION, "fitted on torchtitan Llama 3.1 8B/70B (H100 at 500 W)"),
    "h100-pcie": (H100_FRACTION, "not calibrated: the H100 SXM value"),
    "h200": (H100_FRACTION, "not calibrated: the H100 SXM value"),
    "b200": (H100_FRACTION, "not calibrated: the H100 SXM value"),
    "mi300x": (H100_FRACTION, "not calibrated: the H100 SXM value"),
}


def default_efficiency(gpu: str) -> float:
    """The documented default fraction of peak for catalogue GPU ``gpu``."""
    return ACHIEVABLE_FRACTION.get(gpu, (UNCALIBRATED_FRACTION, ""))[0]


def efficiency_source(gpu: str) -> str:
    """Where :func:`default_efficiency` of ``gpu`` comes from."""
    return ACHIEVABLE_FRACTION.get(gpu, (0, "not calibrated: a round guess of 0.5"))[1]
