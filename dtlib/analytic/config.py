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

__all__ = ["TransformerConfig", "num_parameters", "ACTIVATIONS", "NORMS", "POSITIONS", "ROPE_SCALINGS", "ROUTER_SCORES",
           "norm_params", "attention_params", "mlp_params", "moe_mlp_params", "layer_params",
           "moe_layer_count", "sliding_layer_count", "embedding_params", "mtp_params", "swiglu_ffn", "SHAPE_RULES"]

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


def attention_params(hidden: Any, heads: Any, kv_heads: Any, bias: Any, head_dim: Any = None,
                     q_lora_rank: Any = 0, kv_lora_rank: Any = 0, qk_nope_head_dim: Any = 0,
                     qk_rope_head_dim: Any = 0, v_head_dim: Any = 0, norm_has_bias: Any = 0,
                     qk_norm: Any = 0, sinks: Any = 0) -> Any:
    """Weights (+ biases) of one attention block.

    GQA/MHA (Ainslie et al. 2023): Q is h x (heads x head_dim), K and V h x (kv_heads x head_dim),
    O (heads x head_dim) x h; ``head_dim`` defaults to h / heads (HF ``head_dim``: Qwen3 and
    GPT-OSS set heads x head_dim != h). With ``kv_lora_rank > 0`` multi-head latent attention
    (DeepSeek-V2, Sec. 2.1.2-2.1.3, eqs. 9-13; HF ``DeepseekV3Attention``): the query is
    ``q_a_proj`` h x q_lora_rank, its RMSNorm and ``q_b_proj`` q_lora_rank x heads(nope + rope)
    (or one h x heads(nope + rope) matrix when ``q_lora_rank == 0``); keys and values share
    ``kv_a_proj_with_mqa`` h x (kv_lora_rank + rope) (the latent plus one shared rope key), its
    RMSNorm and ``kv_b_proj`` kv_lora_rank x heads(nope + v_head_dim); O is heads v_head_dim x h.
    ``qk_norm`` (GQA only; MLA's latent norms are counted above): one RMSNorm of ``head_dim`` on
    the queries and one on the keys, shared by the heads (Qwen3, HF ``Qwen3Attention.q_norm/k_norm``;
    Megatron-Core ``--qk-layernorm``). ``sinks``: one learned logit per head (GPT-OSS, HF
    ``GptOssAttention.sinks``; Megatron-Core ``--softmax-type learnable``).
    """
    d = hidden // heads if head_dim is None else head_dim
    q_dim, kv_dim = heads * d, kv_heads * d
    gqa = (2 * hidden * q_dim + 2 * hidden * kv_dim
           + bias * (q_dim + 2 * kv_dim + hidden))
    qk = qk_nope_head_dim + qk_rope_head_dim
    compressed_q = q_lora_rank > 0
    query = (compressed_q * (hidden * q_lora_rank + norm_params(q_lora_rank, norm_has_bias)
                             + q_lora_rank * heads * qk + bias * (q_lora_rank + heads * qk))
             + (q_lora_rank == 0) * (hidden * heads * qk + bias * heads * qk))
    key_value = (hidden * (kv_lora_rank + qk_rope_head_dim) + norm_params(kv_lora_rank, norm_has_bias)
                 + kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim)
                 + bias * (kv_lora_rank + qk_rope_head_dim + heads * (qk_nope_head_dim + v_head_dim)))
    output = heads * v_head_dim * hidden + bias * hidden
    mla = kv_lora_rank > 0
    return ((kv_lora_rank == 0) * (gqa + qk_norm * norm_params(2 * d, norm_has_bias))
            + mla * (query + key_value + output) + sinks * heads)


def mlp_params(hidden: Any, ffn: Any, mlp_matrices: Any, bias: Any) -> Any:
    """GELU MLP: 2 matrices (h->f, f->h); SwiGLU: 3 (gate, up, down) (Shazeer 2020)."""
    return mlp_matrices * hidden * ffn + bias * ((mlp_matrices - 1) * ffn + hidden)


