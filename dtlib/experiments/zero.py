"""ZeRO and FSDP: the experiments a lesson runs on real ranks.

* :func:`measure_zero_stages` - one TinyGPT trained under DDP (stage 0: BucketedDDP + AdamW),
  ZeRO-1 (BucketedDDP + ShardedOptimizer), ZeRO-2 (ShardedOptimizer stage 2) and the toy FSDP
  (stage 3) of :mod:`dtlib.parallel`: bytes of parameters, gradients and optimizer
  state each rank holds, and the bytes it hands to collectives in a step - next to
  :func:`dtlib.analytic.memory.memory_per_gpu` and :func:`dtlib.analytic.comm.strategy_volumes`' predictions;
* :func:`compare_fully_shard` - the toy FSDP and PyTorch's ``fully_shard`` (FSDP2) on the same
  model, data and ranks: final parameters and parameter memory per rank;
* :func:`setup_stage` / :func:`setup_torch_stage` - a model wrapped for one stage by dtlib or by
  PyTorch itself (DDP, ``ZeroRedundancyOptimizer``, ``fully_shard``), and
  :func:`single_process_final` - the one-process training all of them must reproduce;
* :func:`smallest_fitting_stage` - the choice the lesson ends on: the smallest ZeRO stage whose
  predicted model states fit on a GPU.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.analytic import validate
from dtlib.analytic.comm import COLLECTIVES, bytes_sent_per_rank, strategy_volumes
from dtlib.launcher import launch
from dtlib.analytic.memory import memory_per_gpu
from dtlib.measure import CollectiveCounter, optimizer_state_bytes
from dtlib.models import TinyGPT, get_preset, tiny_gpt_config
from dtlib.analytic.config import TransformerConfig
from dtlib.models.gpt import Block
from dtlib.parallel import FSDP, BucketedDDP, ShardedOptimizer
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.precision import Precision, precision

__all__ = ["FP32_ADAMW", "measure_zero_stages", "predict_zero_stages", "compare_fully_shard",
           "setup_stage", "setup_torch_stage", "single_process_final",
           "smallest_fitting_stage"]

FP32_ADAMW: Precision = precision("fp32", optimizer="adamw")  # 4 + 4 + 8 bytes per parameter
_LR = 1e-3


# ---- the four stages, measured -----------------------------------------------------------------
def _batches(cfg: TransformerConfig, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def setup_stage(stage: int, model: nn.Module) -> tuple[nn.Module, Any, Any]:
    """dtlib's ZeRO ``stage`` (0 = DDP, 1, 2, 3 = FSDP with one unit per :class:`Block`) around
    ``model`` with AdamW: (what to call forward on, the optimizer, what to call
    ``finish_gradient_synchronization()`` on after backward). Call inside :func:`dtlib.launch`."""
    if stage == 0:
        ddp = BucketedDDP(model, broadcast_buffers=False)  # the buffers are constant masks
        return ddp, torch.optim.AdamW(model.parameters(), lr=_LR), ddp
    if stage == 1:
        ddp = BucketedDDP(model, broadcast_buffers=False)
        return ddp, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=_LR), ddp
    if stage == 2:  # no DDP: stage 2 reduce-scatters the gradients itself
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=_LR)
        return model, opt, opt
    if stage != 3:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    fsdp = FSDP(model, unit_types=(Block,))
    return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=_LR), fsdp


def setup_torch_stage(stage: int, model: nn.Module) -> tuple[nn.Module, Any]:
    """PyTorch's own counterpart of :func:`setup_stage` (AdamW, same learning rate): stage 0 =
    ``DistributedDataParallel``; 1 = DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer``;
    3 = ``torch.distributed.fsdp.fully_shard`` on every :class:`Block`, then the root (as
    ``unit_types=(Block,)``), on a CPU/gloo mesh. PyTorch has no ZeRO-2 of its own (stage 2 raises).
    Returns (what to call forward on, the optimizer); nothing to wait for after backward."""
    if stage in (0, 1):
        ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)  # as setup_stage
        if stage == 0:
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=_LR)
        with warnings.catch_warnings():  # torch.distributed.optim imports the deprecated torch.jit
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch.distributed.optim import ZeroRedundancyOptimizer
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=_LR)
    if stage == 3:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=_LR)
    raise ValueError(f"PyTorch has a counterpart for stages 0, 1 and 3 only, got {stage!r}")


def _stage_worker(rank: int, world_size: int, stages: Sequence[int], cfg: TransformerConfig,
                  steps: int, batch: int) -> dict[int, dict]:
    data = _batches(cfg, steps, batch)
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        wrapped, opt, sync = setup_stage(stage, model)
        params = list(wrapped.parameters()) if stage == 3 else list(model.parameters())
        for step, (x, y) in enumerate(data):
            xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
            opt.zero_grad()
            with CollectiveCounter() as counter:
                _loss(wrapped, xs, ys).backward()
                sync.finish_gradient_synchronization()
                grads = (opt.grad_bytes() if stage == 2 else
                         sum(p.grad.nbytes for p in params if p.grad is not None))
                opt.step()
        inner = opt.optim if stage in (1, 2) else opt
        measured = {"parameters": sum(p.nbytes for p in params), "gradients": grads,
                    "optimizer": optimizer_state_bytes(inner)["optimizer"]}
        # the full parameters at the end (gather_full_params is a collective: every rank calls it)
        final = list((wrapped.gather_full_params() if stage == 3 else model.state_dict()).values())
        out[stage] = {"measured": measured, "calls": counter.calls,
                      "gathered_peak": wrapped.memory_stats()["peak_unsharded_bytes"] if stage == 3 else 0,
                      "final": [t.detach().clone() for t in final] if rank == 0 else None}
    return out


def single_process_final(cfg: TransformerConfig, world_size: int, steps: int, batch: int) -> list[torch.Tensor]:
    """The parameters (state-dict order) after ``steps`` AdamW steps in *one* process, on the same
    batches cut into the same ``world_size`` micro-batches, each loss divided by ``world_size``
    and accumulated: the arithmetic data parallelism reproduces (the ranks' averaged gradients),
    also when ``batch`` does not divide evenly."""
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=_LR)
    for x, y in _batches(cfg, steps, batch):
        opt.zero_grad()
        for xs, ys in zip(x.tensor_split(world_size), y.tensor_split(world_size)):
            (_loss(model, xs, ys) / world_size).backward()
        opt.step()
    return [t.detach().clone() for t in model.state_dict().values()]


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b) if x.is_floating_point())


def predict_zero_stages(cfg: TransformerConfig | str | float, world_size: int,
                        stages: Sequence[int] = (0, 1, 2, 3),
                        prec: Precision | str = FP32_ADAMW) -> dict[int, dict[str, float]]:
    """Per stage, :func:`dtlib.analytic.memory.memory_per_gpu`'s parameters / gradients / optimizer /
    temporary bytes on one rank, and (for a model shape or preset name) the bytes one rank sends
    per step by :func:`dtlib.analytic.comm.strategy_volumes` (``sent``)."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    out = {}
    for z in stages:
        layout = Parallelism(dp=world_size, zero=z)
        m = memory_per_gpu(cfg, layout, precision=prec)
        row = {"parameters": m.parameters, "gradients": m.gradients, "optimizer": m.optimizer,
               "temporary": m.temporary}
        if isinstance(cfg, TransformerConfig):
            row["sent"] = sum(v["bytes_sent_per_gpu"]
                              for v in strategy_volumes(cfg, layout, precision=prec).values())
        out[z] = row
    return out


def measure_zero_stages(world_size: int = 2, stages: Sequence[int] = (0, 1, 2, 3),
                        cfg: TransformerConfig | None = None, steps: int = 2,
                        batch: int = 8) -> dict[int, dict]:
    """Train ``cfg`` (default: a 4-layer TinyGPT) for ``steps`` AdamW steps under each ZeRO stage.

    Per stage: ``per_rank`` (each rank's measured ``parameters``, ``gradients``, ``optimizer``
    bytes - fp32 AdamW, so 4 + 4 + 8 bytes per parameter unsharded), ``predicted`` (one rank, by
    :func:`predict_zero_stages`), ``calls`` (rank 0's collectives in the last step:
    ``(collective, S bytes)``), ``sent`` (bytes rank 0 sends in that step if they run as rings),
    ``gathered_peak`` (stage 3: the most gathered parameter bytes alive at once),
    ``max_diff_vs_single`` (largest difference of the final parameters from
    :func:`single_process_final`'s) and ``max_diff_vs_ddp`` (from stage 0's, when stage 0 is
    measured): every stage computes the same training.
    """
    cfg = cfg or tiny_gpt_config(layers=4, hidden=128, heads=4)
    ranks = launch(_stage_worker, world_size, args=(list(stages), cfg, steps, batch), timeout=120,
                   output="none")
    predicted = predict_zero_stages(cfg, world_size, stages)
    single = single_process_final(cfg, world_size, steps, batch)
    out = {}
    for z in stages:
        r0 = ranks[0][z]
        row = {"per_rank": [r[z]["measured"] for r in ranks], "predicted": predicted[z],
               "calls": r0["calls"], "gathered_peak": r0["gathered_peak"],
               "sent": sum(bytes_sent_per_rank(op, s, world_size) for op, s in r0["calls"] if op in COLLECTIVES),
               "max_diff_vs_single": _max_diff(r0["final"], single)}
        if 0 in stages:
            row["max_diff_vs_ddp"] = _max_diff(r0["final"], ranks[0][0]["final"])
        out[z] = row
    return out


# ---- next to PyTorch's fully_shard ----------------------------------------------------------------
def _fully_shard_worker(rank: int, world_size: int, cfg: TransformerConfig, steps: int,
                        batch: int) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    data = _batches(cfg, steps, batch)
    torch.manual_seed(0)
    ours, opt, _ = setup_stage(3, TinyGPT(cfg))
    torch.manual_seed(0)
    theirs, their_opt = setup_torch_stage(3, TinyGPT(cfg))  # one unit per block, then the root
    tracker = FSDPMemTracker(theirs, their_opt)
    for step, (x, y) in enumerate(data):
        xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
        opt.zero_grad()
        _loss(ours, xs, ys).backward()
        ours.finish_gradient_synchronization()
        opt.step()
        their_opt.zero_grad()
        if step == steps - 1:  # track the last step (the first allocates the optimizer state)
            tracker.track_inputs((xs,))
            with tracker:
                _loss(theirs, xs, ys).backward()
                their_opt.step()
        else:
            _loss(theirs, xs, ys).backward()
            their_opt.step()
    mine = ours.gather_full_params()
    their_state = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    kinds = ("SHARDED_PARAM", "UNSHARDED_PARAM", "ALL_GATHER", "SHARDED_GRAD", "OPT")
    torch_bytes = {k: 0 for k in kinds}
    for key, value in peak.items():
        name = str(key).split(".")[-1]
        if name in torch_bytes:
            torch_bytes[name] += value
    return {"max_param_diff": max((mine[k] - v).abs().max().item() for k, v in their_state.items()),
            "ours": ours.memory_stats(), "torch": torch_bytes,
            "units": len(ours.units)}


def compare_fully_shard(world_size: int = 2, cfg: TransformerConfig | None = None, steps: int = 3,
                        batch: int = 8) -> dict[str, Any]:
    """Train the toy :class:`~dtlib.parallel.FSDP` and ``torch.distributed.fsdp.fully_shard`` on the
    same TinyGPT, data and ranks (gloo, CPU), each block its own unit.

    Returns rank 0's ``max_param_diff`` (final parameters, ours vs theirs), ``ours``
    (:meth:`FSDP.memory_stats`) and ``torch`` (peak bytes by category from PyTorch's
    ``FSDPMemTracker``, a private tool of ``torch.distributed._tools``, during the last step).
    """
    cfg = cfg or tiny_gpt_config(layers=4, hidden=128, heads=4)
    return launch(_fully_shard_worker, world_size, args=(cfg, steps, batch), timeout=120,
                  output="none")[0]


# ---- choosing a stage -----------------------------------------------------------------------------
def smallest_fitting_stage(model: TransformerConfig | str | float, dp: int, gpu_memory_bytes: float, *,
                           headroom: float = 0.8, prec: Precision | str = "zero") -> int | None:
    """The smallest ZeRO stage (0 = DDP, 1, 2, 3 = FSDP) whose model states fit on one GPU.

    The rule: take the stages in order 0, 1, 2, 3 and return the first whose parameters +
    gradients + optimizer states per GPU (:func:`dtlib.analytic.memory.memory_per_gpu` for
    ``Parallelism(dp=dp, zero=stage)``, ``.model_states``) are at most ``headroom *
    gpu_memory_bytes``; ``None`` when even stage 3 does not fit (add GPUs, or split the model with
    tensor/pipeline parallelism). ``headroom`` in (0, 1] is the share of the memory the model states
    may take; the rest is left for activations, temporary buffers and the framework (default 0.8:
    20% left over). It follows the course's advice (the ZeRO/FSDP lesson) "start with DDP, add
    sharding only when memory demands it": each further stage costs something (ZeRO-3 gathers
    the parameters in every forward and backward, 1.5x DDP's communication; Rajbhandari et al.
    2020, Sec. 7), so no more sharding than needed.

    ``model``: a :class:`TransformerConfig`, a preset name or a parameter count; ``prec``: a
    :class:`Precision` or convention name (default ``"zero"``: 2 + 2 + 12 bytes per parameter).
    Raises ``ValueError`` for a ``headroom`` outside (0, 1] or a non-positive ``gpu_memory_bytes``;
    :class:`Parallelism` rejects a bad ``dp``.
    """
    validate.number("headroom", headroom, maximum=1)  # the fraction of GPU memory states may use
    validate.number("gpu_memory_bytes", gpu_memory_bytes)
    budget = headroom * gpu_memory_bytes
    for stage in range(4):
        if memory_per_gpu(model, Parallelism(dp=dp, zero=stage), precision=prec).model_states <= budget:
            return stage
    return None
