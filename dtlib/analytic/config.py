"""A transformer described by its shape, with an exact parameter count.

The count follows the module layout of :class:`dtlib.models.gpt.TinyGPT` (pre-norm GPT/Llama
block), so ``cfg.num_parameters() == sum(p.numel() for p in TinyGPT(cfg).parameters())`` exactly;
the tests check this on many configurations. The per-part formulas below are written with plain
arithmetic so that they accept Python numbers *and* numpy arrays: :mod:`dtlib.analytic.vectorised` calls
these same functions on arrays (one copy of each formula).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dtlib.analytic import validate

__all__ = ["TransformerConfig", "num_parameters", "ACTIVATIONS", "NORMS", "POSITIONS",
           "norm_params", "attention_params", "mlp_params", "layer_params", "embedding_params",
           "swiglu_ffn", "SHAPE_RULES"]

ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "alibi")


def swiglu_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's default SwiGLU width: 2/3 of 4h rounded up to ``multiple_of`` (Touvron et al. 2023,
    Sec. 2.2; ``llama/model.py`` FeedForward), which keeps the MLP at ~8h^2 parameters."""
    f = int(2 * 4 * hidden / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


# ---- the formulas (scalars or numpy arrays) --------------------------------------------------
def norm_params(hidden: Any, norm_has_bias: Any) -> Any:
    """LayerNorm holds a weight and (optionally) a bias; RMSNorm only a weight."""
    return hidden * (1 + norm_has_bias)


def attention_params(hidden: Any, heads: Any, kv_heads: Any, bias: Any) -> Any:
    """Q and O are h x h; K and V are h x (kv_heads * head_dim) (GQA, Ainslie et al. 2023)."""
    kv_dim = kv_heads * (hidden // heads)
    return 2 * hidden * hidden + 2 * hidden * kv_dim + bias * (2 * hidden + 2 * kv_dim)


def mlp_params(hidden: Any, ffn: Any, mlp_matrices: Any, bias: Any) -> Any:
    """GELU MLP: 2 matrices (h->f, f->h); SwiGLU: 3 (gate, up, down) (Shazeer 2020)."""
    return mlp_matrices * hidden * ffn + bias * ((mlp_matrices - 1) * ffn + hidden)


def layer_params(hidden: Any, heads: Any, kv_heads: Any, ffn: Any, mlp_matrices: Any, bias: Any,
                 norm_has_bias: Any, experts: Any = 0) -> Any:
    """One transformer block: 2 norms + attention + MLP (or ``experts`` MLPs and an h x E router)."""
    n_mlp = experts + (experts == 0)  # a dense block has one MLP
    return (2 * norm_params(hidden, norm_has_bias) + attention_params(hidden, heads, kv_heads, bias)
            + n_mlp * mlp_params(hidden, ffn, mlp_matrices, bias) + hidden * experts)


def embedding_params(hidden: Any, vocab: Any, seq: Any, learned_positions: Any) -> Any:
    """Token embedding V x h, plus a learned position table seq x h (RoPE and ALiBi have none)."""
    return vocab * hidden + learned_positions * seq * hidden


# ---- the rules a shape must follow: (fields, predicate, message); predicates work on arrays ----
SHAPE_RULES = [
    (("hidden", "heads"), lambda hidden, heads: hidden % heads == 0,
     lambda hidden, heads: f"hidden ({hidden}) must be divisible by heads ({heads}); "
                           f"valid heads divide {hidden}"),
    (("heads", "kv_heads"), lambda heads, kv_heads: heads % kv_heads == 0,
     lambda heads, kv_heads: f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}); "
                             f"valid kv_heads divide {heads}"),
]