def moe_mlp_params(hidden: Any, moe_ffn: Any, mlp_matrices: Any, bias: Any, experts: Any,
                   shared_experts: Any = 0, router_bias: Any = 0) -> Any:
    """An MoE MLP: ``experts`` routed and ``shared_experts`` always-active MLPs, each ``moe_ffn``
    wide (DeepSeekMoE, Dai et al. 2024, Sec. 3; HF ``DeepseekV3MoE`` sizes its shared expert
    ``moe_intermediate_size x n_shared_experts``, the same count), plus the h x E router, with a
    bias of E when ``router_bias`` (GPT-OSS, HF ``GptOssTopKRouter.bias``)."""
    return ((experts + shared_experts) * mlp_params(hidden, moe_ffn, mlp_matrices, bias)
            + hidden * experts + router_bias * experts)


def layer_params(hidden: Any, heads: Any, kv_heads: Any, ffn: Any, mlp_matrices: Any, bias: Any,
                 norm_has_bias: Any, experts: Any = 0, moe_ffn: Any = None, shared_experts: Any = 0,
                 router_bias: Any = 0, **attention: Any) -> Any:
    """One transformer block: 2 norms + attention + a dense MLP ``ffn`` wide (``experts == 0``) or
    an MoE MLP (:func:`moe_mlp_params`, experts ``moe_ffn`` wide, default ``ffn``). ``attention``:
    the keyword arguments of :func:`attention_params` after ``bias`` (head_dim, MLA ranks)."""
    moe_ffn = ffn if moe_ffn is None else moe_ffn
    moe = experts > 0
    mlp = ((experts == 0) * mlp_params(hidden, ffn, mlp_matrices, bias)
           + moe * moe_mlp_params(hidden, moe_ffn, mlp_matrices, bias, experts, shared_experts, router_bias))
    attn = attention_params(hidden, heads, kv_heads, bias, norm_has_bias=norm_has_bias, **attention)
    return 2 * norm_params(hidden, norm_has_bias) + attn + mlp


def mtp_params(hidden: Any, norm_has_bias: Any, block: Any) -> Any:
    """One MTP module (DeepSeek-V3 Sec. 2.2, eq. 21): its transformer ``block``, the h x 2h projection
    M (no bias) and three norms (Megatron-Core ``MultiTokenPredictionLayer``: ``enorm``, ``hnorm``,
    ``final_layernorm``); the embedding and the output head are shared."""
    return block + 2 * hidden * hidden + 3 * norm_params(hidden, norm_has_bias)


