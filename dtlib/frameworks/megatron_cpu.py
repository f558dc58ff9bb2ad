"""Megatron-Core on CPU ranks (gloo): every shim it needs, in one place, applied only without GPUs.

Megatron-Core 0.16.1 is written for CUDA: it allocates buffers on ``torch.cuda.current_device()``,
has literal ``device="cuda"`` tensors in its pipeline schedules, forks the CUDA RNG around weight
initialisation and dropout, and synchronises CUDA streams around batched point-to-point calls.
None of that computes anything a CPU run needs, so :func:`cpu_shims` redirects it to the CPU for
the duration of a run and :data:`CPU_CONFIG` turns off the two options that need CUDA kernels or
streams. A rank that runs NCCL on its GPU (``dtlib.launch`` with one GPU per rank) patches
nothing: the same functions run on NCCL and CUDA unchanged.

Checked with megatron-core 0.16.1 and torch 2.13.0+cpu (``shared/notes/frameworks-on-cpu.md``);
no upstream issue tracks CPU support, Megatron-Core states it targets NVIDIA GPUs only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shims", "needs_cpu_shims", "CPU_CONFIG", "SHIM_NOTES", "gpt_block_spec",
           "SequenceParallelLayerNorm"]

# ModelParallelConfig fields set on CPU, each with its reason (applied by dtlib.frameworks.megatron_core).
CPU_CONFIG: dict[str, tuple[Any, str]] = {
    "use_cpu_initialization": (True, "build each weight's full master copy on the CPU and keep "
                                     "this rank's slice (the default allocates on the GPU)"),
    "gradient_accumulation_fusion": (False, "the fused weight-gradient kernel "
                                            "(fused_weight_gradient_mlp_cuda, from Apex) is CUDA only"),
    "batch_p2p_sync": (False, "torch.cuda.synchronize() after batch_isend_irecv guards a CUDA stream "
                              "race; there is no stream on CPU (and the call fails without CUDA)"),
}

SHIM_NOTES = [
    "torch.cuda.current_device() -> cpu: Megatron allocates gather/scatter buffers (sequence "
    "parallelism), pipeline receive buffers and DDP gradient buffers on it",
    "device='cuda' -> cpu in tensor factories and .to(), .cuda() -> the tensor itself (a "
    "TorchFunctionMode): the schedules create total_num_tokens with a literal device='cuda' "
    "(schedules.py), tied embeddings move to .cuda() before their first all-reduce",
    "get_cuda_rng_tracker().fork -> a null context: it saves and restores the CUDA RNG state; "
    "dtlib runs without dropout, so no random number is drawn inside it",
    "the CUDA RNG state that activation recomputation saves and restores (tensor_parallel.random"
    "._get_cuda_rng_state/_set_cuda_rng_state) -> an empty state: there is no CUDA generator",
    *(f"ModelParallelConfig({name}={value}): {why}" for name, (value, why) in CPU_CONFIG.items()),
]


def needs_cpu_shims() -> bool:
    """True where this process computes on the CPU, so Megatron-Core's CUDA calls must be
    redirected: inside a gloo process group (``dtlib.launch`` uses gloo without GPUs, or with fewer
    GPUs than ranks), or, outside one, on a machine without a usable GPU."""
    if dist.is_initialized():
        return dist.get_backend() != "nccl"
    return not torch.cuda.is_available()


def _cpu(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU (strings, ``torch.device`` and integer indices)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")  # a bare index means a CUDA device in torch's factories
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=`` arguments that name a CUDA device to the CPU, for every torch call
    made inside the block (``torch.zeros(..., device="cuda")``, ``tensor.to("cuda")``), and makes
    ``tensor.cuda()`` return the (CPU) tensor itself, as it does for a tensor already on the GPU.
    Not active inside ``backward()`` (a mode is off while the call it intercepted runs)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shims() -> Iterator[list[str]]:
    """Apply the CPU shims for the block where :func:`needs_cpu_shims` (a no-op on NCCL ranks)
    and yield the notes that say which were applied (none on GPUs); all is restored on exit."""
    if not needs_cpu_shims():
        yield []
        return
    from megatron.core.tensor_parallel import random as mrandom

    saved = (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork,
             mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        with _CudaToCpu():
            yield list(SHIM_NOTES)
    finally:
        (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork,
         mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) = saved


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` that marks its weights ``sequence_parallel``, as Megatron's
    ``FusedLayerNorm`` does, so ``finalize_model_grads`` sums their gradients over the
    tensor-parallel group (each rank saw only its sequence shard)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def gpt_block_spec(config: Any, vp_stage: int | None) -> Any:
    """The decoder spec of this stage's ``GPTModel``: Megatron's local layer spec
    (``get_gpt_layer_local_spec``), with :class:`SequenceParallelLayerNorm` for every norm when
    sequence parallelism runs without Apex. Megatron's only norm with sequence parallelism is
    Apex's ``FusedLayerNorm``; its fallback, ``WrappedTorchNorm``, refuses ``sequence_parallel``
    because ``torch.nn.LayerNorm`` does not mark its weights for the gradient sum."""
    import dataclasses

    from megatron.core.models.backends import LNImpl
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    spec = get_gpt_layer_local_spec()
    if not (config.sequence_parallel and LNImpl is WrappedTorchNorm):
        return spec
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelLayerNorm,
        pre_mlp_layernorm=SequenceParallelLayerNorm))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=SequenceParallelLayerNorm)
