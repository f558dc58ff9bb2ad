"""One rank of a run: the parallel model cut from TinyGPT, its optimizer and its step.

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
"""
from __future__ import annotations

import hashlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.corpus import token_batch
from dtlib.launcher import get_device
from dtlib.models.gpt import Block, TinyGPT
from dtlib.models.moe import MoE
from dtlib.profile import phase
from dtlib.parallel import schedules
from dtlib.parallel.clip import clip_grad_norm_, grad_norm
from dtlib.parallel.collectives import all_reduce_coalesced
from dtlib.parallel.context import context_parallel, shard_sequence
from dtlib.parallel.expert import expert_parallel
from dtlib.parallel.fsdp import FSDP
from dtlib.parallel.mesh import build_groups
from dtlib.parallel.pipeline import (PipelineExecutor, allreduce_embedding_grads, embedding_groups, partition,
                                     rank_chunks)
from dtlib.parallel.tensor import (allreduce_sequence_parallel_grads, full_state_dict, tensor_parallel,
                                   vocab_parallel_cross_entropy)
from dtlib.parallel.zero import ShardedOptimizer
from dtlib.resilience.elastic import restart_count
from dtlib.trainer.config import OPTIMIZERS, TrainConfig
from dtlib import streaming as _streaming  # lesson 12

__all__ = ["params_sha256", "in_stage"]


# ---- the canonical full parameters ----------------------------------------------------------------
def params_sha256(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the parameters in a canonical order: names sorted, each tensor's values as
    float32 little-endian bytes. Two runs with the same digest hold the same weights bit for bit."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4").tobytes())
    return h.hexdigest()


def in_stage(name: str, stage: nn.Module) -> bool:
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
        # cuda:LOCAL_RANK under NCCL, else the CPU: initialised on the CPU (the same numbers on
        # every machine), then moved, so a GPU run starts from the CPU run's weights
        self.device = get_device()
        model = TinyGPT(c.model_config(), checkpoint=c.recompute, moe_capacity_factor=c.capacity_factor)
        model.to(self.device)
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
        self.measure_grad_norm = False  # dtlib.monitor asks for the norm of every step
        self.grad_norm: float | None = None  # the last step's, before clipping

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
        return inputs.to(self.device), targets.to(self.device)

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
        self.on_gradients(self)  # lesson 12: dtlib.monitor's gradient-explosion drill
        if c.clip_grad:  # the norm before clipping, as Megatron logs it
            self.grad_norm = clip_grad_norm_(self.gradient_holders(), c.clip_grad, **self.gradient_groups())
        elif self.measure_grad_norm:
            self.grad_norm = grad_norm(self.gradient_holders(), **self.gradient_groups())
        self.beat(self.step_count, "optimizer")
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return self.global_loss(local)

    def gradient_holders(self) -> list[Any]:
        """Where this rank's synchronised gradients are, for :mod:`dtlib.parallel.clip`: ZeRO's
        optimizer (stage 2: its gradient shards), and the pipeline executor (its stages: the last
        stage's copy of a tied embedding counts on the first), the FSDP wrappers or the model."""
        holders: list[Any] = [self.optimizer] if self.config.zero in (1, 2) else []
        return holders + ([self.executor] if self.executor is not None else self.fsdps or [self.model])

    def gradient_groups(self) -> dict[str, Any]:
        """The groups over which gradients are replicated or split (None: one rank)."""
        return {"dp_group": self.group("dp_cp"), "tp_group": self.group("tp"),
                "expert_dp_group": self.group("edp")}

    def synchronise_gradients(self) -> None:
        c = self.config
        if c.zero == 3:  # averaged over dp x cp by FSDP's reduce-scatter at the end of backward
            for fsdp in self.fsdps:
                fsdp.finish_gradient_synchronization()
            for p in self.params:  # an expert no token chose: a zero gradient on every layout (below)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
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


    def global_loss(self, local: float) -> float:
        """The mean loss over all ranks' tokens: the last pipeline stage's losses (one TP rank
        each) averaged over the dp x cp replicas."""
        if not self.distributed:
            return local
        last = self.coords["pp"] == self.config.pp - 1 and self.coords["tp"] == 0
        t = torch.tensor([local / self.replicas if last else 0.0], dtype=torch.float64, device=self.device)
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
            full = {n: t for n, t in full.items() if any(in_stage(n, s) for s in self.chunks)}
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



def _average(params: list[torch.Tensor], group: Any, divisor: int) -> None:
    """Sum ``params``' gradients over ``group`` (one flat all-reduce) and divide by ``divisor``."""
    grads = [p.grad for p in params]
    if group is None:  # a group of one rank: nothing to sum (an expert's only replica)
        for g in grads:
            g.div_(divisor)
        return
    all_reduce_coalesced(grads, group, divisor)

