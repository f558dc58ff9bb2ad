"""One trainer for every layout: TinyGPT on a rank grid (DP/ZeRO/FSDP x TP/SP x PP x CP x EP).

The composition follows Megatron-LM (``pretrain_gpt.py``, ``megatron/core``) and torchtitan
(``parallelize_llama``): build the full model with one seed on every rank, then cut it -- tensor
parallelism splits layers inside the TP group, context parallelism makes attention a ring over the
CP group, expert parallelism keeps ``experts / ep`` experts per rank, pipeline parallelism keeps
this rank's stages -- and wrap what is left with the data-parallel strategy over the ``dp x cp``
ranks (Megatron's "data parallel group with context parallel": CP ranks see other tokens of the
same sequences, so their gradients are averaged like data-parallel ones).

Loss and gradients. Every rank's loss is the mean over its own tokens (the same number on every
rank), so the global mean loss is the average over the ``dp x cp`` ranks and the gradient of a
replicated parameter is the average of theirs (one all-reduce over ``dp_cp``, or ZeRO/FSDP's
reduce-scatter over it). An expert held by one EP rank already received the gradient of every
token of its EP group through the all-to-all's backward; the sum over its expert-data-parallel
replicas (``edp``) then covers all ``dp x cp`` ranks, divided by ``dp x cp`` as well.
Micro-batches divide their loss by ``num_microbatches``. The result is single-process training
on the same global batch: ``tests/test_train.py`` checks every layout against it.

Started three ways with the same :func:`train`: ``dtlib.launch(train, n, args=(config,))`` from a
notebook, ``dtlib train ...`` (which launches the ranks itself), and
``torchrun --nproc-per-node G -m dtlib train ...`` on one or several nodes (:mod:`dtlib.cli.train`
parses the flags).
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.flops import step_flops, utilization
from dtlib.analytic.hardware import get_gpu
from dtlib.analytic.layout import Parallelism, check_layout
from dtlib.corpus import VOCAB, token_batch
from dtlib.launcher import launch
from dtlib.measure import measure_cpu
from dtlib.models.gpt import Block, TinyGPT, tiny_gpt_config
from dtlib.models.moe import MoE
from dtlib.profile import phase, profile_steps, report
from dtlib.parallel import schedules
from dtlib.parallel.collectives import all_reduce_coalesced
from dtlib.parallel.context import context_parallel, shard_sequence
from dtlib.parallel.expert import expert_parallel
from dtlib.parallel.fsdp import FSDP
from dtlib.parallel.mesh import ParallelLayout, build_groups
from dtlib.parallel.pipeline import (PipelineExecutor, allreduce_embedding_grads, embedding_groups, partition,
                                     rank_chunks)
from dtlib.parallel.tensor import (allreduce_sequence_parallel_grads, check_tensor_parallel_sizes,
                                   full_state_dict, tensor_parallel, vocab_parallel_cross_entropy)
from dtlib.parallel.zero import ShardedOptimizer
from dtlib.resilience.checkpoint import (Checkpointer, CheckpointError, check_model, latest_checkpoint,
                                         read_manifest, verify_files)
from dtlib.resilience.elastic import restart_count
from dtlib.resilience.heartbeat import Heartbeat
# lesson 12: streaming data, monitoring and integrity, incremental checkpoints
from dtlib import monitor as _monitor, streaming as _streaming
from dtlib.resilience import incremental as _incremental

__all__ = ["TrainConfig", "train", "run", "check_resume", "params_sha256", "SCHEDULES", "OPTIMIZERS"]

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
    attempt under ``torchrun --max-restarts``. Fault drill: rank ``kill_rank`` (default: the
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
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_last: int = 2
    milestone_every: int = 0
    async_checkpoint: bool = False
    resume: bool = False
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
    # read: a slow-storage drill); sample_log: each rank appends the sample ids it trained on there.
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


# ---- the canonical full parameters ----------------------------------------------------------------
def params_sha256(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the parameters in a canonical order: names sorted, each tensor's values as
    float32 little-endian bytes. Two runs with the same digest hold the same weights bit for bit."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4").tobytes())
    return h.hexdigest()


def _in_stage(name: str, stage: nn.Module) -> bool:
    """Whether the TinyGPT parameter ``name`` belongs to a pipeline stage (GPTStage)."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) in stage.block_ids
    if name.split(".")[0] in ("wte", "wpe", "emb_norm"):
        return stage.first
    return stage.last


