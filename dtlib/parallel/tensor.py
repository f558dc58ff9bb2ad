"""Tensor and sequence parallelism, written from scratch in Megatron-LM's layout.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", Sec. 3) splits each layer over the ``t``
ranks of a group. A linear layer ``Y = X A`` is split either by *columns* of ``A``
(:class:`ColumnParallelLinear`: every rank computes its slice of ``Y`` from the full ``X``) or by
*rows* (:class:`RowParallelLinear`: every rank holds a slice of ``X`` and a partial sum of ``Y``).
A column-parallel layer followed by a row-parallel one needs no communication in between: an MLP
or an attention block (split by heads) costs one all-reduce in forward and one in backward.
The communication sits in two conjugate operators, ``f`` (identity forward, all-reduce
backward) before the column-parallel layer and ``g`` (all-reduce forward, identity backward)
after the row-parallel one; sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) shards the
rest of the block (norms, residual adds) along the sequence and turns them into an all-gather and
a reduce-scatter of the same volume (:mod:`dtlib.parallel.tensor_regions`, re-exported here).
As in Megatron-LM, a column-parallel layer under SP keeps only its sequence shard of the input for
backward and gathers it again there (Sec. 4.2.2), which is what makes Table 2's ``/t`` exact.

The rest follows Megatron-LM's ``core/tensor_parallel``: :class:`VocabParallelEmbedding`,
:func:`vocab_parallel_cross_entropy` (Sec. 3, last paragraph: fuse the output layer with the loss
so the ``b x s x v`` logits are never gathered), :func:`tensor_parallel` to convert a
:class:`~dtlib.models.gpt.TinyGPT`, :func:`full_state_dict` to gather it back, and
:func:`initialize_model_parallel` for data x tensor parallelism (TP ranks adjacent).

About 610 lines, over the usual 400, as Megatron-LM's ``core/tensor_parallel/layers.py``: the
layers, the vocabulary-parallel embedding and loss and the TinyGPT conversion share the group
checks and the parameter attributes (``tensor_model_parallel``, ``partition_dim``) that
:func:`full_state_dict` and :mod:`dtlib.parallel.clip` read; the f/g operators are already apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.models.gpt import MLP, TinyGPT
from dtlib.parallel.collectives import all_reduce_coalesced
from dtlib.parallel.random import MODEL_PARALLEL_RNG, MODEL_PARALLEL_SEED_OFFSET, RNGStatesTracker
from dtlib.parallel.tensor_regions import (SEQ_DIM, SequenceParallelLinear, rank_chunk,
                                           copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           gather_from_tensor_model_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_tensor_model_parallel_region)

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelMLP",
    "vocab_parallel_cross_entropy", "check_tensor_parallel_sizes", "tensor_parallel",
    "allreduce_sequence_parallel_grads",
    "full_state_dict", "full_grad_dict", "model_parallel_ranks", "initialize_model_parallel",
    "TensorParallelState", "SequenceParallelGrads", "SEQUENCE_PARALLEL_GRADS",
]

# who sums the sequence-parallel gradients over TP (see tensor_parallel)
SEQUENCE_PARALLEL_GRADS = ("backward", "manual")


# ---- layers --------------------------------------------------------------------------------------
def _check_group(group: Any) -> Any:
    """``group`` (None = the default group) after checking this rank belongs to it."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run inside dtlib.launch(...) or "
                           "call dist.init_process_group first")
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group gives non-members
        raise ValueError(f"rank {dist.get_rank()} is not a member of the tensor-parallel group it "
                         "was given: every rank builds every group with dist.new_group, then passes "
                         "the one that contains it")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (from dist.new_group or "
                        f"initialize_model_parallel) or None, got {type(group).__name__}")
    return group