def moe_layer_count(layers: Any, experts: Any, dense_layers: Any = 0, layer_freq: Any = 1) -> Any:
    """MoE layers of a model: after ``dense_layers`` dense ones (DeepSeek's
    ``first_k_dense_replace``), every ``layer_freq``-th layer, starting with the first
    (Megatron-Core ``--moe-layer-freq N``: layer i is MoE when i % N == 0); none when dense."""
    remaining = np.maximum(layers - dense_layers, 0)
    return (experts > 0) * ((remaining + layer_freq - 1) // layer_freq)


def sliding_layer_count(layers: Any, sliding_window: Any, global_attention_every: Any = 0) -> Any:
    """Layers attending within the window: none without one; all, or all but every
    ``global_attention_every``-th (layer i global when (i + 1) % k == 0: GPT-OSS's ``layer_types``
    start with a sliding layer, Gemma-3's pattern ends each group with a global one)."""
    every = global_attention_every + (global_attention_every == 0)  # 0: no global layer
    globals_ = (global_attention_every > 0) * (layers // every)
    return (sliding_window > 0) * (layers - globals_)


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
_MOE_ONLY = dict(moe_ffn=None, moe_shared_experts=0, moe_dense_layers=0, moe_layer_freq=1,
                 moe_capacity_factor=None, router_score="softmax", router_expert_bias=False, routed_scaling=1.0,
                 router_bias=False)
ROPE_SCALINGS = ("none", "yarn")
ROUTER_SCORES = ("softmax", "sigmoid")
_MLA_ONLY = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Shape of a decoder (GPT/Llama-style, pre-norm) transformer.

    ``kv_heads`` defaults to ``heads`` (multi-head attention); ``ffn`` defaults to ``4*hidden``
    for GELU and to :func:`swiglu_ffn` for SwiGLU; ``head_dim`` to ``hidden // heads``. ``bias``
    applies to every linear layer but the router and to LayerNorm (as nanoGPT's ``bias`` flag).
    ``embedding_norm`` adds a norm after the embedding (BLOOM).

    Mixture of experts (HF/Megatron names; docs/models.md): ``moe_experts`` routed experts
    (0: dense), ``moe_top_k`` of them per token, each ``moe_ffn`` wide (HF
    ``moe_intermediate_size``; default ``ffn``), plus ``moe_shared_experts`` always-active ones
    of the same width; the first ``moe_dense_layers`` layers are dense (``ffn`` wide), then every
    ``moe_layer_freq``-th layer is MoE; ``moe_capacity_factor`` caps the tokens per expert at
    that multiple of the balanced load (None: dropless).

    Multi-head latent attention (DeepSeek-V2/V3): ``kv_lora_rank > 0`` switches it on, with
    ``q_lora_rank`` (0: no query compression), ``qk_nope_head_dim``, ``qk_rope_head_dim`` and
    ``v_head_dim``; ``head_dim`` is then the query/key head size nope + rope.

    Sliding-window attention: ``sliding_window`` keys per query (0: full attention) on every layer,
    or with ``global_attention_every = k`` on all but every k-th layer (Gemma-3, GPT-OSS: k = 2).

    Fields that change the model but not its parameter count (HF config.json names in brackets;
    what each framework's config makes of them: docs/emit.md): ``rope_theta`` (``rope_theta``: the
    RoPE base, 10000 in Su et al. 2021), ``rope_scaling`` ``none`` or ``yarn`` with
    ``rope_scaling_factor`` (``rope_scaling``; Peng et al. 2023, YaRN), ``norm_eps`` (``rms_norm_eps``
    / ``layer_norm_epsilon``), ``qk_norm`` (RMSNorm on each query and key head, Qwen3: 2 x
    head_dim weights per layer), ``router_score`` ``softmax`` or ``sigmoid``
    (``scoring_func``) with ``router_expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing
    bias, Sec. 2.1.2: not a trained parameter) and ``routed_scaling`` (``routed_scaling_factor``),
    ``attention_sinks`` (a learned logit per head in the softmax, GPT-OSS: heads per layer),
    ``router_bias`` (a bias on the router's E logits, GPT-OSS: E per MoE layer) and
    ``activation_clamp`` (``swiglu_limit``: SwiGLU's inputs clamped to that limit, 0: none).

    ``mtp_layers``: D multi-token-prediction modules (DeepSeek-V3, arXiv:2412.19437, Sec. 2.2, eq. 21;
    HF ``num_nextn_predict_layers``, Megatron-Core ``--mtp-num-layers``; DeepSeek-V3 trains D = 1),
    each a transformer block of the kind of the model's last layer, the projection M of the two
    normalised 2h-wide inputs to h (h x 2h, no bias), and three norms (the two inputs', Megatron-Core
    ``enorm``/``hnorm``, and the shared head's, ``final_layernorm``, HF ``shared_head.norm``); the
    embedding and the output head are the main model's (:func:`mtp_params`).
    MLA's latent RMSNorms are part of ``kv_lora_rank > 0`` (counted in :func:`attention_params`).
    """
    name: str = "custom"
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    head_dim: int | None = None
    activation: str = "gelu"
    tied_embeddings: bool = False
    bias: bool = True
    norm: str = "layernorm"
    position: str = "learned"
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_ffn: int | None = None
    moe_shared_experts: int = 0
    moe_dense_layers: int = 0
    moe_layer_freq: int = 1
    moe_capacity_factor: float | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    global_attention_every: int = 0
    embedding_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    router_score: str = "softmax"
    router_expert_bias: bool = False
    routed_scaling: float = 1.0
    attention_sinks: bool = False
    router_bias: bool = False
    activation_clamp: float = 0.0
    mtp_layers: int = 0
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            validate.integer(name, getattr(self, name))
        for name in ("tied_embeddings", "bias", "embedding_norm", "qk_norm", "router_expert_bias", "attention_sinks",
                     "router_bias"):
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
        self._check_attention()
        rotated = self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim  # MLA: only the rope part
        if self.position == "rope" and rotated % 2:
            name = "qk_rope_head_dim" if self.kv_lora_rank else "head_dim"
            raise ValueError(f"rope needs an even head dimension, got {name} = {rotated}")
        self._check_moe()
        self._check_variants()
        validate.integer("mtp_layers", self.mtp_layers, minimum=0)
        validate.integer("sliding_window", self.sliding_window, minimum=0)
        validate.integer("global_attention_every", self.global_attention_every, minimum=0,
                         maximum=self.layers)
        if self.global_attention_every and not self.sliding_window:
            raise validate.InvalidArgument(
                "global_attention_every", "0 without a sliding window (it says which layers "
                "attend to the whole sequence; set sliding_window > 0)", self.global_attention_every)

    def _check_attention(self) -> None:
        validate.integer("kv_lora_rank", self.kv_lora_rank, minimum=0)
        for name in _MLA_ONLY:
            validate.integer(name, getattr(self, name), minimum=0)
        if not self.kv_lora_rank:
            for name in _MLA_ONLY:
                if getattr(self, name):
                    raise validate.InvalidArgument(
                        name, "0 without multi-head latent attention (set kv_lora_rank > 0 for MLA)",
                        getattr(self, name))
            if self.head_dim is None:
                object.__setattr__(self, "head_dim", self.hidden // self.heads)
            validate.integer("head_dim", self.head_dim)
            return
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            validate.integer(name, getattr(self, name), minimum=1)
        if self.kv_heads != self.heads:
            raise validate.InvalidArgument(
                "kv_heads", f"equal to heads ({self.heads}) with multi-head latent attention "
                "(every head decompresses its own keys and values)", self.kv_heads)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim not in (None, qk):
            raise validate.InvalidArgument(
                "head_dim", f"qk_nope_head_dim + qk_rope_head_dim = {qk} with multi-head latent "
                "attention (or leave it unset)", self.head_dim)
        object.__setattr__(self, "head_dim", qk)

    def _check_variants(self) -> None:
        validate.number("rope_theta", self.rope_theta)
        validate.one_of("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        validate.number("rope_scaling_factor", self.rope_scaling_factor, minimum=1, exclusive=False)
        if self.rope_scaling == "none" and self.rope_scaling_factor != 1:
            raise validate.InvalidArgument("rope_scaling_factor", "1 without rope_scaling (set rope_scaling='yarn')",
                                           self.rope_scaling_factor)
        if self.position != "rope" and (self.rope_scaling != "none" or self.rope_theta != 10000.0):
            raise validate.InvalidArgument("rope_theta" if self.rope_scaling == "none" else "rope_scaling",
                                           "its default without position='rope'",
                                           self.rope_theta if self.rope_scaling == "none" else self.rope_scaling)
        validate.number("norm_eps", self.norm_eps, maximum=1)
        validate.one_of("router_score", self.router_score, ROUTER_SCORES)
        validate.number("routed_scaling", self.routed_scaling)
        validate.number("activation_clamp", self.activation_clamp, minimum=0, exclusive=False)
        if self.activation_clamp and self.activation != "swiglu":
            raise validate.InvalidArgument("activation_clamp", "0 without activation='swiglu' (it clamps SwiGLU's "
                                           "gate and linear inputs)", self.activation_clamp)

    def _check_moe(self) -> None:
        validate.integer("moe_experts", self.moe_experts, minimum=0)
        validate.integer("moe_top_k", self.moe_top_k, minimum=0)
        if self.moe_experts == 1:
            raise validate.InvalidArgument("moe_experts", "0 (dense) or an integer >= 2", 1)
        if not self.moe_experts:
            for name, default in dict(moe_top_k=0, **_MOE_ONLY).items():
                if getattr(self, name) != default:
                    raise validate.InvalidArgument(
                        name, f"{'unset (None)' if default is None else default} for a dense model "
                        "(set moe_experts >= 2 for MoE)", getattr(self, name))
            return
        validate.integer("moe_top_k", self.moe_top_k, minimum=1, maximum=self.moe_experts)
        if self.moe_ffn is None:
            object.__setattr__(self, "moe_ffn", self.ffn)
        validate.integer("moe_ffn", self.moe_ffn)
        validate.integer("moe_shared_experts", self.moe_shared_experts, minimum=0)
        validate.integer("moe_dense_layers", self.moe_dense_layers, minimum=0, maximum=self.layers - 1)
        validate.integer("moe_layer_freq", self.moe_layer_freq, minimum=1,
                         maximum=self.layers - self.moe_dense_layers)
        if self.moe_capacity_factor is not None:
            validate.number("moe_capacity_factor", self.moe_capacity_factor, minimum=0)

    # derived sizes -------------------------------------------------------------------------
    @property
    def mlp_matrices(self) -> int:
        return 3 if self.activation == "swiglu" else 2

    @property
    def norm_has_bias(self) -> bool:
        return self.norm == "layernorm" and self.bias

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE (:func:`moe_layer_count`); 0 for a dense model."""
        return int(moe_layer_count(self.layers, self.moe_experts, self.moe_dense_layers, self.moe_layer_freq))

    @property
    def sliding_layers(self) -> int:
        """How many layers attend within the sliding window (:func:`sliding_layer_count`)."""
        return int(sliding_layer_count(self.layers, self.sliding_window, self.global_attention_every))

    def _attention_kw(self) -> dict[str, Any]:
        return dict(head_dim=self.head_dim, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim, qk_norm=int(self.qk_norm), sinks=int(self.attention_sinks))

    def layer_parameters(self, moe: bool | None = None) -> int:
        """Parameters of one transformer block: an MoE block when ``moe`` (default: whether the
        model has experts), else a dense one."""
        moe = bool(self.moe_experts) if moe is None else moe
        return int(layer_params(self.hidden, self.heads, self.kv_heads, self.ffn, self.mlp_matrices,
                                self.bias, self.norm_has_bias, self.moe_experts if moe else 0,
                                self.moe_ffn, self.moe_shared_experts, int(self.router_bias), **self._attention_kw()))

    @property
    def mtp_moe(self) -> bool:
        """Whether the MTP blocks are MoE blocks: of the kind of the model's last layer (Megatron-Core
        builds them from the decoder's last layer spec; DeepSeek-V3's are MoE)."""
        return self.moe_layers > int(moe_layer_count(self.layers - 1, self.moe_experts, self.moe_dense_layers,
                                                     self.moe_layer_freq))

    def mtp_parameters(self) -> int:
        """Parameters of the ``mtp_layers`` MTP modules (:func:`mtp_params`)."""
        return self.mtp_layers * int(mtp_params(self.hidden, self.norm_has_bias, self.layer_parameters(self.mtp_moe)))

    def embedding_parameters(self) -> int:
        """Input side: token (+ learned position) embeddings and the optional embedding norm."""
        return (embedding_params(self.hidden, self.vocab, self.seq, self.position == "learned")
                + self.embedding_norm * norm_params(self.hidden, self.norm_has_bias))

    def head_parameters(self) -> int:
        """Output side: final norm and, unless tied, the V x h LM head (no bias)."""
        return (norm_params(self.hidden, self.norm_has_bias)
                + (not self.tied_embeddings) * self.vocab * self.hidden)

    def num_parameters(self) -> int:
        """Exact parameter count (tied embeddings counted once): what memory holds."""
        return num_parameters(self)

    def active_parameters(self, input_embedding: bool = True) -> int:
        """Parameters a token passes through: MoE layers count ``moe_top_k`` routed experts (and
        the shared ones), not all ``moe_experts``; what FLOPs use. ``input_embedding=False``
        leaves out the V x h input table (a lookup), as DeepSeek (README_WEIGHTS: "36.6B incl. the
        0.9B output head") and OpenAI's gpt-oss card count; Mistral and Qwen count it."""
        validate.boolean("input_embedding", input_embedding)
        unused = (self.moe_experts - self.moe_top_k) * mlp_params(
            self.hidden, self.moe_ffn or self.ffn, self.mlp_matrices, self.bias)
        lookup = (not input_embedding) * self.vocab * self.hidden
        return int(self.num_parameters() - (self.moe_layers + self.mtp_layers * self.mtp_moe) * unused - lookup)

    def numbers(self, seq: int | None = None) -> dict[str, Any]:
        """The numbers the formulas of :mod:`dtlib.analytic.memory` and :mod:`dtlib.analytic.flops` read (booleans
        as 0/1, None as 0), so that :mod:`dtlib.analytic.vectorised` can replace any of them by an array.

        MoE: ``experts top_k moe_ffn shared_experts dense_layers moe_layer_freq moe_layers``
        (count) and ``capacity_factor`` (0 = dropless); attention: ``head_dim``, MLA's
        ``q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim``;
        ``sliding_window`` (0 = none), ``global_attention_every`` and ``sliding_layers`` (count)."""
        if seq is not None:
            check = validate.rule("seq")[1](seq=seq)
            if not np.all(check):
                raise validate.InvalidArgument("seq", validate.requirement(integer=True, minimum=1), seq)
        return dict(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                    ffn=self.ffn, vocab=self.vocab, seq=self.seq if seq is None else seq, mlp_matrices=self.mlp_matrices,
                    bias=int(self.bias), norm_has_bias=int(self.norm_has_bias),
                    experts=self.moe_experts, top_k=self.moe_top_k,
                    moe_ffn=self.moe_ffn or self.ffn, shared_experts=self.moe_shared_experts,
                    dense_layers=self.moe_dense_layers, moe_layer_freq=self.moe_layer_freq,
                    moe_layers=self.moe_layers, capacity_factor=self.moe_capacity_factor or 0,
                    head_dim=self.head_dim, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim, qk_norm=int(self.qk_norm), sinks=int(self.attention_sinks),
                    router_bias=int(self.router_bias), sliding_window=self.sliding_window,
                    global_attention_every=self.global_attention_every, sliding_layers=self.sliding_layers,
                    learned_positions=int(self.position == "learned"),
                    embedding_norm=int(self.embedding_norm), tied=int(self.tied_embeddings),
                    swiglu=int(self.activation == "swiglu"), rmsnorm=int(self.norm == "rmsnorm"),
                    rope=int(self.position == "rope"), mtp_layers=self.mtp_layers, mtp_moe=int(self.mtp_moe))

    def with_(self, **changes: Any) -> "TransformerConfig":
        """A copy with some fields changed (validated again). A head size or expert width that
        was derived (equal to its default) is derived again from the new widths."""
        if {"hidden", "heads"} & set(changes) and "head_dim" not in changes and not self.kv_lora_rank \
                and self.head_dim == self.hidden // self.heads:
            changes["head_dim"] = None
        if "ffn" in changes and "moe_ffn" not in changes and self.moe_ffn == self.ffn:
            changes["moe_ffn"] = None
        if self.kv_lora_rank or changes.get("kv_lora_rank"):  # MLA on or off: nope + rope, or h / heads
            changes.setdefault("head_dim", None)
        if changes.get("moe_experts", self.moe_experts) == 0 and self.moe_experts:
            changes = {**_MOE_ONLY, **changes}  # a dense copy of an MoE model drops its MoE fields
        return replace(self, **changes)


def num_parameters(cfg: TransformerConfig) -> int:
    """Exact parameter count of ``cfg`` (= ``sum(p.numel())`` of ``TinyGPT(cfg)`` for what TinyGPT
    builds): the dense layers, the :attr:`~TransformerConfig.moe_layers` MoE layers, embeddings, head."""
    dense_layers = cfg.layers - cfg.moe_layers
    return int(cfg.embedding_parameters() + dense_layers * cfg.layer_parameters(moe=False)
               + cfg.moe_layers * cfg.layer_parameters(moe=True) + cfg.head_parameters() + cfg.mtp_parameters())
