"""``dtlib plan --emit torchtitan --rehearse``, full size: the planned model at its real width and
depth, sharded as torchtitan shards it, one training step measured by PyTorch's own memory tracker
for one rank of the planned world size, beside ``dtlib memory``'s prediction for that rank.

How (the method of torchtitan's ``scripts/estimate/estimation.py``, v0.2.2; its code is not copied):

* the model: :class:`Transformer`, a torchtitan-style Llama (``tok_embeddings``, ``layers``,
  ``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``, ``norm``, ``output``) built from the
  preset's :class:`~dtlib.analytic.config.TransformerConfig`, attention through
  ``F.scaled_dot_product_attention`` (a FlashAttention-style kernel: no s x s matrix kept, K/V
  never expanded for GQA), no dropout;
* every tensor is a fake tensor (``FakeTensorMode``: shapes and dtypes, no storage), the process
  group is ``"fake"`` (``FakeStore``) of world size ``dp x tp``, this process rank 0; the device is
  ``cpu`` (torchtitan uses ``cuda`` under fake mode; this CPU-only torch cannot create CUDA
  tensors, fake or not): fake tensors allocate nothing, so the device only decides which kernels
  autograd records, which matters for RMSNorm (:class:`RMSNorm`);
* sharding as torchtitan's ``llama3/infra/parallelize.py`` applies it: ``parallelize_module`` with
  ``RowwiseParallel`` embedding, ``ColwiseParallel`` Q/K/V/w1/w3, ``RowwiseParallel`` O/w2, with
  sequence parallelism ``SequenceParallel`` norms and a loss-parallel output; then ``fully_shard``
  on the embedding, each block, ``[norm, output]`` (kept unsharded after forward) and the root,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (torchtitan's defaults);
  ``recompute == "full"`` wraps each block in ``torch.utils.checkpoint`` (torchtitan's full AC);
* one step: forward of ``micro_batch_size`` sequences of ``seq`` tokens, fp32 cross-entropy,
  backward, ``AdamW`` step, under ``FSDPMemTracker``. The optimizer state exists before the
  tracked step (one step on zero gradients), as in every step after the first.

AdamW runs its for-loop implementation (``foreach=False``): under fake tensors the tracker counted
the foreach and fused implementations' step at 27-34x the optimizer state (127 GiB for llama3-8b
on 8 ranks), far beyond the few parameter-sized lists the foreach code allocates (not traced
further), while the for-loop's temporaries are one parameter's at a time, as the fused CUDA kernel
torchtitan defaults to keeps none.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.units import GiB

__all__ = ["Transformer", "TERMS", "FullSize", "check_fullsize", "measure", "compare_with_dtlib",
           "rehearse_full_size", "fullsize_lines"]

# what this measurement expresses: torch-native FSDP2 over dp x TP (+SP); everything else refused
_UNSUPPORTED_LAYOUT = (("pp", 1, "pipeline stages (one stage's model and its micro-batches in flight)"),
                       ("cp", 1, "context parallelism (torch's context_parallel is not applied here)"),
                       ("ep", 1, "expert parallelism"), ("etp", 1, "expert tensor parallelism"))
# the tracker's categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType) -> dtlib's terms
TERMS: dict[str, tuple[str, ...]] = {
    "parameters": ("Sharded Param",),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "optimizer": ("OptState",),
    "activations": ("Activation",),
    # what lives only while a unit or a backward op runs: gathered bf16 weights, their buffers, the
    # backward's own temporaries (gradients of activations), rope tables and the input ids
    "temporary": ("Unsharded Param", "All Gather", "Reduce Scatter", "Temp", "Buffer", "Inputs"),
}


def check_fullsize(model: TransformerConfig, layout: Parallelism) -> None:
    """One line naming what the full-size measurement cannot build or shard, or nothing."""
    for name, unused, what in _UNSUPPORTED_LAYOUT:
        if getattr(layout, name) != unused:
            raise ValueError(f"full-size rehearsal: {name} {getattr(layout, name)} is not measured ({what}); "
                             f"valid: FSDP2 over dp x tensor parallelism (tp, sequence parallelism), pp = cp = ep = 1")
    if layout.dp > 1 and layout.zero not in (2, 3):
        raise ValueError(f"full-size rehearsal: zero {layout.zero} with dp {layout.dp} is data parallelism without "
                         f"sharding (DDP), not measured; valid: zero 3 (FSDP2) or 2 (FSDP2 kept unsharded after "
                         f"forward)")
    if layout.recompute not in ("none", "full") or layout.recompute_layers or layout.recompute_modules:
        raise ValueError(f"full-size rehearsal: recompute {layout.recompute!r} is not measured; valid: 'none', "
                         f"'full' (torchtitan's full activation checkpointing)")
    unbuilt = [name for name, used in (
        ("moe_experts", model.moe_experts), ("kv_lora_rank (MLA)", model.kv_lora_rank),
        ("sliding_window", model.sliding_window), ("embedding_norm", model.embedding_norm),
        ("position 'alibi'", model.position == "alibi"),
        ("tied_embeddings with tp > 1", model.tied_embeddings and layout.tp > 1)) if used]
    if unbuilt:
        raise ValueError(f"full-size rehearsal builds dense transformers with full attention; {model.name} has "
                         f"{', '.join(unbuilt)}")
    for name, size in (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn", model.ffn),
                       ("vocab", model.vocab)):
        if size % layout.tp:
            raise ValueError(f"full-size rehearsal: {name} {size} is not divisible by tp {layout.tp}")
    if layout.sequence_parallel and model.seq % layout.tp:
        raise ValueError(f"full-size rehearsal: seq {model.seq} is not divisible by tp {layout.tp} "
                         f"(sequence parallelism)")


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4) saving what CUDA's ``_fused_rms_norm`` saves for
    backward: the input, the fp32 ``rstd`` per row and the weight (PyTorch's derivatives.yaml).
    On CPU, fake tensors included, ``torch.rms_norm`` decomposes and saves fp32 copies of the
    input and of the normalised input: 3 more bf16-hidden-sized tensors per norm than a GPU keeps."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        grad_w = (grad.float() * normed).flatten(0, -2).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameter) whose autograd keeps what the GPU kernel keeps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x, self.weight, self.eps)


def _norm(cfg: TransformerConfig, width: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(width, eps=1e-5)
    return nn.LayerNorm(width, bias=cfg.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    """Q/K/V/O projections and SDPA with rotary embeddings (Su et al. 2021, eq. 34)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.head_dim
        self.head_dim, self.rope = d, cfg.position == "rope"
        self.wq = nn.Linear(cfg.hidden, cfg.heads * d, bias=cfg.bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=cfg.bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=cfg.bias)
        self.wo = nn.Linear(cfg.heads * d, cfg.hidden, bias=cfg.bias)
        if self.rope:  # shared tables, as torchtitan's freqs_cis buffer
            inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
            angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv_freq).repeat(1, 2)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        # -1: the heads of this tensor-parallel rank (the projections' local outputs)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.rope:
            cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020; Llama) or GELU ``w2(gelu(w1 x))``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias) if cfg.activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention_norm, self.attention = _norm(cfg, cfg.hidden), Attention(cfg)
        self.ffn_norm, self.feed_forward = _norm(cfg, cfg.hidden), FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """A pre-norm decoder with torchtitan's llama3 module names, built from a TransformerConfig
    (learned positions, LayerNorm, GELU, biases and tied embeddings too)."""

    def __init__(self, cfg: TransformerConfig, checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.seq, cfg.hidden) if cfg.position == "learned" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = _norm(cfg, cfg.hidden)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers.values():
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.output(self.norm(x))