def _check_divides(what: dict[str, int], t: int, whole: str = "") -> None:
    """Raise naming the first size that ``t`` does not divide, the degrees that would divide it
    and (``whole``: what the sizes belong to) the degrees that divide them all."""
    for name, value in what.items():
        if value % t:
            common = validate.divisors_of(math.gcd(*what.values()))
            also = f"; valid degrees for {whole}: {common}" if whole else ""
            raise ValueError(f"{name} ({value}) must be divisible by the tensor-parallel degree "
                             f"{t}; valid degrees for {name}: {validate.divisors_of(value)}{also}")


def _segments(split_sizes: list[int], t: int, rank: int) -> list[slice]:
    """Rows of each segment of a fused weight (e.g. Q, K, V) that ``rank`` keeps."""
    out, start = [], 0
    for size in split_sizes:
        chunk = size // t
        out.append(slice(start + rank * chunk, start + (rank + 1) * chunk))
        start += size
    return out


def _mark(p: nn.Parameter, dim: int, split_sizes: list[int] | None = None) -> None:
    """Megatron-LM's parameter attributes: sharded along ``partition_dim`` (``split_sizes``: the
    local sizes of fused segments, gathered segment by segment)."""
    p.tensor_model_parallel, p.partition_dim = True, dim
    p.split_sizes = split_sizes


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A``'s output columns (rows of ``weight``) split over the group.

    Every rank holds ``weight[out/t, in]`` and ``bias[out/t]`` and returns its slice of ``Y``
    (``gather_output=True`` all-gathers it). The input is replicated and enters through ``f``;
    with ``sequence_parallel`` it is a sequence shard, all-gathered first (``f-bar``).
    ``split_sizes`` describes a fused weight (QKV: ``[h, kv*d, kv*d]``): each segment is split
    separately so every rank keeps whole heads of Q, K and V. Built like Megatron-LM's
    ``use_cpu_initialization``: the full layer is initialised (same seed everywhere) and sliced.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, group: Any = None,
                 split_sizes: list[int] | None = None):
        super().__init__()
        self._setup(nn.Linear(in_features, out_features, bias=bias), gather_output,
                    sequence_parallel, group, split_sizes)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, gather_output: bool = False,
                    sequence_parallel: bool = False,
                    split_sizes: list[int] | None = None) -> "ColumnParallelLinear":
        """This rank's slice of ``linear`` (its other rows are not kept)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(linear, gather_output, sequence_parallel, group, split_sizes)
        return self

    def _setup(self, full: nn.Linear, gather_output: bool, sequence_parallel: bool, group: Any,
               split_sizes: list[int] | None) -> None:
        self.group = _check_group(group)
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        split_sizes = list(split_sizes or [full.out_features])
        if sum(split_sizes) != full.out_features:
            raise ValueError(f"split_sizes {split_sizes} must add up to out_features "
                             f"{full.out_features}")
        _check_divides({f"split_sizes[{i}]" if len(split_sizes) > 1 else "out_features": s
                        for i, s in enumerate(split_sizes)}, t)
        if gather_output and len(split_sizes) > 1:
            raise ValueError("gather_output=True with a fused weight (split_sizes) would interleave "
                             "segments of different ranks; gather the segments separately")
        self.in_features, self.out_features = full.in_features, full.out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        rows = _segments(split_sizes, t, rank)
        local = [s // t for s in split_sizes]
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([full.weight[r] for r in rows]).clone())
            self.bias = (nn.Parameter(torch.cat([full.bias[r] for r in rows]).clone())
                         if full.bias is not None else None)
        for p in (self.weight, self.bias):
            if p is not None:
                _mark(p, 0, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(copy_to_tensor_model_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A``'s input rows (columns of ``weight``) split over the group.

    Every rank holds ``weight[out, in/t]`` and computes a partial ``Y``; the partial sums are
    all-reduced (``g``) or, with ``sequence_parallel``, reduce-scattered to sequence shards
    (``g-bar``). The bias is replicated and added *after* the reduction (adding it before would
    count it ``t`` times). ``input_is_parallel=False`` takes the full input and keeps this
    rank's slice.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, sequence_parallel: bool = False,
                 group: Any = None):
        super().__init__()
        self._setup(nn.Linear(in_features, out_features, bias=bias), input_is_parallel,
                    sequence_parallel, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, input_is_parallel: bool = False,
                    sequence_parallel: bool = False) -> "RowParallelLinear":
        """This rank's slice of ``linear`` (its other columns are not kept)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(linear, input_is_parallel, sequence_parallel, group)
        return self

    def _setup(self, full: nn.Linear, input_is_parallel: bool, sequence_parallel: bool,
               group: Any) -> None:
        self.group = _check_group(group)
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        _check_divides({"in_features": full.in_features}, t)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (the input of a "
                             "row-parallel layer comes from a column-parallel one), as in Megatron")
        self.in_features, self.out_features = full.in_features, full.out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        with torch.no_grad():
            self.weight = nn.Parameter(full.weight.chunk(t, 1)[rank].clone())
            self.bias = nn.Parameter(full.bias.clone()) if full.bias is not None else None
        _mark(self.weight, 1)
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # added on a sequence shard: partial gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the group (Megatron-LM).

    Rank ``r`` holds rows ``[r*v/t, (r+1)*v/t)``; a token outside them gives zeros, so the sum over
    ranks (``g``, or ``g-bar`` to sequence shards with ``reduce_scatter_embeddings``) is the
    embedding. ``embedding.padding_idx`` is kept: the pad row, on the rank that holds it, gets no
    gradient, as in ``nn.Embedding``. ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are
    refused: each looks at the lookups of the whole vocabulary (a rank's out-of-shard tokens are
    looked up as its row 0 and masked, so it would renormalise or count that row).
    """

    def __init__(self, embedding: nn.Embedding, group: Any = None,
                 reduce_scatter_embeddings: bool = False):
        super().__init__()
        unsupported = {"max_norm": embedding.max_norm is not None,
                       "scale_grad_by_freq": embedding.scale_grad_by_freq, "sparse": embedding.sparse}
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"VocabParallelEmbedding does not support nn.Embedding's {name} "
                                 f"(got {name}={getattr(embedding, name)!r}): build the embedding "
                                 "without it; padding_idx is supported")
        self.group = _check_group(group)
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        _check_divides({"vocab": embedding.num_embeddings}, t)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.vocab_start = rank * embedding.num_embeddings // t
        self.vocab_end = self.vocab_start + embedding.num_embeddings // t
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.padding_idx = embedding.padding_idx  # nn.Embedding stores it >= 0
        pad = self.padding_idx
        self.local_padding_idx = (pad - self.vocab_start if pad is not None
                                  and self.vocab_start <= pad < self.vocab_end else None)
        with torch.no_grad():
            self.weight = nn.Parameter(embedding.weight[self.vocab_start:self.vocab_end].clone())
        _mark(self.weight, 0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = dist.get_world_size(self.group)
        if self.reduce_scatter_embeddings and idx.shape[SEQ_DIM] % t:
            raise ValueError(f"sequence parallelism needs the sequence length ({idx.shape[SEQ_DIM]})"
                             f" to be divisible by the tensor-parallel degree {t}")
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight, self.local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_model_parallel_region(partial, self.group)


class _SequenceShardPositions(nn.Embedding):
    """Learned positions under SP: each rank looks up the positions of its own sequence shard;
    the rows it never touches get no gradient here, so the gradient is summed over the group."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(rank_chunk(positions, 0, self.group))


