"""The memory passes of ZeRO-3 around each gather and reduce-scatter, where an implementation copies.

ZeRO-3 (Rajbhandari et al. 2020, Sec. 5.3) gathers a unit's parameters before its forward and again
before its backward, and reduce-scatters its gradients after its backward: the ``dp_comm`` term of
:mod:`dtlib.plan.steptime` times those collectives. Whether the data are also copied around them
depends on the implementation:

* Megatron-Core's FSDP gathers into the bucket the parameters are views of and reduce-scatters
  from the gradient buffer the weight-gradient GEMMs accumulate into (``megatron_fsdp``'s
  ``ParamAndGradBuffer`` / ``DataParallelBuffer``): no copy (the planner's default);
* ``dtlib.parallel.FSDP`` copies, every pass a read and a write of the buffer (:func:`unit_copy_bytes`;
  PyTorch FSDP2 makes the copy-out and the rank-major copy, and divides, but its gradients are
  separate tensors, not a concatenation):

  - each gather: the all-gather's output is rank-major (each rank's shard of every parameter), so it
    is copied out param-major, every parameter's rows contiguous (``Dim0Layout.to_param_major``;
    FSDP2's ``foreach_all_gather_copy_out``, ``split_with_sizes_copy`` into each parameter,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, torch 2.13): 2 passes over the weights;
  - each reduce-scatter: the parameters' gradients are concatenated into the gathered buffer's
    gradient (autograd's backward of the ``torch.split`` that made the parameters' views), copied
    rank-major (``Dim0Layout.to_rank_major``; FSDP2's ``chunk_cat`` in ``foreach_reduce_scatter_copy_in``)
    and divided by the ranks in place (FSDP2's ``_div_if_needed``): 6 passes over the gradients.

Measured on ``dtlib train``'s TinyGPT (2 layers, hidden 256, 2 gloo ranks, CPU time; docs/plan.md,
"The loop on this machine"): the copy-out took 0.5-0.6 ms per 3.2 MB block unit, the concatenation
0.7 ms, the rank-major copy 0.4 ms and the division 0.16 ms, beside an all-gather of 1.5-1.7 ms and a
reduce-scatter of 3.4-5 ms. The passes run at the device's
:attr:`~dtlib.analytic.hardware.Accelerator.optimizer_bandwidth`, the rate of plain passes over
parameter-sized tensors, as the flat bucket's copies of ``grad_bucket_copy``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["GATHER_PASSES", "REDUCE_PASSES", "unit_copy_bytes"]

GATHER_PASSES = 2  # the all-gather output read, the param-major buffer written
REDUCE_PASSES = 6  # concatenation, rank-major copy, division: each a read and a write


def unit_copy_bytes(weight_bytes: Any, grad_bytes: Any, gathers: Any, reduces: Any) -> Any:
    """Bytes ``dtlib.parallel.FSDP`` moves in copies over a step: ``gathers`` gathers of
    ``weight_bytes`` (this rank's unsharded weights, every unit) and ``reduces`` reduce-scatters of
    ``grad_bytes`` (its unsharded gradients), as the module docstring counts them."""
    return GATHER_PASSES * gathers * weight_bytes + REDUCE_PASSES * reduces * grad_bytes