# ---- the run --------------------------------------------------------------------------------------
class _Run:
    """One rank's model, optimizer and step, built from a :class:`TrainConfig`."""

    def __init__(self, rank: int, config: TrainConfig, groups: dict[str, list[list[int]]] | None = None):
        self.config, self.rank = config, rank
        c = config
        self.layout = c.layout()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.groups = build_groups(self.layout, override=groups) if self.distributed else None
        self.coords = self.layout.coordinates(rank)
        self.replicas = c.dp * c.cp  # ranks whose gradients are averaged
        torch.manual_seed(c.seed)
        model = TinyGPT(c.model_config(), checkpoint=c.recompute, moe_capacity_factor=c.capacity_factor)
        self.names = sorted(n for n, _ in model.named_parameters())
        self.model = model
        if c.tp > 1:
            # FSDP runs the forward on views of its gathered buffers, never on the parameters, so
            # hooks on the parameters (the default "backward" sum of SP gradients) would not fire:
            # with FSDP the norms' gradients are summed over tp after its reduce-scatter instead
            tensor_parallel(model, self.group("tp"), c.sequence_parallel,
                            sequence_parallel_grads="manual" if c.zero == 3 else "backward")
        if c.cp > 1:
            context_parallel(model, self.group("cp"))
        if c.ep > 1:
            expert_parallel(model, self.group("ep"))
        self.experts = {id(p) for m in model.modules() if isinstance(m, MoE) and c.ep > 1
                        for p in m.experts.parameters()}
        self.moe = [m for m in model.modules() if isinstance(m, MoE)]
        self.executor = self.embedding_group = None
        # FSDP last, over dp x cp, on what TP and PP left (torchtitan's parallelize_llama: TP, then
        # fully_shard on the TP-local slabs; with a pipeline, one FSDP per stage this rank runs)
        self.fsdps: list[FSDP] = []
        if c.pp > 1:
            stages = partition(model, c.pp, c.virtual_stages)
            self.chunks = rank_chunks(stages, self.coords["pp"], c.pp)
            if c.zero == 3:
                self.fsdps = [FSDP(chunk, unit_types=(Block,), process_group=self.group("dp_cp"))
                              for chunk in self.chunks]
            actions = schedules.schedule(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)
            self.executor = PipelineExecutor(self.fsdps or self.chunks, actions, self.coords["pp"], self.loss,
                                             pp_ranks=self.groups.ranks["pp"])
            self.params = self.executor.parameters()
            self.embedding_group = self._embedding_group() if c.tied_embeddings else None
        elif c.zero == 3:
            self.fsdps = [FSDP(model, unit_types=(Block,), process_group=self.group("dp_cp"))]
            self.params = list(self.fsdps[0].parameters())
        else:
            self.params = list(model.parameters())
        if c.zero in (1, 2):
            self.optimizer = ShardedOptimizer(self.params, OPTIMIZERS[c.optimizer], stage=c.zero,
                                              process_group=self.group("dp_cp"), lr=c.lr)
        else:
            self.optimizer = OPTIMIZERS[c.optimizer](self.params, lr=c.lr)
        self.step_count = 0
        last = self.layout.world_size - 1  # the fault drills' default rank
        self.kill_rank = last if c.kill_rank is None else c.kill_rank
        self.hang_rank = last if c.hang_rank is None else c.hang_rank
        self.beat: Any = lambda step, where: None  # a Heartbeat's beat when train() starts one
        # lesson 12: streaming shards (dtlib.streaming), and a hook between gradient sync and update
        self.stream = (_streaming.ShardedTokens(c.data, c.seed, c.data_workers, c.prefetch, c.data_delay)
                       if c.data else None)
        self.sample_ids: list[int] = []
        self.on_gradients: Any = lambda run: None

    def _embedding_group(self) -> Any:
        """This rank's embedding group (first and last stage of its pipeline; None elsewhere).
        Every rank creates every group, in the same order (``dist.new_group`` is collective)."""
        mine = None
        for members in embedding_groups(self.layout.groups["pp"]):
            group = dist.new_group(members)
            if self.rank in members:
                mine = group
        return mine

    def group(self, kind: str) -> Any:
        return self.groups[kind] if self.groups is not None else None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens (+ the MoE load-balancing loss)."""
        if self.config.tp > 1:
            loss = vocab_parallel_cross_entropy(logits, targets, self.group("tp"))
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if self.moe and self.config.aux_loss_coef:
            loss = loss + self.config.aux_loss_coef * sum(m.aux_loss for m in self.moe)
        return loss

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of step ``step``'s global batch: its data-parallel slice of the
        sequences, and its context-parallel shard of their tokens."""
        c = self.config
        if self.stream is not None:  # lesson 12: this replica's slice of the shards' global order
            inputs, targets, self.sample_ids = self.stream.batch(c.global_batch, self.coords["dp"], c.dp)
        else:
            inputs, targets = token_batch(step, c.global_batch, c.seq, c.seed)
            per_replica = c.micro_batch_size * c.num_microbatches
            rows = slice(self.coords["dp"] * per_replica, (self.coords["dp"] + 1) * per_replica)
            inputs, targets = inputs[rows], targets[rows]
        if c.cp > 1:
            inputs, targets = (shard_sequence(t, self.coords["cp"], c.cp) for t in (inputs, targets))
        return inputs, targets

    def step(self) -> float:
        """One optimizer step; returns the global mean loss (the same on every rank)."""
        c = self.config
        self.beat(self.step_count, "data")
        if c.hang_step == self.step_count and self.rank == self.hang_rank and restart_count() == 0:
            print(f"fault drill: rank {self.rank} hangs in the data phase of step {self.step_count}",
                  file=sys.stderr, flush=True)
            while True:  # a stuck data loader: no collective, no progress
                time.sleep(0.01)
        with phase("data"):
            inputs, targets = self.batch(self.step_count)
        self.beat(self.step_count, "forward-backward")
        if self.executor is not None:
            with phase("backward"):  # a pipeline schedule interleaves forwards and backwards
                log = self.executor.step(inputs, targets)
            local = log.loss if log.loss is not None else 0.0
        else:
            local = 0.0
            forward = self.fsdps[0] if self.fsdps else self.model
            for x, y in zip(inputs.tensor_split(c.num_microbatches), targets.tensor_split(c.num_microbatches)):
                with phase("forward"):
                    loss = self.loss(forward(x), y) / c.num_microbatches
                with phase("backward"):
                    loss.backward()
                local += loss.item()
        self.beat(self.step_count, "gradient sync")
        with phase("comm"):
            self.synchronise_gradients()
        self.on_gradients(self)  # lesson 12: dtlib.monitor's gradient norm
        self.beat(self.step_count, "optimizer")
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return self.global_loss(local)

    def synchronise_gradients(self) -> None:
        c = self.config
        if c.zero == 3:  # averaged over dp x cp by FSDP's reduce-scatter at the end of backward
            for fsdp in self.fsdps:
                fsdp.finish_gradient_synchronization()
            if c.sequence_parallel:
                # "manual" mode (see __init__): the sum over tp commutes with FSDP's average over
                # dp x cp (every TP rank shards a replicated norm alike), so it applies to the rows
                allreduce_sequence_parallel_grads(self.model)
            return
        if c.zero == 2:  # reduce-scattered during backward; the step finishes it
            return
        if self.embedding_group is not None:
            allreduce_embedding_grads(self.model, self.embedding_group)
        for p in self.params:  # an expert no token chose: a zero gradient on every layout
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _average([p for p in self.params if id(p) not in self.experts], self.group("dp_cp"), self.replicas)
        _average([p for p in self.params if id(p) in self.experts], self.group("edp"), self.replicas)

    # ---- checkpoints (dtlib.resilience.checkpoint) ------------------------------------------
    def _checkpointed(self) -> tuple[nn.Module, Any]:
        """What this rank saves: the (wrapped) model, and with a pipeline only its stages' names.
        A tied embedding is in the state dict twice (``wte.weight``, ``lm_head.weight``): the
        first stage saves and loads the one, the last stage its copy as the other."""
        if self.config.pp == 1:
            return (self.fsdps[0] if self.fsdps else self.model), None
        # a stage's FSDP leaves the model's own parameters sharded, which the checkpoint sees
        return self.model, lambda name: any(_in_stage(name, s) for s in self.chunks)

    def save(self, checkpointer: Checkpointer) -> None:
        """Checkpoint after ``step_count`` steps (a collective): sharded as this layout holds the
        state; the data position is the next global batch (batches are a function of the step)."""
        c = self.config
        model, owned = self._checkpointed()
        extra = {"global_batch": c.global_batch, "seq": c.seq, "seed": c.seed,
                 "num_microbatches": c.num_microbatches}
        if self.stream is not None:  # lesson 12: the streaming position, global so any world resumes it
            extra["data_state"] = self.stream.state_dict()
        checkpointer.save(self.step_count, model, self.optimizer, data_position=self.step_count,
                          layout=self._saved_layout(), extra=extra, owned=owned)

    def _saved_layout(self) -> dict[str, Any]:
        """The layout a checkpoint records (and a resume compares with)."""
        c = self.config
        return {**asdict(self.layout), "zero": c.zero, "sequence_parallel": c.sequence_parallel,
                "world_size": self.layout.world_size}

    def resume(self, checkpointer: Checkpointer) -> str:
        """Load the newest checkpoint, whatever layout wrote it; returns the line to log."""
        c = self.config
        model, owned = self._checkpointed()
        info = checkpointer.load(model, self.optimizer, owned=owned)
        if info is None:
            return f"no checkpoint in {checkpointer.directory} yet: starting at step 0"
        if info["data_position"] > c.steps:
            raise ValueError(f"the checkpoint {info['path']} is at step {info['data_position']}, past "
                             f"--steps {c.steps}: ask for more steps")
        self.step_count = info["data_position"]
        if self.stream is not None:  # lesson 12: samples consumed, whatever world size saved them
            self.stream.load_state_dict(info["extra"].get("data_state", {**self.stream.state_dict(),
                                                                         "consumed": self.step_count * c.global_batch}))
        line = f"resumed at step {self.step_count} from {info['path']}"
        saved, mine = info["layout"], self._saved_layout()
        if saved != mine:
            line += f" (resharded from {_layout_text(saved)} to {_layout_text(mine)})"
        extra = info["extra"]
        changed = [f"{k} {extra[k]} -> {getattr(c, k)}" for k in ("global_batch", "seq", "seed")
                   if getattr(c, k) != extra[k]]
        if changed:
            line += f"; changed since: {', '.join(changed)} (the data differs from the saved run's)"
        elif extra["num_microbatches"] != c.num_microbatches:
            line += (f"; num_microbatches {extra['num_microbatches']} -> {c.num_microbatches} keeps the "
                     f"global batch of {c.global_batch}")
        return line

    def global_loss(self, local: float) -> float:
        """The mean loss over all ranks' tokens: the last pipeline stage's losses (one TP rank
        each) averaged over the dp x cp replicas."""
        if not self.distributed:
            return local
        last = self.coords["pp"] == self.config.pp - 1 and self.coords["tp"] == 0
        t = torch.tensor([local / self.replicas if last else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """The full parameters with TinyGPT's names, on rank 0 (None elsewhere); a collective."""
        c = self.config
        if self.fsdps:
            full = self._fsdp_full_parameters()
            if c.tp > 1:
                full = full_state_dict(self.model, self.group("tp"), values=full)
        elif c.tp > 1:
            full = full_state_dict(self.model, self.group("tp"))
        else:
            full = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        full = {n: t for n, t in full.items() if n in self.names}
        if c.pp > 1:
            full = {n: t for n, t in full.items() if any(_in_stage(n, s) for s in self.chunks)}
        if not self.distributed:
            return full
        first_replica = self.coords["dp"] == 0 and self.coords["cp"] == 0
        mine = {n: t for n, t in full.items() if self.coords["tp"] == 0
                and (first_replica if ".experts." not in n or c.ep == 1 else self.coords["edp"] == 0)}
        gathered: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None
        merged = {n: t for part in gathered for n, t in part.items()}
        missing = set(self.names) - set(merged)
        if missing:
            raise RuntimeError(f"parameters gathered from no rank: {sorted(missing)[:5]}")
        return merged

    def _fsdp_full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters the FSDP wrappers hold, unsharded over dp x cp (still TP-local), with
        TinyGPT's names (a pipeline stage names its blocks from 0; the parameters are the same)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        full = {}
        for fsdp in self.fsdps:
            gathered = fsdp.gather_full_params()
            for name, p in fsdp.module.named_parameters():
                full[names[id(p)]] = gathered[name]
        return full


def _layout_text(layout: dict[str, Any]) -> str:
    """``dp2 x tp2 x pp2, zero1`` for a saved layout (sizes of 1 left out)."""
    sizes = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) > 1] or ["1 process"]
    text = " x ".join(sizes)
    if layout.get("zero"):
        text += f", zero{layout['zero']}"
    return text + (", sp" if layout.get("sequence_parallel") else "")