# ---- the description ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Shape of a decoder (GPT/Llama-style, pre-norm) transformer.

    ``kv_heads`` defaults to ``heads`` (multi-head attention); ``ffn`` defaults to ``4*hidden``
    for GELU and to :func:`swiglu_ffn` for SwiGLU. ``bias`` applies to every linear layer and to
    LayerNorm (as nanoGPT's ``bias`` flag). ``moe_experts=0`` is a dense model.
    ``embedding_norm`` adds a norm after the embedding (BLOOM).
    """
    name: str = "custom"
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    activation: str = "gelu"
    tied_embeddings: bool = False
    bias: bool = True
    norm: str = "layernorm"
    position: str = "learned"
    moe_experts: int = 0
    moe_top_k: int = 0
    embedding_norm: bool = False
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            validate.integer(name, getattr(self, name))
        for name in ("tied_embeddings", "bias", "embedding_norm"):
            validate.boolean(name, getattr(self, name))
        validate.one_of("activation", self.activation, ACTIVATIONS)
        validate.one_of("norm", self.norm, NORMS)
        validate.one_of("position", self.position, POSITIONS)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn is None:
            ffn = 4 * self.hidden if self.activation == "gelu" else swiglu_ffn(self.hidden)
            object.__setattr__(self, "ffn", ffn)
        validate.integer("kv_heads", self.kv_heads)
        validate.integer("ffn", self.ffn)
        for fields, ok, message in SHAPE_RULES:
            values = {f: getattr(self, f) for f in fields}
            if not ok(**values):
                raise ValueError(message(**values))
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got hidden/heads = {self.head_dim}")
        validate.integer("moe_experts", self.moe_experts, minimum=0)
        validate.integer("moe_top_k", self.moe_top_k, minimum=0)
        if self.moe_experts == 1:
            raise validate.InvalidArgument("moe_experts", "0 (dense) or an integer >= 2", 1)
        if self.moe_experts and not (1 <= self.moe_top_k <= self.moe_experts):
            raise ValueError(f"moe_top_k must be in 1..{self.moe_experts} for an MoE model, "
                             f"got {self.moe_top_k!r}")
        if not self.moe_experts and self.moe_top_k:
            raise ValueError(f"moe_top_k={self.moe_top_k} needs moe_experts >= 2 (got a dense model)")

    # derived sizes -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.activation == "swiglu" else 2

    @property
    def norm_has_bias(self) -> bool:
        return self.norm == "layernorm" and self.bias

    def layer_parameters(self) -> int:
        """Parameters of one transformer block."""
        return layer_params(self.hidden, self.heads, self.kv_heads, self.ffn, self.mlp_matrices,
                            self.bias, self.norm_has_bias, self.moe_experts)

    def embedding_parameters(self) -> int:
        """Input side: token (+ learned position) embeddings and the optional embedding norm."""
        return (embedding_params(self.hidden, self.vocab, self.seq, self.position == "learned")
                + self.embedding_norm * norm_params(self.hidden, self.norm_has_bias))

    def head_parameters(self) -> int:
        """Output side: final norm and, unless tied, the V x h LM head (no bias)."""
        return (norm_params(self.hidden, self.norm_has_bias)
                + (not self.tied_embeddings) * self.vocab * self.hidden)

    def num_parameters(self) -> int:
        """Exact parameter count (tied embeddings counted once)."""
        return num_parameters(self)

    def active_parameters(self) -> int:
        """Parameters a token passes through: MoE layers count ``moe_top_k`` experts, not all."""
        if not self.moe_experts:
            return self.num_parameters()
        unused = (self.moe_experts - self.moe_top_k) * mlp_params(
            self.hidden, self.ffn, self.mlp_matrices, self.bias)
        return self.num_parameters() - self.layers * unused

    def numbers(self, seq: int | None = None) -> dict[str, Any]:
        """The numbers the formulas of :mod:`dtlib.analytic.memory` and :mod:`dtlib.analytic.flops` read (booleans
        as 0/1), so that :mod:`dtlib.analytic.vectorised` can replace any of them by an array."""
        if seq is not None:
            check = validate.rule("seq")[1](seq=seq)
            if not np.all(check):
                raise validate.InvalidArgument("seq", validate.requirement(integer=True, minimum=1), seq)
        return dict(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                    ffn=self.ffn, vocab=self.vocab, seq=self.seq if seq is None else seq, mlp_matrices=self.mlp_matrices,
                    bias=int(self.bias), norm_has_bias=int(self.norm_has_bias),
                    experts=self.moe_experts, top_k=self.moe_top_k,
                    learned_positions=int(self.position == "learned"),
                    embedding_norm=int(self.embedding_norm), tied=int(self.tied_embeddings),
                    swiglu=int(self.activation == "swiglu"))

    def with_(self, **changes: Any) -> "TransformerConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def num_parameters(cfg: TransformerConfig) -> int:
    """Exact parameter count of ``cfg`` (= ``sum(p.numel())`` of ``TinyGPT(cfg)``)."""
    return int(cfg.embedding_parameters() + cfg.layers * cfg.layer_parameters()
               + cfg.head_parameters())

