"""Pipeline parallelism on real ranks: TinyGPT cut into stages, and one executor for any schedule.

* :func:`partition` cuts a :class:`~dtlib.models.gpt.TinyGPT` into ``pp * virtual_stages``
  :class:`GPTStage` modules: the embedding on the first, final norm + LM head on the last, blocks
  balanced by parameter count, by measured time, or given explicitly. Stage ``k`` runs on rank
  ``k % pp`` as its chunk ``k // pp`` (Megatron-LM's round-robin virtual stages).
* :class:`PipelineExecutor` runs one rank's actions of a :mod:`~dtlib.parallel.schedules` schedule:
  activations and gradients travel point to point (``isend`` with a tag per micro-batch and stage,
  blocking ``recv`` just before the action that needs it, so a validated schedule cannot
  deadlock), gradients accumulate over micro-batches, each micro-batch loss is divided by ``m``
  so the result equals one process on the whole batch, and for split schedules (ZB-H1, Qi et al.
  2023) the weight gradients really wait for their "W" action. Every action is logged (start, end,
  time waiting on its receive) with the micro-batch chunks held at each moment.
* With a ``dp_group`` the gradients are averaged over data-parallel replicas after the last
  backward (pp x dp, as in Megatron-LM).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtlib.models.gpt import TinyGPT
from dtlib.parallel.schedules import Action, Event, Timeline, _check_ranks, stage_of, validate
from dtlib.analytic.layout import check_layout

__all__ = ["GPTStage", "partition", "rank_chunks", "PipelineExecutor", "StepLog", "timeline_of",
           "action_seconds", "embedding_groups", "allreduce_embedding_grads"]


class GPTStage(nn.Module):
    """Consecutive blocks of a TinyGPT, with the embedding if first and norm + LM head if last.

    Holds the model's own submodules (parameters are shared, not copied). ``forward`` takes token
    ids on the first stage and hidden states ``[b, s, hidden]`` elsewhere; it returns hidden states,
    or logits on the last stage.
    """

    def __init__(self, model: TinyGPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.cfg, self.dropout, self.first, self.last = model.cfg, model.dropout, first, last
        self.dropout_rng = model.dropout_rng  # TinyGPT.embed runs on this stage
        self.block_ids = blocks
        # with sequence parallelism the residual stream between stages holds s/t positions
        tp_state = getattr(model, "tensor_parallel_state", None)
        self.sequence_shards = tp_state.size if tp_state is not None and tp_state.sequence_parallel else 1
        if first:  # the attribute names TinyGPT.embed reads
            self.wte, self.wpe, self.emb_norm = model.wte, model.wpe, model.emb_norm
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        if last:
            self.norm_f, self.lm_head = model.norm_f, model.lm_head

    def activation_shape(self, tokens_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the hidden states that enter or leave this stage for ``tokens_shape`` = [b, s]
        (this rank's ``s/t`` positions under sequence parallelism)."""
        b, s = tokens_shape
        return (b, s // self.sequence_shards, self.cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = TinyGPT.embed(self, x)
        for block in self.blocks:
            x = block(x)
        return TinyGPT.head(self, x) if self.last else x


def balanced_split(weights: Sequence[float], parts: int, slowdowns: Sequence[float] | None = None) -> list[int]:
    """Counts of consecutive items per part minimising the heaviest part (each part >= 1 item);
    part ``k`` weighs ``slowdowns[k]`` x its items' weights (a slower device; default 1)."""
    n = len(weights)
    slow = list(slowdowns) if slowdowns is not None else [1.0] * parts
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible heaviest part when the first i items form k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], slow[k - 1] * (prefix[i] - prefix[j]))
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def _measured_costs(model: TinyGPT, repeats: int = 3) -> tuple[float, list[float], float]:
    """Forward + backward seconds of the embedding, each block and the head on a [2, seq] batch."""
    idx = torch.randint(0, model.cfg.vocab, (2, model.cfg.seq))

    def seconds(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(x).float().sum().backward()
            times.append(time.perf_counter() - start)
        return min(times)

    hidden = model.embed(idx).detach().requires_grad_()
    costs = (seconds(model.embed, idx), [seconds(b, hidden) for b in model.blocks],
             seconds(model.head, hidden))
    model.zero_grad(set_to_none=True)
    return costs


def embedding_groups(pp_groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Megatron-LM's embedding groups: the first and the last rank of each pipeline. With tied
    embeddings (``cfg.tied_embeddings``) the first stage looks tokens up in ``wte`` and the last
    multiplies by the same matrix in the LM head: two copies on two ranks, kept equal by summing
    their gradients over this group before the (identical) optimizer steps
    (``_allreduce_word_embedding_grads`` in Megatron-LM's ``finalize_model_grads``)."""
    return [[g[0], g[-1]] for g in pp_groups if len(g) > 1]


def allreduce_embedding_grads(model: TinyGPT, group: Any) -> None:
    """Sum the tied word embedding's gradient over ``group`` (this rank's embedding group: it
    holds the first or the last stage). A copy no micro-batch used contributes zeros."""
    weight = model.wte.weight  # the same Parameter as model.lm_head.weight when tied
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)


def partition(model: TinyGPT, pp: int, virtual_stages: int = 1,
              balance: str | Sequence[int] = "params") -> list[GPTStage]:
    """Cut ``model`` into ``pp * virtual_stages`` stages (blocks in order, at least one per stage).

    ``balance``: ``"params"`` (parameter count, embedding counted with the first block and the head
    with the last), ``"time"`` (forward + backward time of each piece measured here), or a list of
    block counts per stage. The RULES of :mod:`dtlib.analytic.layout` reject more stages than layers.
    """
    layers = model.cfg.layers
    # any chunk may hold any blocks (as with Megatron's layout string): the rule is chunks <= layers
    check_layout({"layers": layers, "pp": pp, "virtual_stages": virtual_stages, "first_stage_layers": 0,
                  "last_stage_layers": 0, "pipeline_layout": 1},
                 schedule="interleaved" if virtual_stages > 1 else "1f1b")
    stages = pp * virtual_stages
    if isinstance(balance, str):
        if balance == "params":
            count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
            emb = count(model.wte) + (count(model.wpe) if model.wpe is not None else 0)
            weights = [float(count(b)) for b in model.blocks]
            head = float(count(model.norm_f) + count(model.lm_head))
        elif balance == "time":
            emb, weights, head = _measured_costs(model)
        else:
            raise ValueError(f"balance must be 'params', 'time' or a list of block counts, got {balance!r}")
        weights[0] += emb
        weights[-1] += head
        counts = balanced_split(weights, stages)
    else:
        counts = [int(c) for c in balance]
        if len(counts) != stages or sum(counts) != layers or min(counts) < 1:
            raise ValueError(f"balance must give {stages} block counts >= 1 summing to the {layers} "
                             f"layers, got {list(balance)}")
    out, begin = [], 0
    for k, c in enumerate(counts):
        out.append(GPTStage(model, range(begin, begin + c), first=k == 0, last=k == stages - 1))
        begin += c
    return out


def rank_chunks(stages: Sequence[nn.Module], rank: int, pp: int) -> list[nn.Module]:
    """The chunks of pipeline rank ``rank``: stages ``rank``, ``rank + pp``, ``rank + 2 pp``, ..."""
    return list(stages[rank::pp])


def action_seconds(kind: str, split: bool, virtual_stages: int, t_forward: float, t_backward: float,
                   t_weight: float) -> float:
    """Cost of one action: per-micro-batch costs of a rank's share, 1/v of it per chunk; an unsplit
    "B" does the weight gradient too (the convention of :func:`~dtlib.parallel.schedules.simulate`)."""
    cost = {"F": t_forward, "B": t_backward if split else t_backward + t_weight, "W": t_weight}
    return cost[kind] / virtual_stages


@dataclass
class StepLog:
    """What one pipeline rank did in one step (times from ``time.perf_counter``, shared by the
    processes of a machine): its events, ``(time, micro-batch chunks held)`` after every change,
    and the step's loss on the last stage (None elsewhere)."""
    rank: int
    events: list[Event] = field(default_factory=list)
    held: list[tuple[float, int]] = field(default_factory=list)
    loss: float | None = None


def timeline_of(logs: Sequence[StepLog]) -> Timeline:
    """The :class:`~dtlib.parallel.schedules.Timeline` of one step measured on every pipeline rank."""
    ordered = sorted(logs, key=lambda log: log.rank)
    return Timeline([log.events for log in ordered], held=[log.held for log in ordered])


_PARAM_LEAVES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


class PipelineExecutor:
    """Runs pipeline rank ``rank``'s actions of ``actions`` on its ``chunks`` (one module per chunk).

    ``loss_fn(output, targets)`` is applied on the last stage. ``pp_ranks`` maps pipeline ranks to
    global ranks (default: the same numbers); ``dp_group`` averages gradients over data-parallel
    replicas after the last backward. ``emulate`` (seconds ``{"F", "B", "W"}`` per micro-batch for
    the rank's whole share, split as :func:`action_seconds`) adds a sleep after each action: it
    stands in for an accelerator's compute, so bubbles show on CPU ranks that share cores.
    The schedule is validated before anything runs.
    """

    def __init__(self, chunks: Sequence[nn.Module], actions: Sequence[Sequence[Action]], rank: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 pp_ranks: Sequence[int] | None = None, dp_group: Any = None,
                 emulate: Mapping[str, float] | None = None):
        validate(actions)
        p, v, m, split = _check_ranks(actions)
        if len(chunks) != v:
            raise ValueError(f"the schedule has {v} chunks per rank but {len(chunks)} modules were given")
        if not 0 <= rank < p:
            raise ValueError(f"rank must be in [0, {p}), got {rank}")
        self.chunks, self.actions, self.rank, self.loss_fn = list(chunks), actions[rank], rank, loss_fn
        self.p, self.v, self.m, self.split = p, v, m, split
        self.pp_ranks = list(pp_ranks) if pp_ranks is not None else list(range(p))
        self.dp_group = dp_group
        self.emulate = {k: action_seconds(k, split, v, emulate.get("F", 0.0), emulate.get("B", 0.0),
                                          emulate.get("W", 0.0)) for k in "FBW"} if emulate else None
        self._captured: list[tuple[nn.Module, torch.Tensor]] | None = None
        if split:  # remember the output of every module that owns parameters, for its W pass
            for chunk in self.chunks:
                for mod in chunk.modules():
                    if isinstance(mod, _PARAM_LEAVES):
                        mod.register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self._captured is not None and output.requires_grad:
            self._captured.append((module, output))

    def _peer(self, stage: int) -> int:
        return self.pp_ranks[stage % self.p]

    def _tag(self, stage: int, microbatch: int, grad: bool) -> int:
        return (stage * self.m + microbatch) * 2 + int(grad)

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepLog:
        """Forward and backward of one batch (every rank passes the same batch: the first stage
        reads its tokens, the last its targets, the others its shape). Gradients accumulate into
        ``.grad``: zero them and step the optimizer outside."""
        if inputs.shape[0] % self.m:
            raise ValueError(f"the batch of {inputs.shape[0]} sequences does not split into "
                             f"microbatches={self.m}; use a batch that is a multiple of {self.m}")
        xs, ys = inputs.tensor_split(self.m), targets.tensor_split(self.m)
        last_stage = self.p * self.v - 1
        log = StepLog(self.rank)
        store: dict[tuple[int, int], Any] = {}
        sends: list[tuple[Any, torch.Tensor]] = []
        loss_sum = 0.0
        for a in self.actions:
            stage = stage_of(self.rank, a.chunk, self.p)
            chunk = self.chunks[a.chunk]
            key = (a.microbatch, a.chunk)
            asked = time.perf_counter()
            received = None
            if (a.kind == "F" and stage > 0) or (a.kind == "B" and stage < last_stage):
                param = next(chunk.parameters())
                received = torch.empty(chunk.activation_shape(xs[a.microbatch].shape), dtype=param.dtype,
                                       device=param.device)
                src = stage - 1 if a.kind == "F" else stage + 1
                dist.recv(received, src=self._peer(src), tag=self._tag(stage, a.microbatch, a.kind == "B"))
            start = time.perf_counter()
            outgoing = None  # (tensor, destination stage, is a gradient)
            if a.kind == "F":
                x = xs[a.microbatch] if stage == 0 else received.requires_grad_()
                self._captured = [] if self.split else None
                out = chunk(x)
                captured, self._captured = self._captured, None
                if stage == last_stage:
                    out = self.loss_fn(out, ys[a.microbatch]) / self.m
                    loss_sum += out.item()
                else:
                    outgoing = (out.detach(), stage + 1, False)
                store[key] = (x if stage > 0 else None, out, captured)
            elif a.kind == "B":
                x, out, captured = store[key]
                grad_in = self._backward(key, x, out, captured, received, store)
                if stage > 0:
                    outgoing = (grad_in, stage - 1, True)
            else:
                self._weight_gradients(*store.pop(key))
            if a.kind == "F" or a.kind == ("W" if self.split else "B"):
                log.held.append((time.perf_counter(), len(store)))
            if self.emulate:  # the emulated compute ends before the result leaves
                time.sleep(self.emulate[a.kind])
            if outgoing is not None:
                tensor, dst, grad = outgoing
                work = dist.isend(tensor, self._peer(dst), tag=self._tag(dst, a.microbatch, grad))
                sends.append((work, tensor))
            log.events.append(Event(self.rank, a, start, time.perf_counter(), wait=start - asked))
        for work, _ in sends:
            work.wait()
        if self.dp_group is not None:
            size = dist.get_world_size(self.dp_group)
            for p in self.parameters():
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad /= size
        log.loss = loss_sum if self.rank == self.p - 1 else None  # the last stage is on rank p-1
        return log

    def _backward(self, key: tuple[int, int], x: torch.Tensor | None, out: torch.Tensor,
                  captured: list | None, grad_out: torch.Tensor | None, store: dict) -> torch.Tensor | None:
        """The "B" action: the whole backward, or only the input gradient of a split schedule (the
        gradients at each parameter-owning module's output are kept for its W action)."""
        if not self.split:
            torch.autograd.backward(out, grad_out)
            del store[key]
            return x.grad if x is not None else None
        wanted = ([x] if x is not None else []) + [y for _, y in captured]
        grads = torch.autograd.grad(out, wanted, grad_out, retain_graph=True, allow_unused=True)
        store[key] = ([m for m, _ in captured], [y for _, y in captured], grads[len(wanted) - len(captured):])
        return grads[0] if x is not None else None

    @staticmethod
    def _weight_gradients(modules: list[nn.Module], outputs: list[torch.Tensor],
                          grads: Sequence[torch.Tensor | None]) -> None:
        """The "W" action: each module's parameter gradients from its output's gradient alone
        (one small backward per module, so nothing upstream is recomputed)."""
        for module, y, gy in zip(modules, outputs, grads):
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if gy is None or not params:
                continue
            for p, g in zip(params, torch.autograd.grad(y, params, gy)):
                p.grad = g if p.grad is None else p.grad + g