def _average(params: list[torch.Tensor], group: Any, divisor: int) -> None:
    """Sum ``params``' gradients over ``group`` (one flat all-reduce) and divide by ``divisor``."""
    grads = [p.grad for p in params]
    if group is None:  # a group of one rank: nothing to sum (an expert's only replica)
        for g in grads:
            g.div_(divisor)
        return
    all_reduce_coalesced(grads, group, divisor)


def train(rank: int, world_size: int, config: TrainConfig, keep_params: bool = False,
          progress: bool = False, groups: dict[str, list[list[int]]] | None = None) -> dict[str, Any]:
    """Train ``config`` on this rank (inside ``dtlib.launch`` or torchrun; with one rank and no
    process group it also runs in the calling process). Rank 0 returns the run's summary:
    ``steps``, ``first_step`` (after ``resume``), ``losses`` (global mean per step run), ``tokens_per_s``, ``mfu``, ``layout``,
    ``peak_memory_bytes`` (per rank, where measurable) and ``params_sha256``; with checkpoints
    ``resumed`` (what ``resume`` found) and ``checkpoint_blocking_s`` (per save); ``params`` too with
    ``keep_params``. Other ranks return ``{"rank": rank}``. ``groups`` replaces some of the
    layout's process groups (lists of ranks per kind, see :func:`~dtlib.parallel.mesh.build_groups`)."""
    config.check(world_size)
    run = _Run(rank, config, groups)
    losses, seconds = [], []
    bar = None
    peak = _peak_flops(world_size) if rank == 0 else None  # measured before the ranks get busy
    if progress and rank == 0:
        bar = tqdm(total=config.steps, desc="dtlib train", file=sys.stderr)
    tokens = config.global_batch * config.seq
    checkpointer = None
    if config.checkpoint_dir and config.incremental:  # lesson 12: deltas against a full checkpoint
        checkpointer = _incremental.TrainerCheckpointer(config.checkpoint_dir, config.full_every)
    elif config.checkpoint_dir:
        checkpointer = Checkpointer(config.checkpoint_dir, keep_last=config.keep_last,
                                    milestone_every=config.milestone_every, async_save=config.async_checkpoint)
    resumed = None
    if config.resume:
        resumed = run.resume(checkpointer)
        if rank == 0:
            print(resumed, file=sys.stderr, flush=True)
    first = run.step_count
    monitor = None
    if config.heartbeat and run.distributed:
        monitor = Heartbeat(timeout=config.heartbeat, interval=min(1.0, config.heartbeat / 4)).start()
        run.beat = monitor.beat
    watch = _monitor.Monitor.for_run(run, rank, tokens)  # lesson 12: metrics, alerts, checksums (or None)

    def one_step() -> None:
        if config.kill_step == run.step_count and rank == run.kill_rank and restart_count() == 0:
            what = "its torchrun agent and itself" if config.kill_agent else "itself"
            print(f"fault drill: rank {rank} SIGKILLs {what} at step {run.step_count}", file=sys.stderr, flush=True)
            if config.kill_agent:  # the whole node is lost: torchrun --nnodes=MIN:MAX goes on without it
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.perf_counter()
        losses.append(run.step())
        seconds.append(time.perf_counter() - start)
        if watch is not None:  # lesson 12
            watch.after_step(run.step_count - 1, losses[-1], seconds[-1], run.params)
        if config.sample_log and run.stream is not None:
            _streaming.log_samples(config.sample_log, rank, run.step_count - 1, run.sample_ids)
        if config.checkpoint_every and run.step_count % config.checkpoint_every == 0:
            run.beat(run.step_count, "checkpoint")
            run.save(checkpointer)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tokens_per_s=f"{tokens / seconds[-1]:,.0f}",
                            mfu=f"{100 * _mfu(config, seconds[-1], peak):.2f}%")
            bar.update()

    # --profile: the last steps run under dtlib.profile (one warm-up that counts FLOPs, then up to 3)
    profiled = min(3, config.steps - first - 1) if config.profile else 0
    if config.profile and profiled < 1:
        raise ValueError(f"--profile needs 2 steps left to run, {config.steps - first} are")
    for _ in range(first, config.steps - profiled - (1 if profiled else 0)):
        one_step()
    profile = None
    if profiled:
        gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        flops = step_flops(tokens, **config.model_config().numbers())["model"]
        mine = profile_steps(one_step, steps=profiled, warmup=1, trace_dir=config.profile, rank=rank,
                             peak=get_gpu("h100-sxm") if gpu else None, dtype="bf16" if gpu else "fp32",
                             model_flops=flops / world_size, tokens=tokens // world_size)
        ranks = [mine]
        if run.distributed:
            ranks = [None] * world_size
            dist.all_gather_object(ranks, mine)
        profile = report(ranks)
    if bar is not None:
        bar.close()
    if checkpointer is not None:
        checkpointer.close()  # the last asynchronous save is complete before the run reports
    full = run.full_parameters()
    memory = [_peak_memory()]
    if run.distributed:
        memory = [None] * world_size
        dist.all_gather_object(memory, _peak_memory())
    if monitor is not None:
        monitor.stop()
    if watch is not None:
        watch.close()
    if run.stream is not None:
        run.stream.close()
    if rank != 0:
        return {"rank": rank}
    timed = seconds[1:] or seconds
    steady = sorted(timed)[len(timed) // 2] if timed else None  # median, first step aside
    out = {"steps": config.steps, "first_step": first, "losses": losses, "tokens_per_s": tokens / steady if steady else None,
           "mfu": _mfu(config, steady, peak) if steady else None, "layout": asdict(config.layout()),
           "world_size": world_size, "global_batch": config.global_batch,
           "peak_memory_bytes": memory, "params_sha256": params_sha256(full)}
    if resumed is not None:
        out["resumed"] = resumed
    if checkpointer is not None and checkpointer.blocking_seconds:
        out["checkpoint_blocking_s"] = checkpointer.blocking_seconds
    if profile is not None:
        out["profile"] = {k: profile[k] for k in ("breakdown", "mfu", "hfu", "findings", "step_time",
                                                  "achieved_flops_per_rank", "tokens_per_second")}
    if watch is not None:  # lesson 12
        out.update(watch.summary())
    if run.stream is not None:
        out["samples_consumed"] = run.stream.consumed
    if isinstance(checkpointer, _incremental.TrainerCheckpointer):
        out["checkpoint_bytes"] = [{"step": s, "kind": k, "bytes": b} for s, k, b in checkpointer.written]
        out["full_state_bytes"] = checkpointer.full_bytes
    if keep_params:
        out["params"] = full
    return out


def _peak_memory() -> int | None:
    """Peak allocated device memory of this rank (CUDA only; CPU ranks share one heap)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def _peak_flops(world_size: int) -> tuple[Any, int, str]:
    """(accelerator, how many of it, dtype) the MFU divides by: on CUDA the catalogue's H100, one
    per rank, bf16; on CPU the ranks share one machine, whose fp32 matmul peak is measured here
    (:func:`dtlib.measure.measure_cpu`), counted once."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "h100-sxm", world_size, "bf16"
    return measure_cpu(n=256, repeats=3, copy_bytes=2 ** 20), 1, "fp32"


def _mfu(config: TrainConfig, step_seconds: float, peak: tuple[Any, int, str]) -> float:
    """Model FLOPs utilisation (Chowdhery et al. 2022, App. B): the model FLOPs of a step
    (:func:`dtlib.analytic.flops.step_flops`) over ``step_seconds`` x the peak."""
    flops = step_flops(config.global_batch * config.seq, **config.model_config().numbers())["model"]
    accelerator, count, dtype = peak
    return float(utilization(flops, step_seconds, count, accelerator, dtype))


def check_resume(config: TrainConfig) -> None:
    """Before any process starts: the newest checkpoint ``resume`` would load is complete (every
    file there with its size and sha256) and holds this model (every tensor's full shape); a
    ValueError naming the file otherwise. Nothing to resume is fine (the run starts at step 0)."""
    if not (config.resume and config.checkpoint_dir):
        return
    path = latest_checkpoint(config.checkpoint_dir)
    if path is None:
        return
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = TinyGPT(config.model_config())
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    try:
        manifest = read_manifest(path)
        verify_files(path, manifest)
        check_model(path, manifest, shapes, shapes)
    except CheckpointError as e:  # names the file: a one-line error before any rank starts
        raise ValueError(str(e)) from None


def run(config: TrainConfig, backend: str = "auto", timeout: float = 600.0, progress: bool = False,
        keep_params: bool = False, output: str = "rank0") -> dict[str, Any]:
    """Check ``config`` (and the checkpoint it resumes from), start its ``world_size`` ranks with
    :func:`dtlib.launch` and return rank 0's summary (see :func:`train`). ``output`` as
    :func:`dtlib.launch`'s: ``"none"`` keeps the ranks' log lines (alerts, drills, the profiler's
    own messages) out of a notebook that prints what it needs from the summary."""
    config.check()
    check_resume(config)
    if config.kill_agent:  # the parent of a dtlib.launch rank is this process, not an agent
        raise ValueError("--kill-agent kills a torchrun agent: start the run with torchrun")
    return launch(train, config.world_size, args=(config, keep_params, progress), backend=backend,
                  timeout=timeout, output=output)[0]
