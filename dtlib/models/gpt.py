"""TinyGPT: a small, readable decoder-only transformer (in the spirit of Karpathy's nanoGPT).

It is built from a :class:`~dtlib.analytic.config.TransformerConfig`, so the same description drives
the analytic formulas (:mod:`dtlib.analytic.memory`, :mod:`dtlib.analytic.flops`) and a real model to check them on.

Attention is written out as explicit matrix products (``q @ k^T``, softmax, dropout, ``@ v``)
instead of ``F.scaled_dot_product_attention``. This is deliberate: fused kernels save different
tensors for the backward pass (flash attention keeps no s x s matrix), whereas the explicit version
saves exactly the tensors counted by Korthikanti et al. 2022, Sec. 4.1, so the activation formula
can be checked against what autograd really stores. Grouped-query attention folds the query group
into the sequence axis (``[b, kv, g*s, d] @ [b, kv, d, s]``) so K and V are never expanded, as in
fused GQA kernels.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from dtlib.analytic.config import TransformerConfig
from dtlib.models.moe import MoE

__all__ = ["TinyGPT", "tiny_gpt_config"]


def tiny_gpt_config(**overrides) -> TransformerConfig:
    """A small default for CPU experiments: 2 layers, hidden 64, 4 heads, vocab 256, seq 32."""
    base = dict(name="tiny-gpt", layers=2, hidden=64, heads=4, vocab=256, seq=32,
                source="dtlib default for CPU experiments")
    base.update(overrides)
    return TransformerConfig(**base)


def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=1e-5)
    return nn.LayerNorm(cfg.hidden, bias=cfg.bias)


def _rope_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of rotary embeddings (Su et al. 2021, eq. 34), shape [seq, head_dim]."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _alibi_slopes(heads: int) -> torch.Tensor:
    """Per-head slopes 2^(-8 i / n) of ALiBi (Press et al. 2022, Sec. 3; power-of-two heads)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


class Attention(nn.Module):
    """Causal self-attention with explicit math (see the module docstring for why)."""

    def __init__(self, cfg: TransformerConfig, dropout: float):
        super().__init__()
        self.cfg = cfg
        # the heads this module computes: all of them here, a slice under tensor parallelism
        # (dtlib.parallel.tensor splits them by rank and lowers these two counts)
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, cfg.hidden + 2 * kv_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = dropout
        # the random stream of the attention dropout: the default one, or under tensor
        # parallelism each rank's own (dtlib.parallel.random: its heads are not the others')
        self.dropout_rng = contextlib.nullcontext
        groups = cfg.heads // cfg.kv_heads
        # True above the diagonal = masked; shaped to broadcast over [b, kv, g, s, s]
        self.register_buffer("mask", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1),
                             persistent=False)
        if cfg.position == "rope":
            cos, sin = _rope_tables(cfg.seq, cfg.head_dim)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        if cfg.position == "alibi":
            pos = torch.arange(cfg.seq, dtype=torch.float32)
            distance = pos[None, :] - pos[:, None]  # j - i, <= 0 where not masked
            bias = _alibi_slopes(cfg.heads)[:, None, None] * distance
            self.register_buffer("alibi", bias.view(cfg.kv_heads, groups, cfg.seq, cfg.seq),
                                 persistent=False)

    def _rope(self, x: torch.Tensor, s: int) -> torch.Tensor:
        return x * self.cos[:s] + _rotate_half(x) * self.sin[:s]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        kv, d = self.kv_heads, cfg.head_dim
        g = self.heads // kv
        qkv = self.qkv(x)  # [b, s, (g + 2) * kv * d]; s is the full sequence even if x is a shard
        b, s = qkv.shape[:2]
        q, k, v = qkv.split([g * kv * d, kv * d, kv * d], dim=-1)
        q = q.view(b, s, kv, g, d).permute(0, 2, 3, 1, 4)  # [b, kv, g, s, d]
        # own copies, as matmul makes anyway for kv_heads > 1: with one K/V head (MQA, or one head
        # per tensor-parallel rank) matmul would save views that keep the whole fused QKV
        # output alive for backward, Q included
        k = k.view(b, s, kv, d).transpose(1, 2).contiguous()  # [b, kv, s, d]
        v = v.view(b, s, kv, d).transpose(1, 2).contiguous()
        if cfg.position == "rope":
            q, k = self._rope(q, s), self._rope(k, s)
        q = q.reshape(b, kv, g * s, d) * (1.0 / math.sqrt(d))
        scores = (q @ k.transpose(-2, -1)).view(b, kv, g, s, s)
        if cfg.position == "alibi":
            scores = scores + self.alibi[:, :, :s, :s]
        scores = scores.masked_fill(self.mask[:s, :s], float("-inf"))
        att = F.softmax(scores, dim=-1)
        if self.dropout > 0:
            with self.dropout_rng():
                att = F.dropout(att, self.dropout, self.training)
        y = att.view(b, kv, g * s, s) @ v                   # [b, kv, g*s, d]
        y = y.view(b, kv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, g * kv * d)
        return self.proj(y)


