"""Context parallelism: ring attention for causal self-attention, written by hand.

Each of the ``cp`` ranks of a context-parallel group holds a shard of the sequence (queries, keys
and values of its tokens). Ring attention (Liu et al. 2023, "Ring Attention with Blockwise
Transformers", Sec. 3) passes the K/V blocks around the ring: at step ``t`` rank ``i`` attends to
the block of rank ``i - t`` while sending the block it holds to rank ``i + 1``, and merges the
partial results with the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al.
2022, Sec. 3.1): keep the running log-sum-exp ``lse`` of each query row and rescale.

Load balancing. With a causal mask a contiguous split leaves rank 0 almost idle (its queries see
only its own keys) and the last rank with most of the work. Megatron-core's context parallelism
(and Llama 3, Dubey et al. 2024, Sec. 3.3.2) cuts the sequence into ``2 x cp`` chunks and gives
rank ``i`` chunks ``i`` and ``2cp - 1 - i`` ("zig-zag"): every rank then computes the same number of
unmasked query-key pairs (:func:`causal_work`). Blocks that are entirely masked are skipped.

Backward recomputes each block's probabilities from the saved ``lse`` (as FlashAttention does) and
sends the key/value gradients around the ring with their blocks, so after ``cp`` hops each rank holds
the gradient of its own keys and values.

``torch.distributed.tensor.experimental.context_parallel`` does not run on CPU (causal SDPA has no
sharding strategy for ``_scaled_dot_product_flash_attention_for_cpu``), which is why the ring is here.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.models.gpt import _rotate_half

__all__ = ["chunk_ids", "shard_positions", "shard_sequence", "unshard_sequence", "causal_work",
           "ring_attention", "ContextParallelAttention", "context_parallel"]


def chunk_ids(rank: int, cp: int, zigzag: bool = True) -> tuple[int, int]:
    """The two of the ``2 * cp`` sequence chunks rank ``rank`` holds: ``(i, 2cp-1-i)`` zig-zag
    (Megatron-core), ``(2i, 2i+1)`` contiguous."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in 0..{cp - 1}, got {rank}")
    return (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)


def _chunk(seq: int, cp: int) -> int:
    if seq % (2 * cp):
        raise ValueError(f"context parallelism cuts the sequence into 2 x cp = {2 * cp} chunks; "
                         f"seq={seq} must be a multiple of {2 * cp}")
    return seq // (2 * cp)