class ParallelMLP(nn.Module):
    """TinyGPT's MLP split Megatron's way: ``up`` (and ``gate``) column-parallel, ``down``
    row-parallel, so the only communication is ``f`` before and ``g`` after. SwiGLU's gate and up
    are fused into one column-parallel ``gate_up`` (Megatron's ``fc1``): one ``f`` (one gather
    with SP) for both, instead of two."""

    def __init__(self, mlp: MLP, group: Any = None, sequence_parallel: bool = False):
        super().__init__()
        self.swiglu = mlp.swiglu
        if self.swiglu:
            fused = nn.Linear(mlp.up.in_features, 2 * mlp.up.out_features, bias=mlp.up.bias is not None)
            with torch.no_grad():
                fused.weight.copy_(torch.cat([mlp.gate.weight, mlp.up.weight]))
                if fused.bias is not None:
                    fused.bias.copy_(torch.cat([mlp.gate.bias, mlp.up.bias]))
            self.gate_up = ColumnParallelLinear.from_linear(
                fused, group, sequence_parallel=sequence_parallel, split_sizes=[mlp.up.out_features] * 2)
            for p in self.gate_up.parameters():
                p.full_names = ("gate", "up")  # full_state_dict restores TinyGPT's names
        else:
            self.up = ColumnParallelLinear.from_linear(mlp.up, group, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear.from_linear(mlp.down, group, input_is_parallel=True,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


# ---- the loss on vocabulary-sharded logits --------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary shards (Megatron-LM ``_VocabParallelCrossEntropy``):
    the max and ``[target logit, sum of exp]`` are all-reduced; only ``b*s`` numbers travel.
    Tokens whose target is ``ignore_index`` count for nothing: the mean is over the others and
    their gradient is zero (``F.cross_entropy``'s ``ignore_index``, reduction ``"mean"``)."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        logits = logits.float()
        v_local = logits.shape[-1]
        start = dist.get_rank(group) * v_local
        logits_max = logits.amax(dim=-1)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # for a stable exp
        shifted = logits - logits_max.unsqueeze(-1)
        ignored = targets == ignore_index
        outside = (targets < start) | (targets >= start + v_local) | ignored
        local = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        stats = torch.stack([target_logit, exp.sum(dim=-1)])
        dist.all_reduce(stats, group=group)  # one message for both sums
        loss = (stats[1].log() - stats[0]).masked_fill(ignored, 0.0)
        counted = (~ignored).sum()  # 0 if every token is ignored: NaN, as F.cross_entropy gives
        softmax = exp.div_(stats[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside, ignored, counted)
        return loss.sum() / counted

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside, ignored, counted = ctx.saved_tensors
        onehot = F.one_hot(local, softmax.shape[-1]).masked_fill(outside.unsqueeze(-1), 0)
        scale = grad / counted  # d mean / d token loss
        return ((softmax - onehot) * scale).masked_fill(ignored.unsqueeze(-1), 0.0), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 group: Any = None, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)``
    (the mean over the tokens whose target is not ``ignore_index``, PyTorch's default -100 for
    padding) from this rank's vocabulary shard ``local_logits[..., v/t]``, never materialising the
    full logits. ``targets`` holds token ids of the full vocabulary, the same on every rank; one
    outside ``[0, vocab)`` (other than ``ignore_index``) raises before any communication, as
    PyTorch raises on it."""
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must be local_logits' shape without the "
                         f"vocabulary dimension, {tuple(local_logits.shape[:-1])}")
    vocab = local_logits.shape[-1] * dist.get_world_size(group)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        raise IndexError(f"targets hold {targets[bad][0].item()}, outside the vocabulary [0, {vocab}) "
                         f"and not ignore_index={ignore_index} (F.cross_entropy raises on it too)")
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, ignore_index)


# ---- a whole TinyGPT --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorParallelState:
    """What :func:`tensor_parallel` leaves on the model (``model.tensor_parallel_state``)."""
    group: Any
    size: int
    rank: int
    sequence_parallel: bool


def check_tensor_parallel_sizes(cfg: TransformerConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ``ValueError`` naming the first size of ``cfg`` that ``tp`` does not divide: heads
    and K/V heads (split by head), ffn, vocab, and with sequence parallelism seq."""
    sizes = {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab}
    if sequence_parallel:
        sizes["seq"] = cfg.seq
    _check_divides(sizes, tp, whole="this model")


def tensor_parallel(model: TinyGPT, group: Any = None, sequence_parallel: bool = False,
                    sequence_parallel_grads: str = "backward") -> TinyGPT:
    """Convert ``model`` in place to tensor (and sequence) parallelism over ``group``; return it.

    Every rank of the group must have built the same model (same seed); each keeps its slice:
    attention by heads (fused QKV column-parallel, K/V heads of grouped-query attention split too,
    output projection row-parallel), MLP column-then-row (:class:`ParallelMLP`), the token
    embedding by vocabulary, and the LM head column-parallel, so ``model(idx)`` returns this rank's
    vocabulary shard of the logits ``[b, s, v/t]`` (use :func:`vocab_parallel_cross_entropy`).
    Every rank passes the same full ``idx``. With ``sequence_parallel`` the norms and residual
    stream hold ``s/t`` positions, and the gradients of the parameters used on sequence shards
    (norms, row-parallel biases, learned positions) must be summed over the group.
    ``sequence_parallel_grads`` says who sums them: ``"backward"`` (default) does it during every
    backward pass, as each gradient is produced (:class:`SequenceParallelGrads`), so a plain
    ``loss.backward(); optimizer.step()`` trains the right parameters, gradient accumulation
    included -- as DTensor's ``SequenceParallel`` needs no extra call either; ``"manual"`` leaves
    it to the training loop, which calls :func:`allreduce_sequence_parallel_grads` after the last
    backward of a step, where Megatron-LM does it (``finalize_model_grads``).
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"tensor_parallel converts a dtlib TinyGPT, got {type(model).__name__}")
    if getattr(model, "tensor_parallel_state", None) is not None:
        raise ValueError("this model is already tensor-parallel (tensor_parallel was called on it "
                         "before); build a fresh TinyGPT to convert it again")
    if model.dropout > 0 and model.checkpoint:
        raise ValueError(f"dropout={model.dropout} with checkpoint=True: recomputation would replay the "
                         "attention dropout from the tracker's advanced stream, another mask than the "
                         "forward's (Megatron restores the tracker's states in its CheckpointFunction, "
                         "dtlib does not); use dropout=0.0 or checkpoint=False under tensor parallelism")
    if sequence_parallel_grads not in SEQUENCE_PARALLEL_GRADS:
        raise ValueError(f"sequence_parallel_grads must be one of {SEQUENCE_PARALLEL_GRADS}, "
                         f"got {sequence_parallel_grads!r}")
    group = _check_group(group)
    cfg, t, rank = model.cfg, dist.get_world_size(group), dist.get_rank(group)
    check_tensor_parallel_sizes(cfg, t, sequence_parallel)  # before the first collective
    sp = sequence_parallel
    kv_dim = cfg.kv_heads * cfg.head_dim

    model.wte = VocabParallelEmbedding(model.wte, group, reduce_scatter_embeddings=sp)
    if sp and model.wpe is not None:
        wpe = _SequenceShardPositions(cfg.seq, cfg.hidden)
        wpe.weight, wpe.group = model.wpe.weight, group
        wpe.weight.sequence_parallel = True
        model.wpe = wpe
    for block in model.blocks:
        attn = block.attn
        attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, sequence_parallel=sp,
                                                    split_sizes=[cfg.hidden, kv_dim, kv_dim])
        attn.proj = RowParallelLinear.from_linear(attn.proj, group, input_is_parallel=True,
                                                  sequence_parallel=sp)
        attn.heads, attn.kv_heads = cfg.heads // t, cfg.kv_heads // t
        if cfg.position == "alibi":  # per-head slopes: keep this rank's heads
            attn.alibi = attn.alibi.chunk(t, 0)[rank].clone()
        block.mlp = ParallelMLP(block.mlp, group, sequence_parallel=sp)
    tied = cfg.tied_embeddings
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, sequence_parallel=sp)
    if tied:  # the embedding's vocabulary rows are exactly the LM head's output rows
        model.lm_head.weight = model.wte.weight
    if sp:
        norms = [model.norm_f, model.emb_norm, *(n for b in model.blocks for n in (b.norm1, b.norm2))]
        for norm in norms:
            for p in (norm.parameters() if norm is not None else []):
                p.sequence_parallel = True
    if model.dropout > 0:
        _fork_dropout(model, rank, sp)
    model.tensor_parallel_state = TensorParallelState(group, t, rank, sp)
    if sp and sequence_parallel_grads == "backward":
        model.sequence_parallel_grads = SequenceParallelGrads(model, group)
    return model


def _fork_dropout(model: TinyGPT, rank: int, sequence_parallel: bool) -> None:
    """Megatron's dropout streams (:mod:`dtlib.parallel.random`): attention probabilities are split
    by heads, so each rank draws its own mask; the residual stream and the embeddings are this
    rank's ``s/t`` positions under sequence parallelism (their own masks too), and replicated
    otherwise (the default stream, the same on every TP rank). The seed is drawn from the
    default stream, which every rank of the group holds in the same state (same model seed)."""
    seed = int(torch.randint(0, 2 ** 31 - 1 - MODEL_PARALLEL_SEED_OFFSET - 1024, ()).item())
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + rank)
    model.rng_tracker = tracker
    for block in model.blocks:
        block.attn.dropout_rng = tracker.fork
        if sequence_parallel:
            block.dropout_rng = tracker.fork
    if sequence_parallel:
        model.dropout_rng = tracker.fork


def _state(model: nn.Module, what: str) -> TensorParallelState:
    state = getattr(model, "tensor_parallel_state", None)
    if state is None:
        raise ValueError(f"{what} needs a model converted by tensor_parallel(model, group); this "
                         f"{type(model).__name__} was never converted")
    return state


def _sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters used on sequence shards, in the model's (rank-independent) order."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


class SequenceParallelGrads:
    """Sums each sequence-parallel gradient over the TP group as backward produces it.

    Every TP rank sees only its ``s/t`` positions, so a norm weight's gradient on one rank is a
    partial sum (Korthikanti et al. 2022, Sec. 4.2.2; DTensor marks it ``Partial(sum)`` and
    reduces it before use). A hook on each such parameter all-reduces this backward's gradient
    *before* autograd accumulates it into ``.grad``: gradient accumulation over micro-batches
    stays right, and whatever consumes ``.grad`` during backward (DDP's bucket hooks, ZeRO-2's
    reduce-scatter) already sees the full sum. The price is one small all-reduce per parameter
    and backward, where Megatron-LM sums them all in one flat buffer after the last backward of a
    step (``finalize_model_grads``; the ``"manual"`` mode of :func:`tensor_parallel`). The same
    parameters receive gradients in the same order on every TP rank (same model, same graph), so
    the all-reduces match up.
    """

    def __init__(self, model: nn.Module, group: Any):
        self.group = group
        self.params = _sequence_parallel_params(model)
        for p in self.params:
            p.register_hook(self._sum)

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()  # a fresh tensor: autograd may hand the same buffer to other nodes
        dist.all_reduce(total, group=self.group)
        return total


def allreduce_sequence_parallel_grads(model: TinyGPT) -> None:
    """Sum over the TP group the gradients of parameters used on sequence shards (norms, biases
    of row-parallel layers, learned positions): one all-reduce of one flat buffer. A no-op
    without sequence parallelism, and when the model sums them itself during backward
    (``tensor_parallel(..., sequence_parallel_grads="backward")``, the default), so calling it
    too is harmless. Megatron-LM calls it in
    ``finalize_model_grads``."""
    state = _state(model, "allreduce_sequence_parallel_grads")
    if getattr(model, "sequence_parallel_grads", None) is not None:
        return  # summed by the model's hooks already
    grads = [p.grad for p in _sequence_parallel_params(model) if p.grad is not None]
    if not state.sequence_parallel or not grads:
        return
    all_reduce_coalesced(grads, state.group)


def _gather_param(t: torch.Tensor, p: nn.Parameter, state: TensorParallelState) -> list[torch.Tensor]:
    """The full tensor(s) of ``p``'s shard ``t``: one, or one per fused segment."""
    if not getattr(p, "tensor_model_parallel", False):
        return [t.detach().clone()]
    shards = [torch.empty_like(t) for _ in range(state.size)]
    dist.all_gather(shards, t.detach().contiguous(), group=state.group)
    local = p.split_sizes or [t.shape[p.partition_dim]]
    pieces = [s.split(local, dim=p.partition_dim) for s in shards]  # [rank][segment]
    segments = [torch.cat([pieces[r][i] for r in range(state.size)], dim=p.partition_dim)
                for i in range(len(local))]
    return segments if getattr(p, "full_names", None) else [torch.cat(segments, p.partition_dim)]


def _full(model: TinyGPT, group: Any, what: str, grads: bool,
          values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    state = _state(model, what)
    if group is not None and group is not state.group:
        raise ValueError(f"{what}: group is not the group the model was converted with")
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if values is not None and name not in values:
            continue
        t = values[name] if values is not None else p.grad if grads else p
        if t is None:
            raise ValueError(f"{name} has no gradient: run backward before {what}")
        full = _gather_param(t, p, state)
        names = getattr(p, "full_names", None)
        if names:  # a fused gate_up -> TinyGPT's gate and up
            prefix, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
            out.update({f"{prefix}.{n}.{leaf}": f for n, f in zip(names, full)})
        else:
            out[name] = full[0]
    return out


def full_state_dict(model: TinyGPT, group: Any = None,
                    values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full, unsharded parameters on every rank, with TinyGPT's own names and shapes (a
    collective over the TP group: every rank must call it). ``values``: TP-local tensors to
    gather instead of the parameters, by the model's names (those of FSDP's
    ``gather_full_params``, when FSDP shards the TP slabs further); names not in it are skipped."""
    return _full(model, group, "full_state_dict", grads=False, values=values)


def full_grad_dict(model: TinyGPT, group: Any = None) -> dict[str, torch.Tensor]:
    """The full gradients, named like :func:`full_state_dict` (after backward, and after
    :func:`allreduce_sequence_parallel_grads` with sequence parallelism)."""
    return _full(model, group, "full_grad_dict", grads=True)


# ---- data x tensor parallelism -------------------------------------------------------------------
def model_parallel_ranks(world_size: int, tensor_model_parallel_size: int) -> dict[str, list[list[int]]]:
    """The TP and DP groups of ``world_size`` ranks, Megatron-LM's order: TP ranks adjacent
    (``[0, 1], [2, 3]`` for tp=2 on 4 ranks, so a TP group shares a node's fast links), DP groups
    strided (``[0, 2], [1, 3]``)."""
    t = validate.divisor("tensor_model_parallel_size", tensor_model_parallel_size, world_size, "the world size")
    tp = [list(range(start, start + t)) for start in range(0, world_size, t)]
    dp = [list(range(r, world_size, t)) for r in range(t)]
    return {"tp": tp, "dp": dp}


def initialize_model_parallel(tensor_model_parallel_size: int) -> tuple[Any, Any]:
    """This rank's ``(tp_group, dp_group)`` (Megatron-LM ``parallel_state``); every rank creates
    every group in the same order, as ``dist.new_group`` requires."""
    rank = dist.get_rank()
    ranks = model_parallel_ranks(dist.get_world_size(), tensor_model_parallel_size)
    mine = {}
    for kind in ("tp", "dp"):
        for members in ranks[kind]:
            g = dist.new_group(members)
            if rank in members:
                mine[kind] = g
    return mine["tp"], mine["dp"]