class MLP(nn.Module):
    """GELU MLP (GPT-2) or SwiGLU (Shazeer 2020; Llama): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        if self.swiglu:
            self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, cfg: TransformerConfig, dropout: float, capacity_factor: float | None = None):
        super().__init__()
        self.norm1, self.attn = _norm(cfg), Attention(cfg, dropout)
        self.norm2 = _norm(cfg)
        if cfg.moe_experts:
            self.mlp = MoE(cfg.hidden, cfg.moe_experts, cfg.moe_top_k, lambda: MLP(cfg), capacity_factor)
        else:
            self.mlp = MLP(cfg)
        self.dropout = dropout
        self.dropout_rng = contextlib.nullcontext  # each rank's own under sequence parallelism

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout == 0:
            return x
        with self.dropout_rng():
            return F.dropout(x, self.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))


class TinyGPT(nn.Module):
    """Decoder-only transformer: ``forward(idx[b, s]) -> logits[b, s, vocab]``.

    ``dropout`` (default 0.0) applies to the embeddings, attention probabilities and both residual
    branches, as in GPT-2 and Korthikanti et al.'s activation count; at 0 the dropout calls are
    skipped entirely, so no masks are saved. ``checkpoint=True`` recomputes each block in backward
    (``torch.utils.checkpoint``, non-reentrant): only block inputs are kept ("full" recompute).
    ``cfg.moe_experts > 0`` makes every MLP a :class:`~dtlib.models.moe.MoE` of ``moe_experts``
    MLPs with top-``moe_top_k`` routing; ``moe_capacity_factor`` (default: the config's, None: no
    dropping) caps the tokens per expert. Shapes dtlib only counts (expert width other than
    ``ffn``, shared experts, dense first layers, MLA, ``head_dim``, sliding windows) are refused.
    """

    def __init__(self, cfg: TransformerConfig, dropout: float = 0.0, checkpoint: bool = False,
                 moe_capacity_factor: float | None = None):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        # what dtlib counts analytically (docs/models.md) but TinyGPT does not build
        unbuilt = [name for name, used in (
            ("moe_ffn", cfg.moe_ffn not in (None, cfg.ffn)), ("moe_shared_experts", cfg.moe_shared_experts),
            ("moe_dense_layers", cfg.moe_dense_layers), ("moe_layer_freq", cfg.moe_layer_freq != 1),
            ("head_dim", cfg.head_dim != cfg.hidden // cfg.heads), ("kv_lora_rank", cfg.kv_lora_rank),
            ("sliding_window", cfg.sliding_window)) if used]
        if unbuilt:
            raise ValueError(f"TinyGPT builds every layer alike (full attention with hidden/heads-wide "
                             f"heads; MLPs, or MoE layers of ffn-wide experts), so it cannot build "
                             f"{', '.join(unbuilt)}; these models are described analytically only")
        if moe_capacity_factor is None:
            moe_capacity_factor = cfg.moe_capacity_factor
        self.dropout_rng = contextlib.nullcontext  # the embedding dropout's stream (see Attention)
        self.cfg, self.dropout, self.checkpoint = cfg, dropout, checkpoint
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden) if cfg.position == "learned" else None
        self.emb_norm = _norm(cfg) if cfg.embedding_norm else None
        self.blocks = nn.ModuleList(Block(cfg, dropout, moe_capacity_factor) for _ in range(cfg.layers))
        self.norm_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        # GPT-2 initialisation: N(0, 0.02) weights, zero biases
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token (and learned position) embeddings of ``idx[b, s]``: the input of the first block."""
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"TinyGPT expects a LongTensor [batch, seq], got {idx.dtype} {tuple(idx.shape)}")
        s = idx.shape[1]
        if s > self.cfg.seq:
            raise ValueError(f"sequence length {s} exceeds the configured seq={self.cfg.seq}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=idx.device))
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        if self.dropout > 0:
            with self.dropout_rng():
                x = F.dropout(x, self.dropout, self.training)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: the last block's output -> logits."""
        return self.lm_head(self.norm_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            if self.checkpoint and self.training and torch.is_grad_enabled():
                x = _checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)
