"""Fine-tuning: the full model, or LoRA adapters on frozen weights.

``FineTuning("full")`` trains every weight: the same memory, FLOPs and traffic as pre-training.
``FineTuning("lora", rank=r, targets=...)`` is LoRA (Hu et al. 2021, arXiv:2106.09685, Sec. 4.1):
each targeted weight matrix W (d_in x d_out) stays frozen and learns W + A B with A d_in x r and
B r x d_out, so ``r (d_in + d_out)`` trainable parameters per matrix (Sec. 4.2: no gradients and
no optimizer states for the frozen weights). What follows from it, counted here and in
:mod:`dtlib.analytic.memory`, :mod:`dtlib.analytic.flops` and :mod:`dtlib.plan.steptime`:

* memory: the frozen weights once, in the working dtype (no gradient, no optimizer state, no
  master copy); the adapters with the full precision convention (weights, gradients, optimizer);
* FLOPs: the forward of the base and the adapters; the backward passes the activation gradient
  through every frozen matrix (dgrad, 1x its forward) but computes no weight gradient for it (wgrad,
  the other 1x: a backward is dgrad + wgrad, each as costly as the forward, Narayanan et al. 2021,
  Sec. 5.1), so the frozen weights cost 2x their forward per token instead of 3x; the adapters
  (and attention, which has no weights) keep 3x;
* data parallelism reduces only the adapters' gradients.

Targets are named as HF PEFT's ``target_modules`` names them on Llama and DeepSeek-V3 in HF
Transformers (:data:`LORA_TARGETS`): ``q_proj k_proj v_proj o_proj`` (GQA/MHA attention),
``q_proj`` (uncompressed query) or ``q_a_proj q_b_proj``, ``kv_a_proj_with_mqa kv_b_proj`` and
``o_proj`` (multi-head latent attention), ``gate_proj up_proj down_proj`` (the MLP; with a GELU MLP
``up_proj`` and ``down_proj`` are its two matrices, dtlib's ``fc1`` and ``fc2``; in an MoE layer
every routed expert's and the shared expert's). ``tests/test_finetune.py`` compares the adapter
count with PEFT's own ``get_nb_trainable_parameters`` on HF models of the same shapes.

Under tensor parallelism dtlib splits an adapter as its matrix is split: for a column-parallel
matrix (output split) B is split and A replicated, for a row-parallel one (input split) A is split
and B replicated (Shoeybi et al. 2019, Sec. 3's split of W carried to the factor on the split side;
an assumption of dtlib, not read from a framework). Routed experts' adapters go with their expert
(over ``ep``, and ``etp`` as the dense matrices over ``tp``).

Every function reads the model's numbers (:meth:`~dtlib.analytic.config.TransformerConfig.numbers`)
plus ``lora_rank`` (0: every weight trained) and ``lora_targets`` (a bit mask of
:data:`LORA_TARGETS`), scalars or numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dtlib.analytic import validate

__all__ = ["FineTuning", "FINETUNE", "resolve_finetune", "LORA_TARGETS", "DEFAULT_LORA_TARGETS", "target_mask", "target_on", "target_shapes",
           "adapter_params", "adapter_layer_params", "check_targets"]

FINETUNE = ("full", "lora")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                "kv_b_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's default for Llama (peft.utils.constants TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")
_GQA_ONLY = ("k_proj", "v_proj")
_MLA_ONLY = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


@dataclass(frozen=True)
class FineTuning:
    """What a run trains: ``method`` ``full`` (every weight) or ``lora`` (adapters of ``rank`` on
    the ``targets``, the frozen rest); see the module's docstring."""
    method: str = "full"
    rank: int | None = None
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        validate.one_of("finetune", self.method, FINETUNE)
        if self.method == "full":
            for name, value in (("lora_rank", self.rank), ("lora_targets", self.targets)):
                if value is not None:
                    raise validate.InvalidArgument(name, "unset unless finetune is 'lora' (full fine-tuning "
                                                   "trains every weight)", value)
            return
        validate.integer("lora_rank", self.rank, minimum=1)
        targets = DEFAULT_LORA_TARGETS if self.targets is None else tuple(self.targets)
        if not targets:
            raise validate.InvalidArgument("lora_targets", f"one or more of {', '.join(LORA_TARGETS)}", targets)
        for t in targets:
            validate.one_of("lora_targets", t, LORA_TARGETS)
        object.__setattr__(self, "targets", tuple(dict.fromkeys(targets)))

    @property
    def lora(self) -> bool:
        return self.method == "lora"

    def numbers(self) -> dict[str, int]:
        """``lora_rank`` (0 for full fine-tuning) and ``lora_targets`` (:func:`target_mask`)."""
        return {"lora_rank": self.rank if self.lora else 0, "lora_targets": target_mask(self.targets or ())}

    def describe(self) -> str:
        if not self.lora:
            return "full fine-tuning (every weight trained: as pre-training)"
        return f"LoRA rank {self.rank} on {', '.join(self.targets)} (Hu et al. 2021; base weights frozen)"


def resolve_finetune(finetune: "FineTuning | None", shaped: bool = True) -> FineTuning:
    """``finetune`` checked (None: full fine-tuning); LoRA needs a model shape (``shaped``)."""
    finetune = FineTuning() if finetune is None else finetune
    if not isinstance(finetune, FineTuning):
        raise validate.InvalidArgument("finetune", "a FineTuning (dtlib.analytic.finetune)", finetune)
    if finetune.lora and not shaped:
        raise validate.InvalidArgument("finetune", "'full' for a bare parameter count (LoRA's targets are "
                                                   "matrices of the layers: give a model shape)", finetune.method)
    return finetune