def _tensor_parallel(model: Transformer, mesh: Any, sequence_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` plan (llama3, v0.2.2); without ``sequence_parallel`` the norms are
    replicated and the embedding and row-parallel outputs all-reduced (Megatron-LM's TP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for block in model.layers.values():
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=between),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=between)}
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),))}
        parallelize_module(block, mesh, plan)


def _fully_shard(model: Transformer, mesh: Any, reshard: bool) -> None:
    """torchtitan's ``apply_fsdp``: embedding, each block, ``[norm, output]`` (not resharded after
    forward: backward needs them first), then the root; bf16 parameters, fp32 reduction. A tied
    embedding joins the ``[norm, output]`` group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    tied = model.output.weight is model.tok_embeddings.weight
    if not tied:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=reshard)
    # a tied head shares the embedding's weight: FSDP2 needs both in one group
    fully_shard([model.tok_embeddings] * tied + [model.norm, model.output], **config, reshard_after_forward=False)
    fully_shard(model, **config)


@dataclass
class FullSize:
    """One rank's peak bytes by dtlib term (:data:`TERMS`) and by tracker category, and the seconds
    taken: building, sharding and the step (``seconds``), the tracked step alone (``step_seconds``)."""
    terms: dict[str, float]
    categories: dict[str, float]
    peak: float
    seconds: float
    step_seconds: float
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"terms": self.terms, "categories": self.categories, "peak": self.peak, "seconds": self.seconds,
                "step_seconds": self.step_seconds, "world_size": self.world_size}


@contextlib.contextmanager
def _fake_world(world_size: int):
    """A fake process group of ``world_size`` ranks, this process rank 0 (removed afterwards)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("full-size rehearsal needs its own fake process group; one is already initialised")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _propagation_apart():
    """DTensor's sharding propagation in a fake mode of its own, as on a GPU. It computes output
    metadata by running the op on global-shaped fake tensors, in the active fake mode if there is
    one (``detect_fake_mode() or FakeTensorMode()``, ``_sharding_prop.py``): under ours the tracker
    would count them (for loss-parallel cross-entropy two fp32 tokens x vocabulary tensors, 7.8 GiB
    for Llama 3 at 8,192 tokens). The tracker skips ops of any other fake mode."""
    from unittest import mock

    from torch.distributed.tensor import _sharding_prop

    with mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None):
        yield


def measure(model: TransformerConfig, layout: Parallelism) -> FullSize:
    """Peak memory of rank 0 of ``layout`` (dp x tp ranks) training ``model`` one step (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    check_fullsize(model, layout)
    start = time.perf_counter()  # after the imports (seconds once per process, more than the step on 2 cores)
    world = layout.dp * layout.tp
    with _fake_world(world):
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp_shard", "tp"))
        # sharded on the meta device, outside fake mode (FSDP2 builds its dp x tp mesh from real
        # rank tables), then given fake storage: torchtitan's deferred initialisation
        with torch.device("meta"):
            net = Transformer(model, checkpoint=layout.recompute == "full")
        if layout.tp > 1:
            _tensor_parallel(net, mesh["tp"], layout.sequence_parallel)
        _fully_shard(net, mesh["dp_shard"], reshard=layout.zero == 3)
        # allow_non_fake_inputs: the meta parameters to_empty replaces
        with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
            net.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, foreach=False)
            tokens = torch.randint(0, model.vocab, (layout.micro_batch_size, model.seq))

            def train_step() -> None:
                logits = net(tokens)
                with loss_parallel() if layout.tp > 1 else contextlib.nullcontext():
                    # torchtitan's cross_entropy_loss: fp32 logits
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(0, 1))
                    del logits
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            for p in net.parameters():  # the optimizer state every step after the first holds
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad()
            tracker = FSDPMemTracker(mod=net, optm=optimizer)
            tracker.track_inputs((tokens,))
            step = time.perf_counter()
            with tracker, _propagation_apart():
                train_step()
            step = time.perf_counter() - step
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    categories = {getattr(k, "value", k): float(v) for k, v in snapshot.items() if k != "Total"}
    terms = {term: sum(categories.get(c, 0.0) for c in names) for term, names in TERMS.items()}
    return FullSize(terms=terms, categories=categories, peak=float(snapshot["Total"]),
                    seconds=time.perf_counter() - start, step_seconds=step, world_size=world)


def _sharding(layout: Parallelism) -> str:
    tp = f" x TP {layout.tp}{' + SP' if layout.sequence_parallel else ''}" if layout.tp > 1 else ""
    kept = "" if layout.zero == 3 else ", kept unsharded after forward (zero 2)"
    recompute = ", full activation checkpointing" if layout.recompute == "full" else ""
    return (f"FSDP2 {layout.dp}{kept}{tp}{recompute} as torchtitan applies it, micro-batch "
            f"{layout.micro_batch_size}")


def compare_with_dtlib(model: TransformerConfig, layout: Parallelism, measured: FullSize) -> dict[str, Any]:
    """``dtlib memory``'s terms for the same rank, layout and conventions (torchtitan's stack:
    fp32 shards of parameters and gradients, Adam's two fp32 moments; FlashAttention-style
    attention, no dropout), and the difference term by term."""
    from dtlib.analytic.memory import memory_per_gpu
    from dtlib.analytic.stacks import get_stack

    stack = get_stack("torchtitan")
    predicted = memory_per_gpu(model, layout, precision=stack.precision, stack=stack, flash_attention=True,
                               dropout=False)
    dtlib = {"parameters": predicted.parameters, "gradients": predicted.gradients,
             "optimizer": predicted.optimizer, "activations": predicted.activations,
             "temporary": predicted.temporary}
    rows = {t: {"tracker": measured.terms[t], "dtlib": dtlib[t], "difference": measured.terms[t] - dtlib[t]}
            for t in TERMS}
    total = sum(dtlib.values())
    # "columns": the sources each row carries; another (e.g. Megatron-Core's meta-device bytes per
    # rank for parameters, gradients, optimizer) is one more key per row, None where it has no number
    return {"columns": ["tracker", "dtlib"], "terms": rows, "totals": {"tracker": measured.peak, "dtlib": total},
            "relative_difference": (measured.peak - total) / total, "precision": stack.precision}


def rehearse_full_size(model: TransformerConfig, layout: Parallelism) -> dict[str, Any]:
    """:func:`measure` and :func:`compare_with_dtlib` for the plan's ``model`` and ``layout``, or
    ``{"why": ...}`` when FSDP2 + TP cannot express it (:func:`check_fullsize`)."""
    try:
        check_fullsize(model, layout)
    except ValueError as exc:
        return {"why": str(exc)}
    measured = measure(model, layout)
    return {"model": model.name, "sharding": _sharding(layout), "measured": measured.to_dict(),
            "comparison": compare_with_dtlib(model, layout, measured)}


def fullsize_lines(result: dict[str, Any]) -> list[str]:
    """The full-size section's text: per term the tracker's bytes at the peak beside dtlib's."""
    if "why" in result:
        return [f"full size (fake tensors, PyTorch's memory tracker): not measured ({result['why']})"]
    c = result["comparison"]

    def cells(row: dict[str, Any]) -> str:
        return " ".join("{:>10}".format("-" if row.get(k) is None else f"{row[k] / GiB:.2f}") for k in c["columns"])

    lines = [f"full size (fake tensors, PyTorch's memory tracker): {result['model']} under {result['sharding']}, "
             f"rank 0 of {result['measured']['world_size']}, measured in {result['measured']['seconds']:.1f} s "
             f"(the step {result['measured']['step_seconds']:.1f} s)",
             f"  {'GiB':<12} " + " ".join(f"{k:>10}" for k in c["columns"]) + f" {'difference':>10}"]
    for term, row in c["terms"].items():
        lines.append(f"  {term:<12} {cells(row)} {row['difference'] / GiB:>+10.2f}")
    t = c["totals"]
    lines.append(f"  {'total':<12} {cells(t)} {(t['tracker'] - t['dtlib']) / GiB:>+10.2f} "
                 f"({100 * c['relative_difference']:+.1f}%)")
    lines.append("  tracker: each term at the moment of the peak; dtlib: every term at its largest, summed "
                 "(docs/rehearse.md explains each difference)")
    return lines
