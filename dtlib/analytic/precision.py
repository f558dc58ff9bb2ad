"""Bytes per parameter of the model states: the precision conventions, as explicit options.

Calculators disagree mostly because they count different things. Each :class:`Precision` says
what it counts: the working parameters, their gradients, and what the optimizer keeps (fp32
master weights, an fp32 gradient copy, and its states).

======================  =====  =====  ============================  =====  ==========================
convention              param  grad   optimizer                     total  source
======================  =====  =====  ============================  =====  ==========================
``zero``                2      2      4 master + 8 Adam             16     ZeRO paper, Sec. 3.1 (K=12)
``megatron-bf16``       2      4      4 master + 8 Adam             18     Megatron-LM distrib_optimizer.md
``megatron-fp16``       2      2      4 master + 4 grad copy + 8    20     Megatron-LM distrib_optimizer.md
``fp32``                4      4      8 Adam                        16     Megatron-LM distrib_optimizer.md
``fsdp-mixed``          4      4      8 Adam                        16     PyTorch FSDP MixedPrecision
``sgd-momentum``        2      2      4 master + 4 momentum         12     (mixed precision SGD)
``adam-8bit``           2      2      4 master + 2 (two 8-bit)      10     Dettmers et al. 2022
======================  =====  =====  ============================  =====  ==========================
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from dtlib.analytic import validate

__all__ = ["Precision", "precision", "get_precision", "with_grad_reduce", "grad_reduce_dtype", "CONVENTIONS",
           "PRECISIONS", "OPTIMIZERS", "GRAD_REDUCE_DTYPES", "NVFP4_BLOCK", "NVFP4_BYTES", "OPERAND_BYTES"]

PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adam-8bit")
# the dtype the data-parallel gradient buffer is kept and reduced in (Megatron-Core
# DistributedDataParallelConfig.grad_reduce_in_fp32; FSDP2 MixedPrecisionPolicy.reduce_dtype)
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# bytes of optimizer state per parameter: Adam keeps m and v in fp32 (Kingma & Ba 2015);
# 8-bit Adam keeps both in one byte (Dettmers et al. 2022; per-block absmax ignored, < 0.2%).
_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "adam-8bit": 2}


# NVFP4 (NVIDIA 2025, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, Sec. 2; Transformer
# Engine docs, "NVFP4"): 4-bit E2M1 elements packed two per byte, one E4M3 scale per block of 16 consecutive
# elements (2D 16 x 16 blocks for weights, their scale replicated per 1 x 16 block as the tensor cores read it,
# Sec. 4.3), one FP32 scale per tensor (4 bytes: not counted)
NVFP4_BLOCK = 16
NVFP4_BYTES = 0.5 + 1 / NVFP4_BLOCK
# bytes of one GEMM operand element as the tensor cores read it, per matmul precision (dtlib.plan.steptime.DTYPES)
OPERAND_BYTES = {"bf16": 2.0, "fp8": 1.0, "nvfp4": NVFP4_BYTES}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter (``param``, ``grad``; the optimizer's ``master`` weights, ``grad_copy``
    and ``states``) and bytes per activation element."""
    name: str
    param: float
    grad: float
    master: float
    grad_copy: float
    states: float
    activation: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("param", "grad", "master", "grad_copy", "states"):
            validate.number(name, getattr(self, name), minimum=0, exclusive=False)
        validate.number("activation", self.activation)  # divides nothing, but 0-byte activations are a typo

    @property
    def optimizer(self) -> float:
        """Everything the optimizer owns (what ZeRO stage 1 shards)."""
        return self.master + self.grad_copy + self.states

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


