"""What a run is: :class:`TrainConfig` (every option of ``dtlib train``) and its refusals.

:meth:`TrainConfig.check` is pure, so ``dtlib train`` calls it before any process starts; a bad
option or a combination the trainer does not compose (``_UNSUPPORTED``) is a one-line ValueError
naming the option and the valid values.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism, check_layout
from dtlib.corpus import VOCAB
from dtlib.models.gpt import tiny_gpt_config
from dtlib.parallel import schedules
from dtlib.parallel.mesh import ParallelLayout
from dtlib.parallel.tensor import check_tensor_parallel_sizes
from dtlib.resilience.elastic import restart_count
# lesson 12: streaming data, monitoring and integrity, incremental checkpoints
from dtlib import monitor as _monitor, streaming as _streaming
from dtlib.outputs import check_output_dir, check_output_file
from dtlib.resilience import incremental as _incremental

__all__ = ["TrainConfig", "SCHEDULES", "OPTIMIZERS"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; every field has a default (a 2-layer TinyGPT on one rank).

    ``micro_batch_size`` sequences per micro-batch per data-parallel replica, ``num_microbatches``
    per step (pipeline micro-batches, or gradient accumulation without a pipeline): the global
    batch is ``dp x micro_batch_size x num_microbatches`` sequences of ``seq`` byte tokens.
    ``zero``: 0 (all-reduce), 1-2 (:class:`~dtlib.parallel.ShardedOptimizer`), 3
    (:class:`~dtlib.parallel.FSDP`). ``optimizer``: ``"adamw"`` or ``"sgd"`` (plain SGD, whose
    update is proportional to the gradient: the tests use it because Adam's normalised update hides
    a gradient off by a constant factor). ``capacity_factor`` and ``aux_loss_coef`` configure MoE
    routing (Switch Transformer's capacity and load-balancing loss, 1e-2 in the paper).

    Checkpoints (:class:`~dtlib.resilience.checkpoint.Checkpointer`): every ``checkpoint_every``
    steps into ``checkpoint_dir``, keeping the last ``keep_last`` and every ``milestone_every``-th
    step (``async_checkpoint``: written
    in the background). ``resume`` loads the newest one if there is one -- on any layout of the
    same model (resharding) -- and starts from scratch otherwise, so the same command serves every
    attempt under ``torchrun --max-restarts``. A checkpoint records the model's shape, the
    optimizer and its hyper-parameters (``lr``); a resume refuses another model or optimizer, and
    another ``lr`` unless ``override_optimizer_params`` (then the new one takes effect; see
    :mod:`dtlib.trainer.checkpoints`). Fault drill: rank ``kill_rank`` (default: the
    last) SIGKILLs itself (and its torchrun agent with ``kill_agent``: a lost node) at the start of
    step ``kill_step`` on torchrun's first attempt only; rank ``hang_rank`` (default: the last) hangs
    in the data phase of step ``hang_step`` (a stuck data loader), also on the first attempt only.
    ``heartbeat`` > 0: a :class:`~dtlib.resilience.heartbeat.Heartbeat` with that timeout in seconds
    names a rank that stops making progress and ends the job (exit 75) so torchrun restarts it."""
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int = VOCAB
    seq: int = 32
    moe_experts: int = 0
    moe_top_k: int = 0
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch_size: int = 2
    num_microbatches: int = 1
    recompute: bool = False
    steps: int = 5
    optimizer: str = "adamw"
    lr: float = 3e-3
    # clip the global gradient norm to this before each update (dtlib.parallel.clip, right on every
    # layout); 0: off, this trainer's default (unchanged results). Megatron-LM (--clip-grad) and
    # nanoGPT (grad_clip) clip at 1.0 by default.
    clip_grad: float = 0.0
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_last: int = 2
    milestone_every: int = 0
    async_checkpoint: bool = False
    resume: bool = False
    override_optimizer_params: bool = False
    kill_step: int | None = None
    kill_rank: int | None = None
    kill_agent: bool = False
    heartbeat: float = 0.0
    hang_step: int | None = None
    hang_rank: int | None = None
    profile: str | None = None
    tied_embeddings: bool = False
    # ---- data, monitoring, integrity, incremental checkpoints (lesson 12) ----------------------------
    # data: a dtlib.streaming shard directory instead of the built-in corpus (its global order,
    # resumable position, data_workers reader threads, prefetch steps read ahead, data_delay s per
    # read: a slow-storage drill); sample_log: each replica's first rank appends its sample ids there.
    # metrics (JSON lines) / tensorboard (a SummaryWriter directory), loss-spike and grad-norm alerts
    # (factor x the recent median); checksum_every: cross-replica parameter checksums
    # (dtlib.resilience.integrity), flip_bit_step/rank: the silent-corruption drill; incremental:
    # checkpoints as deltas against a full one every full_every saves (dtlib.resilience.incremental).
    data: str | None = None
    data_workers: int = 0
    prefetch: int = 1
    data_delay: float = 0.0
    sample_log: str | None = None
    metrics: str | None = None
    tensorboard: str | None = None
    checksum_every: int = 0
    flip_bit_step: int | None = None
    flip_bit_rank: int | None = None
    loss_spike_factor: float = 2.0
    grad_norm_factor: float = 5.0
    incremental: bool = False
    full_every: int = 4
    spike_step: int | None = None  # drill: gradients x 1000 at this step (a gradient explosion)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch_size * self.num_microbatches

    def model_config(self) -> TransformerConfig:
        return tiny_gpt_config(layers=self.layers, hidden=self.hidden, heads=self.heads,
                               kv_heads=self.kv_heads, ffn=self.ffn, vocab=self.vocab, seq=self.seq,
                               moe_experts=self.moe_experts, moe_top_k=self.moe_top_k,
                               tied_embeddings=self.tied_embeddings, name="dtlib-train")

    def layout(self) -> ParallelLayout:
        return ParallelLayout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    def with_(self, **changes: Any) -> "TrainConfig":
        return TrainConfig(**{**asdict(self), **changes})

    def check(self, world_size: int | None = None) -> "TrainConfig":
        """Raise a one-line ValueError naming the first invalid option (and the valid ones);
        pure, so ``dtlib train`` calls it before any process starts."""
        for name in ("steps", "micro_batch_size", "num_microbatches"):
            validate.integer(name, getattr(self, name))
        for name in ("seed", "checkpoint_every", "milestone_every"):
            validate.integer(name, getattr(self, name), minimum=0)
        validate.integer("keep_last", self.keep_last, minimum=1)
        validate.number("lr", self.lr)
        validate.number("clip_grad", self.clip_grad, exclusive=False)
        validate.number("aux_loss_coef", self.aux_loss_coef, exclusive=False)
        if self.capacity_factor is not None:
            validate.number("capacity_factor", self.capacity_factor)
        if self.vocab < VOCAB:
            raise ValueError(f"vocab must be >= {VOCAB}: the corpus is byte-level tokens, got {self.vocab}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.profile is not None and self.steps < 2:
            raise ValueError(f"--profile needs --steps >= 2 (one warm-up step counts the FLOPs, "
                             f"then at least one is profiled), got steps={self.steps}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir to save into")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir to resume from")
        for flag, directory in (("--checkpoint-dir", self.checkpoint_dir), ("--profile", self.profile),
                                ("--tensorboard", self.tensorboard), ("--sample-log", self.sample_log)):
            if directory:
                check_output_dir(flag, directory)
        if self.metrics:
            check_output_file("--metrics", self.metrics)
        if self.override_optimizer_params and not self.resume:
            raise ValueError("--override-optimizer-params replaces what a resume loads: it needs --resume")
        validate.number("heartbeat", self.heartbeat, exclusive=False)
        if self.kill_agent and self.kill_step is None:
            raise ValueError("--kill-agent needs --kill-step (the step at which the node is lost)")
        # fault drills act on torchrun's first attempt only; a restarted group may be smaller
        world = world_size or self.world_size
        last_rank = world - 1 if restart_count() == 0 else None
        for drill in ("kill", "hang"):
            if getattr(self, f"{drill}_step") is not None:
                validate.integer(f"{drill}_step", getattr(self, f"{drill}_step"), minimum=0, maximum=self.steps - 1)
            if getattr(self, f"{drill}_rank") is not None:
                validate.integer(f"{drill}_rank", getattr(self, f"{drill}_rank"), minimum=0, maximum=last_rank)
        cfg = self.model_config()
        layout = Parallelism(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero=self.zero,
                             sequence_parallel=self.sequence_parallel,
                             schedule="1f1b" if self.schedule == "zb-h1" else self.schedule,
                             virtual_stages=self.virtual_stages, micro_batch_size=self.micro_batch_size,
                             num_microbatches=self.num_microbatches)
        check_layout(layout.numbers(**cfg.numbers(), gpus=world_size or self.world_size),
                     layout.schedule, layout.offload)
        for broken, message in _UNSUPPORTED:
            if broken(self):
                raise ValueError(message)
        if self.cp > 1 and self.seq % (2 * self.cp):
            raise ValueError(f"context parallelism cuts the sequence into 2 x cp = {2 * self.cp} chunks "
                             f"(zig-zag); seq={self.seq} must be a multiple of {2 * self.cp}")
        if self.tp > 1:
            check_tensor_parallel_sizes(cfg, self.tp, self.sequence_parallel)
        if self.pp > 1:
            schedules.validate(schedules.schedule(self.schedule, self.pp, self.num_microbatches,
                                                  self.virtual_stages))
        _streaming.check_options(self)  # lesson 12's options
        _monitor.check_options(self, world)
        _incremental.check_options(self)
        return self


# (predicate -> True when the combination is not supported, message): combinations this trainer
# does not compose, refused before anything starts
_UNSUPPORTED = [
    (lambda c: c.zero in (1, 2, 3) and c.dp * c.cp < 2,
     "ZeRO/FSDP shard over the dp x cp ranks: --zero 1-3 needs dp x cp >= 2"),
    (lambda c: c.ep > 1 and c.zero > 0,
     "expert parallelism averages expert gradients over their own (edp) group: use --zero 0 with --ep > 1"),
    (lambda c: c.tied_embeddings and c.pp > 1 and c.zero >= 2,
     "--tied-embeddings across pipeline stages sums the two copies' gradients after backward, after "
     "ZeRO-2/FSDP have reduce-scattered them: use --zero 0 or 1 with --tied-embeddings and --pp"),
    (lambda c: c.moe_experts and (c.tp > 1 or c.pp > 1 or c.cp > 1),
     "a mixture-of-experts model composes with dp and ep here; use tp = pp = cp = 1 with --moe-experts"),
    (lambda c: c.schedule == "zb-h1" and c.pp > 1 and c.zero >= 2,
     "--schedule zb-h1 writes weight gradients in its W pass, after the backward that ZeRO-2 and "
     "FSDP hook to reduce-scatter them: use --zero 0 or 1 with zb-h1"),
    (lambda c: c.schedule == "zb-h1" and c.pp > 1 and c.tp > 1,
     "--schedule zb-h1 computes weight gradients per nn.Linear in its W pass, which the "
     "tensor-parallel layers do not split: use gpipe, 1f1b or interleaved with --tp"),
    (lambda c: c.sequence_parallel and (c.tp < 2 or c.cp > 1),
     "--sequence-parallel needs --tp >= 2 and does not compose with cp here (both cut the sequence)"),
]