def shard_positions(rank: int, cp: int, seq: int, zigzag: bool = True) -> torch.Tensor:
    """Positions (0..seq-1) of the tokens rank ``rank`` holds, in its local order."""
    c = _chunk(seq, cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp, zigzag)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """This rank's shard of ``x`` along the sequence dimension ``dim``."""
    return x.index_select(dim, shard_positions(rank, cp, x.shape[dim], zigzag).to(x.device))


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard_sequence`)."""
    cp = len(shards)
    seq = sum(s.shape[dim] for s in shards)
    order = torch.cat([shard_positions(r, cp, seq, zigzag) for r in range(cp)])
    out = torch.cat(shards, dim)
    return out.index_select(dim, torch.argsort(order).to(out.device))


def causal_work(cp: int, seq: int, zigzag: bool = True) -> list[int]:
    """Unmasked query-key pairs each rank computes under a causal mask (the attention FLOPs are
    proportional to it): equal on every rank with the zig-zag split."""
    work = []
    for r in range(cp):
        pos = shard_positions(r, cp, seq, zigzag)
        work.append(int(sum(int(p) + 1 for p in pos)))  # query p sees keys 0..p
    return work


def _pairs(q_chunks: tuple[int, int], k_chunks: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """(local q chunk, local k chunk, diagonal?) for every block that is not entirely masked."""
    return [(a, b, qc == kc) for a, qc in enumerate(q_chunks) for b, kc in enumerate(k_chunks) if kc <= qc]


class _RingExchange:
    """A ring hop in flight: ``wait()`` returns what the previous rank sent."""

    def __init__(self, send: torch.Tensor, group: Any):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.send, self.recv = send.contiguous(), torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, self.send, dist.get_global_rank(group, (rank + 1) % cp), group),
               dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % cp), group)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.recv


class _RingAttention(torch.autograd.Function):
    """Causal ring attention on ``[batch, heads, 2c, head_dim]`` local q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        mask = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for t in range(cp):
            src = (rank - t) % cp
            if t < cp - 1:  # start the next hop before computing on this block
                nxt = _RingExchange(kv, group)
            for a, b, diagonal in _pairs(chunk_ids(rank, cp, zigzag), chunk_ids(src, cp, zigzag)):
                qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                scores = (q[:, :, qs] @ kv[0][:, :, ks].transpose(-2, -1)) * scale
                if diagonal:
                    scores = scores.masked_fill(mask, float("-inf"))
                new_lse = torch.logaddexp(lse[:, :, qs], torch.logsumexp(scores, -1))
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - new_lse)[..., None]
                                 + torch.exp(scores - new_lse[..., None]) @ kv[1][:, :, ks])
                lse[:, :, qs] = new_lse
            if t < cp - 1:
                kv = nxt.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, zigzag = ctx.group, ctx.zigzag
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        mask = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
        delta = (dout * out).sum(-1)  # D_i = rowsum(dO * O) (FlashAttention-2, Alg. 2)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # gradients of the block held now; travels with it
        for t in range(cp):
            src = (rank - t) % cp
            for a, b, diagonal in _pairs(chunk_ids(rank, cp, zigzag), chunk_ids(src, cp, zigzag)):
                qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                kb, vb = kv[0][:, :, ks], kv[1][:, :, ks]
                scores = (q[:, :, qs] @ kb.transpose(-2, -1)) * scale
                if diagonal:
                    scores = scores.masked_fill(mask, float("-inf"))
                p = torch.exp(scores - lse[:, :, qs, None])
                dv_block = p.transpose(-2, -1) @ dout[:, :, qs]
                ds = p * (dout[:, :, qs] @ vb.transpose(-2, -1) - delta[:, :, qs, None])
                dq[:, :, qs] += (ds @ kb) * scale
                dkv[0][:, :, ks] += (ds.transpose(-2, -1) @ q[:, :, qs]) * scale
                dkv[1][:, :, ks] += dv_block
            # the gradients follow their block; the last hop brings them home (cp hops in all)
            if t < cp - 1:
                kv, dkv = _RingExchange(torch.cat([kv, dkv]), group).wait().split(2)
            else:
                dkv = _RingExchange(dkv, group).wait()
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                   zigzag: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    ``q, k, v``: ``[batch, heads, local_seq, head_dim]``, this rank's shard
    (:func:`shard_sequence` with the same ``zigzag``); returns this rank's shard of the output.
    ``group``: the context-parallel group (``None``: all ranks).
    Equal to ``softmax(q k^T / sqrt(d) + causal mask) v`` on the full sequence, and differentiable.
    """
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must have one shape [batch, heads, local_seq, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (expand grouped KV heads first)")
    if q.shape[2] % 2:
        raise ValueError(f"each rank holds 2 chunks of the sequence; local_seq={q.shape[2]} must be even")
    return _RingAttention.apply(q, k, v, dist.group.WORLD if group is None else group, zigzag)


class ContextParallelAttention(nn.Module):
    """A TinyGPT :class:`~dtlib.models.gpt.Attention` whose core is :func:`ring_attention`.

    Takes over the wrapped module's projections (``qkv``, ``proj``) and RoPE tables under the same
    names, so parameter names and objects are unchanged; ``positions`` are the global positions of
    the local tokens.
    """

    def __init__(self, attn: nn.Module, group: Any, positions: torch.Tensor, zigzag: bool = True):
        super().__init__()
        if getattr(attn, "dropout", 0) > 0 or attn.cfg.position == "alibi":
            raise ValueError("context parallelism supports dropout=0 and learned or RoPE positions")
        self.cfg, self.qkv, self.proj = attn.cfg, attn.qkv, attn.proj
        # the heads this rank computes: a slice of them under tensor parallelism
        self.heads = getattr(attn, "heads", attn.cfg.heads)
        self.kv_heads = getattr(attn, "kv_heads", attn.cfg.kv_heads)
        self.group, self.zigzag = group, zigzag
        # rank-specific tables: plain attributes, not buffers, so that wrappers which broadcast
        # a model's buffers from one rank (DDP, FSDP) leave them alone
        if self.cfg.position == "rope":
            self.cos, self.sin = attn.cos[positions], attn.sin[positions]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, heads, kv_heads = self.cfg.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = q.view(b, s, heads, d).transpose(1, 2)
        k = k.view(b, s, kv_heads, d).transpose(1, 2)
        v = v.view(b, s, kv_heads, d).transpose(1, 2)
        if self.cfg.position == "rope":
            q, k = (t * self.cos + _rotate_half(t) * self.sin for t in (q, k))
        groups = heads // kv_heads  # GQA: query head i uses KV head i // groups
        if groups > 1:  # (with MHA, K and V stay views of the fused QKV output: no extra copy)
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        y = ring_attention(q, k, v, self.group, self.zigzag)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * d))


class _ShardedPositionEmbedding(nn.Module):
    """A learned position table looked up at this rank's global positions (TinyGPT passes
    ``arange(local_seq)``; the shard's tokens sit elsewhere in the sequence). Keeps the table's
    ``weight`` under the same name."""

    def __init__(self, table: nn.Embedding, positions: torch.Tensor):
        super().__init__()
        self.weight = table.weight
        self.positions = positions  # rank-specific: not a buffer (see ContextParallelAttention)

    def forward(self, _local: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.positions, self.weight)


def context_parallel(model: nn.Module, group: Any, zigzag: bool = True) -> nn.Module:
    """Make a TinyGPT context-parallel over ``group`` in place: every attention becomes
    :class:`ContextParallelAttention` and the learned position table reads the shard's global
    positions. Feed it :func:`shard_sequence` of the tokens (and shard the targets the same way).
    Parameters keep their objects and names, so optimizers and state dicts are unchanged."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    positions = shard_positions(rank, cp, model.cfg.seq, zigzag)
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, group, positions, zigzag)
    if model.wpe is not None:
        model.wpe = _ShardedPositionEmbedding(model.wpe, positions)
    return model