def target_mask(targets: tuple[str, ...]) -> int:
    """The targets as a bit mask of :data:`LORA_TARGETS` (a number the vectorised formulas carry)."""
    return sum(1 << LORA_TARGETS.index(t) for t in targets)


def check_targets(finetune: FineTuning, n: dict[str, Any]) -> None:
    """Every target names a matrix of this model (scalars: one model): GQA's ``k_proj``/``v_proj``
    and MLA's projections each only on their attention, ``q_proj`` on MLA only without query
    compression, ``gate_proj`` only with SwiGLU."""
    if not finetune.lora:
        return
    mla, swiglu = int(n.get("kv_lora_rank", 0)) > 0, int(n.get("mlp_matrices", 2)) == 3
    compressed_q = int(n.get("q_lora_rank", 0)) > 0
    absent = {"k_proj": mla, "v_proj": mla, "q_a_proj": not compressed_q, "q_b_proj": not compressed_q,
              "kv_a_proj_with_mqa": not mla, "kv_b_proj": not mla, "q_proj": compressed_q, "gate_proj": not swiglu}
    wrong = [t for t in finetune.targets if absent.get(t, False)]
    if wrong:
        present = [t for t in LORA_TARGETS if not absent.get(t, False)]
        raise validate.InvalidArgument("lora_targets", f"matrices this model has: {', '.join(present)}",
                                       ",".join(wrong))


def target_on(mask: Any, name: str) -> Any:
    """1 where the bit mask ``mask`` (:func:`target_mask`) holds target ``name``, else 0."""
    return (np.asarray(mask) >> LORA_TARGETS.index(name)) & 1


def target_shapes(n: dict[str, Any], moe: bool) -> list[tuple[str, Any, Any, str, Any, bool]]:
    """``(target, d_in, d_out, split, copies, routed)`` of one layer's matrices LoRA can target:
    ``split`` ``column`` (output over tp), ``row`` (input over tp) or ``replicated``; ``routed``: one
    matrix of each of the ``copies`` routed experts (split over etp instead of tp); ``moe``: the MoE
    layer, else a dense one."""
    h, heads, kv_heads = n["hidden"], n["heads"], n["kv_heads"]
    head_dim = n.get("head_dim", h // heads)
    q_rank, kv_rank = n.get("q_lora_rank", 0), n.get("kv_lora_rank", 0)
    nope, rope, v_dim = n.get("qk_nope_head_dim", 0), n.get("qk_rope_head_dim", 0), n.get("v_head_dim", 0)
    mla, compressed_q = (np.asarray(kv_rank) > 0) * 1, (np.asarray(q_rank) > 0) * 1
    q_out = np.where(mla, heads * (nope + rope), heads * head_dim)
    shapes = [("q_proj", h, q_out, "column", 1 - compressed_q, False),
              ("k_proj", h, kv_heads * head_dim, "column", 1 - mla, False),
              ("v_proj", h, kv_heads * head_dim, "column", 1 - mla, False),
              ("o_proj", np.where(mla, heads * v_dim, heads * head_dim), h, "row", 1, False),
              ("q_a_proj", h, q_rank, "replicated", compressed_q, False),
              ("q_b_proj", q_rank, heads * (nope + rope), "column", compressed_q, False),
              ("kv_a_proj_with_mqa", h, kv_rank + rope, "replicated", mla, False),
              ("kv_b_proj", kv_rank, heads * (nope + v_dim), "column", mla, False)]
    swiglu = (np.asarray(n.get("mlp_matrices", 2)) == 3) * 1
    if not moe:
        mlps = [(n["ffn"], 1, False)]
    else:  # HF DeepseekV3MoE: one shared MLP shared_experts x moe_ffn wide, and the routed experts
        moe_ffn = n.get("moe_ffn", n["ffn"])
        shared = n.get("shared_experts", 0)
        mlps = [(shared * moe_ffn, (np.asarray(shared) > 0) * 1, False), (moe_ffn, n["experts"], True)]
    for width, copies, routed in mlps:
        shapes += [("gate_proj", h, width, "column", copies * swiglu, routed),
                   ("up_proj", h, width, "column", copies, routed),
                   ("down_proj", width, h, "row", copies, routed)]
    return shapes


def adapter_layer_params(n: dict[str, Any], moe: bool, *, tp: Any = 1, ep: Any = 1, etp: Any = 1,
                         active: bool = False) -> dict[str, Any]:
    """Adapter parameters of one layer on one GPU: ``dense`` (attention, dense and shared MLPs,
    split over ``tp``) and ``expert`` (the routed experts' ``experts / ep``, each split over
    ``etp``); ``active``: per token instead, the routed experts counted ``top_k`` times."""
    r, mask = n.get("lora_rank", 0), n.get("lora_targets", 0)
    dense = expert = 0
    for name, d_in, d_out, split, copies, routed in target_shapes(n, moe):
        group = etp if routed else tp
        side_in = d_in / np.where(split == "row", group, 1)
        side_out = d_out / np.where(split == "column", group, 1)
        adapters = target_on(mask, name) * r * (side_in + side_out)
        if routed:
            expert = expert + adapters * (np.where(copies > 0, n.get("top_k", 0), 0) if active else copies / ep)
        else:
            dense = dense + adapters * copies
    return {"dense": dense, "expert": expert}


def adapter_params(n: dict[str, Any], active: bool = False) -> Any:
    """Adapter parameters of the whole model; ``active``: those a token passes through (the routed
    experts' ``top_k``), as FLOPs count them."""
    moe_layers = n.get("moe_layers", 0)
    dense, moe = adapter_layer_params(n, False, active=active), adapter_layer_params(n, True, active=active)
    return ((n["layers"] - moe_layers) * (dense["dense"] + dense["expert"])
            + moe_layers * (moe["dense"] + moe["expert"]))