def precision(dtype: str = "bf16-mixed", grad_dtype: str | None = None, optimizer: str = "adam",
              fp32_grad_copy: bool = False) -> Precision:
    """Build a convention: ``dtype`` of the working weights/activations, ``grad_dtype`` of the
    gradients (default: the weights' dtype), ``optimizer``; ``fp32_grad_copy`` adds the fp32 copy of
    the gradients that Megatron's fp16 optimizer keeps. Mixed precision adds 4-byte master weights
    (Micikevicius et al. 2018)."""
    validate.one_of("precision", dtype, PRECISIONS)
    validate.one_of("optimizer", optimizer, OPTIMIZERS)
    validate.boolean("fp32_grad_copy", fp32_grad_copy)
    weight = "fp32" if dtype == "fp32" else dtype.split("-")[0]
    grad_dtype = grad_dtype or weight
    validate.one_of("grad_dtype", grad_dtype, _BYTES)
    if dtype == "fp32" and grad_dtype != "fp32":
        raise ValueError(f"fp32 training has fp32 gradients; got grad_dtype={grad_dtype!r}")
    mixed = dtype != "fp32"
    name = f"{dtype}/{grad_dtype} grads/{optimizer}" + ("/fp32 grad copy" if fp32_grad_copy else "")
    return Precision(name=name, param=_BYTES[weight], grad=_BYTES[grad_dtype],
                     master=4 if mixed else 0, grad_copy=4 if fp32_grad_copy else 0,
                     states=_STATE_BYTES[optimizer], activation=_BYTES[weight],
                     source="dtlib.analytic.precision.precision(): see the module table")


CONVENTIONS: dict[str, Precision] = {
    "zero": precision("fp16-mixed", "fp16", "adam"),
    "megatron-bf16": precision("bf16-mixed", "fp32", "adam"),
    "megatron-fp16": precision("fp16-mixed", "fp16", "adam", fp32_grad_copy=True),
    "fp32": precision("fp32", "fp32", "adam"),
    # FSDP mixed precision (FSDP1 MixedPrecision, FSDP2 MixedPrecisionPolicy): the sharded
    # parameters stay fp32 (they are the master weights) and so do the gradient shards; the
    # BF16 copies exist only while a unit is gathered (the ZeRO-3 temporary); activations BF16
    "fsdp-mixed": Precision(name="fsdp-mixed/fp32 shards/adam", param=4, grad=4, master=0, grad_copy=0,
                            states=8, activation=2,
                            source="torch.distributed.fsdp MixedPrecision(param_dtype=bf16): fp32 "
                                   "sharded parameters and gradients, bf16 compute"),
    "sgd-momentum": precision("bf16-mixed", "bf16", "sgd-momentum"),
    "adam-8bit": precision("bf16-mixed", "bf16", "adam-8bit"),
}


def get_precision(spec: "Precision | str") -> Precision:
    """A :class:`Precision`, a convention name from :data:`CONVENTIONS`, or a dtype name."""
    if isinstance(spec, Precision):
        return spec
    if spec in CONVENTIONS:
        return CONVENTIONS[spec]
    if spec in PRECISIONS:
        return precision(spec)
    raise ValueError(f"unknown precision {spec!r}; valid: {', '.join(CONVENTIONS)} or {', '.join(PRECISIONS)}")


def with_grad_reduce(spec: "Precision | str", dtype: str) -> Precision:
    """``spec`` with its gradients kept and reduced in ``dtype`` (one of :data:`GRAD_REDUCE_DTYPES`).

    Megatron-Core's DDP allocates its gradient buffer in FP32 when ``grad_reduce_in_fp32`` is set and
    in the parameters' dtype otherwise, and reduces that buffer (``param_and_grad_buffer.py``), so
    the choice sets both the memory and the bytes on the wire: one number, ``grad``."""
    validate.one_of("grad_reduce_dtype", dtype, GRAD_REDUCE_DTYPES)
    prec = get_precision(spec)
    if dtype != "fp32" and prec.activation == 4:  # pure fp32 training: no 16-bit gradient to reduce
        raise ValueError(f"grad_reduce_dtype {dtype} needs 16-bit training; precision {prec.name!r} trains "
                         f"in fp32 (give grad_reduce_dtype fp32)")
    if _BYTES[dtype] == prec.grad:
        return prec
    # "bf16-mixed/fp32 grads/adam" -> "bf16-mixed/bf16 grads/adam"; names without a grads part say it after
    named = re.sub(r"/(bf16|fp16|fp32) grads", f"/{dtype} grads", prec.name)
    return replace(prec, name=named if named != prec.name else f"{prec.name}, {dtype} grad reduce", grad=_BYTES[dtype],
                   source=prec.source + f"; gradients kept and reduced in {dtype}")


def grad_reduce_dtype(spec: "Precision | str") -> str:
    """The dtype ``spec``'s gradients are reduced in: ``fp32`` for 4 bytes, else ``bf16``
    (``fp16`` for an fp16 convention)."""
    prec = get_precision(spec)
    if prec.grad >= 4:
        return "fp32"
    return "fp16" if "fp16" in prec.name else "bf16"
