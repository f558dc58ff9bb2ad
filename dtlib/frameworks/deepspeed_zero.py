"""DeepSpeed ZeRO 1-3 (and CPU optimizer offload), run on CPU ranks next to one process and dtlib.

* :func:`validate_deepspeed_config` (:mod:`dtlib.frameworks.deepspeed_config`) - a DeepSpeed JSON
  config checked before any process starts;
* :func:`run_deepspeed` - TinyGPT trained under ``deepspeed.initialize`` on ``world_size`` ranks
  (:func:`dtlib.launch`; gloo and the CPU accelerator on a machine without GPUs, NCCL and CUDA
  otherwise): losses, parameters gathered by DeepSpeed, bytes held per rank read from DeepSpeed's
  optimizer, collectives counted by :class:`dtlib.measure.CollectiveCounter`;
* :func:`reference_run` - the same model, data and optimizer in one process, plain PyTorch;
* :func:`dtlib_run` - the same with dtlib's :class:`~dtlib.parallel.ShardedOptimizer` (stage 1, 2)
  or :class:`~dtlib.parallel.FSDP` (stage 3);
* :func:`memory_estimates` - DeepSpeed's estimators next to :mod:`dtlib.analytic.memory`.

The model is :data:`dtlib.trainer.shrink.TINY`'s TinyGPT, the data
:func:`~dtlib.frameworks.common.token_batches` (global batch ``train_batch_size``; rank ``r`` takes
the ``r``-th contiguous block, cut into ``gradient_accumulation_steps`` micro-batches).

CPU shims (only where no GPU is visible; :func:`~dtlib.frameworks.deepspeed_config.use_cpu_accelerator`):
``DS_ACCELERATOR=cpu``, with which DeepSpeed falls back to gloo by itself, and the shared-memory
all-reduce op marked unavailable before DeepSpeed probes which ops it can build (its probe compiles
a test program per op: the async-io one prints linker errors where libaio is missing): DeepSpeed
compiles that op (~60 s) when its comm backend starts, but only inference's all-reduce uses it.
"""
from __future__ import annotations

from dtlib.extras import require

require("frameworks", "deepspeed", feature=__name__)

import contextlib
import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.precision import precision
from dtlib.trainer.shrink import TINY
from dtlib.frameworks.common import FrameworkRun, token_batches
from dtlib.frameworks.deepspeed_config import (DEFAULT_GRADIENT_CLIPPING, batch_sizes, check_runnable,
                                               is_offloaded, torch_optimizer, use_cpu_accelerator,
                                               validate_deepspeed_config, zero_stage)
from dtlib.launcher import get_device, launch
from dtlib.measure import CollectiveCounter, optimizer_state_bytes
from dtlib.models.gpt import Block, TinyGPT

__all__ = ["run_deepspeed", "reference_run", "dtlib_run", "validate_deepspeed_config", "memory_estimates",
           "MODEL"]

MODEL = TINY.model_config()  # TinyGPT: 2 layers, hidden 32, 4 heads, 16 tokens, byte vocabulary
# ---- the data ---------------------------------------------------------------------------------
def _micro_batches(ds_config: dict, world_size: int, rank: int, steps: int, seed: int) -> list[list[torch.Tensor]]:
    """Per step, rank ``rank``'s micro-batches (token ids ``[micro, seq + 1]``): its contiguous block of
    the global batch, in ``gradient_accumulation_steps`` pieces."""
    data = torch.from_numpy(token_batches(steps, ds_config["train_batch_size"], MODEL.seq, MODEL.vocab, seed))
    per_rank = ds_config["train_batch_size"] // world_size
    block = data[:, rank * per_rank:(rank + 1) * per_rank]
    return [list(step.split(ds_config["train_micro_batch_size_per_gpu"])) for step in block]


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _global_mean(value: float) -> float:
    t = torch.tensor([value / dist.get_world_size()], dtype=torch.float64, device=get_device())
    dist.all_reduce(t)
    return t.item()


def _cpu_shims() -> list[str]:
    """The settings DeepSpeed needs on a machine without GPUs (none with GPUs), one line each."""
    if not use_cpu_accelerator():
        return []
    return ["DS_ACCELERATOR=cpu: DeepSpeed's CPU accelerator, which falls back to gloo without oneCCL",
            "deepspeed_shm_comm marked unavailable: its ~60 s compile serves only inference's all-reduce"]


# ---- one rank under DeepSpeed ----------------------------------------------------------------
def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _held_bytes(engine: Any, gradients: dict[str, int]) -> dict[str, int]:
    """What this rank holds, read from DeepSpeed's objects: ``parameters`` (the working copy the
    model computes with: all of it below stage 3, this rank's partition and the persistent small
    parameters at stage 3), the ``gradients`` entries of :func:`_gradient_bytes`, ``master`` (the
    fp32 partition ZeRO keeps for the optimizer, even when training in fp32), ``optimizer_states``
    (its state tensors), ``optimizer`` (the two: what ZeRO-1 shards) and ``offloaded`` (the
    optimizer and gradient bytes DeepSpeed keeps on the CPU with ``offload_optimizer``)."""
    opt = engine.optimizer
    model_params = list(engine.module.parameters())
    stage = engine.zero_optimization_stage()
    if stage == 0:
        parameters, master, states = _nbytes(model_params), 0, optimizer_state_bytes(opt)["optimizer"]
    elif stage in (1, 2):
        parameters = _nbytes(opt.bit16_groups_flat)
        master = _nbytes(opt.single_partition_of_fp32_groups)
        states = optimizer_state_bytes(opt.optimizer)["optimizer"]
    else:
        persistent = [p for p in model_params if getattr(p, "ds_persist", False)]
        parameters = _nbytes(opt.fp16_partitioned_groups_flat) + _nbytes(persistent)
        master = _nbytes(opt.fp32_partitioned_groups_flat)
        states = optimizer_state_bytes(opt.optimizer)["optimizer"]
    offloaded = master + states + gradients["offloaded_gradients"] if _offloading(opt) else 0
    return {"parameters": parameters, **gradients, "optimizer": master + states, "master": master,
            "optimizer_states": states, "offloaded": offloaded}


def _offloading(opt: Any) -> bool:
    """Whether DeepSpeed's ZeRO optimizer keeps its state on the CPU (ZeRO-1/2 call it
    ``cpu_offload``, ZeRO-3 ``offload_optimizer``)."""
    return bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False))


def _distinct_bytes(tensors: Any) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views of a flat buffer share one)."""
    storages = {}
    for t in tensors:
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _gradient_bytes(engine: Any) -> dict[str, int]:
    """Gradient bytes this rank holds right after a backward. ``gradients``: the parameters'
    ``.grad`` and ZeRO's gradient partitions (stage 1-2: ``averaged_gradients``,
    ``all_grad_tensors``, ``grads_in_partition``; stage 3: ``grad_partitions_flat_buffer``).
    ``offloaded_gradients`` (with offload): the reduced partition as the fp32 master's ``.grad`` on
    the CPU, and at stage 1-2 its accumulator across micro-batches (``accumulated_grads_in_cpu``).
    ``gradient_buffers``: stage 1-2's contiguous bucket a backward copies gradients into."""
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    tensors = [p.grad for p in engine.module.parameters()]
    offloaded, buffers = [], []
    if stage in (1, 2):
        for group in (opt.averaged_gradients, getattr(opt, "all_grad_tensors", {})):
            tensors += [g for part in group.values() for g in (part or [])]
        tensors.append(getattr(opt, "grads_in_partition", None))
        if _offloading(opt):
            offloaded = [p.grad for p in opt.single_partition_of_fp32_groups]
            offloaded += list(getattr(opt, "accumulated_grads_in_cpu", {}).values())
        buffers = [b for bucket in opt.ipg_buckets.values() for b in bucket.buffer]
    if stage == 3:
        tensors.append(opt.grad_partitions_flat_buffer)
        if _offloading(opt):
            offloaded = [p.grad for p in opt.fp32_partitioned_groups_flat]
    return {"gradients": _distinct_bytes(tensors), "offloaded_gradients": _distinct_bytes(offloaded),
            "gradient_buffers": _distinct_bytes(buffers)}


class _AllowedInTheConfig(logging.Filter):
    """Drops DeepSpeed's warning that an untested optimizer runs under ZeRO (``engine.py``,
    ``_do_optimizer_sanity_check``, 0.19.8), given only when the config's
    ``zero_allow_untested_optimizer`` asked for exactly that: it repeats the config."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def _deepspeed_rank(rank: int, world_size: int, ds_config: dict, steps: int, seed: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import logger

    if ds_config.get("zero_allow_untested_optimizer"):
        logger.addFilter(_AllowedInTheConfig())  # this rank's logger: the caller's is untouched
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=copy.deepcopy(ds_config))
    batches = _micro_batches(ds_config, world_size, rank, steps, seed)
    counter = CollectiveCounter()
    losses, gradients = [], dict.fromkeys(("gradients", "offloaded_gradients", "gradient_buffers"), 0)
    for step, micro in enumerate(batches):
        local = 0.0
        for i, tokens in enumerate(micro):
            with counter:  # forward, backward and step only: not the loss logging below
                loss = _loss(engine, tokens.to(engine.device))
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
                if step == steps - 1:  # the most held after any backward of the last step
                    gradients = {k: max(v, gradients[k]) for k, v in _gradient_bytes(engine).items()}
                engine.step()  # an optimizer step at the accumulation boundary only
            local += loss.item() / len(micro)
        losses.append(_global_mean(local))
    memory = _held_bytes(engine, gradients)
    params = list(engine.module.parameters())
    gather = (deepspeed.zero.GatheredParameters(params) if zero_stage(ds_config) == 3
              else contextlib.nullcontext())
    with gather:  # ZeRO-3: DeepSpeed all-gathers the partitions for the block, fp32 here
        full = {n: p.detach().float().cpu().numpy().copy() for n, p in engine.module.named_parameters()}
    persistent = sum(1 for p in params if getattr(p, "ds_persist", False))
    return {"losses": losses, "params": full if rank == 0 else None, "memory": memory,
            "collectives": dict(counter.counts), "persistent": persistent}


def _build_ops(ds_config: dict) -> list[str]:
    """Compile (first time on a machine, ~40-60 s on 2 idle cores; cached in
    ``~/.cache/torch_extensions``) or load the ops the run needs, here in the calling process:
    once rather than in every rank, outside the ranks' timeout, and never killed half-way (a
    compiler ninja started in a rank escapes the launcher's kill of that rank's process group).
    The forked ranks inherit the loaded op."""
    optimizer = ds_config.get("optimizer", {})
    if not is_offloaded(ds_config) or optimizer.get("params", {}).get("torch_adam", False):
        return []
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
    return ["CPU Adam op loaded in the calling process (compiled on first use), inherited by the ranks"]


def _notes(ds_config: dict, shims: list[str], persistent: int) -> list[str]:
    notes = list(shims)
    if "gradient_clipping" not in ds_config:
        notes.append(f"gradient_clipping not set: DeepSpeed's default {DEFAULT_GRADIENT_CLIPPING} clips the "
                     "global gradient norm, so the run differs from one process; set it to 0.0 to compare")
    elif ds_config["gradient_clipping"]:
        notes.append(f"gradient_clipping {ds_config['gradient_clipping']}: the global gradient norm is clipped")
    if zero_stage(ds_config) == 3 and persistent:
        notes.append(f"{persistent} parameters stay whole on every rank: smaller than "
                     "zero_optimization.stage3_param_persistence_threshold (default 1e5 elements)")
    return notes


def run_deepspeed(ds_config: dict, world_size: int = 2, steps: int = 3, *, seed: int = 0,
                  timeout: float = 300.0) -> FrameworkRun:
    """Train TinyGPT ``steps`` steps under ``deepspeed.initialize(config=ds_config)`` on
    ``world_size`` ranks. The config is used as given (never changed): a missing
    ``gradient_clipping`` leaves DeepSpeed's default 1.0 in force, and ``notes`` says so.
    ``timeout`` (seconds) bounds the ranks; an op they need (CPU Adam with offload) is compiled
    or loaded before they start (:func:`_build_ops`). ``collectives``: calls per rank over the ``steps``
    steps (forward, backward, optimizer step), as the c10d layer saw them."""
    shims = _cpu_shims()  # before DeepSpeed picks its accelerator (validation imports it)
    validate_deepspeed_config(ds_config, world_size)
    check_runnable(ds_config)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < world_size:  # DeepSpeed's CUDA accelerator puts rank r on cuda:r
        raise ValueError(f"world_size must be <= {gpus}, the GPUs visible (DeepSpeed's CUDA accelerator "
                         f"needs one per rank), got {world_size}")
    # imported once here and inherited by the forked ranks: ZeRO's optimizer check imports
    # DeepSpeed's Muon, whose torch.compile decorators import inductor (~9 s on 2 cores, per rank)
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    shims += _build_ops(ds_config)

    ranks = launch(_deepspeed_rank, world_size, args=(copy.deepcopy(ds_config), steps, seed),
                   timeout=timeout, output="none")
    stage = zero_stage(ds_config)
    layout = f"ZeRO-{stage} x {world_size} ranks" + (", optimizer offloaded to CPU" if is_offloaded(ds_config) else "")
    return FrameworkRun(framework="DeepSpeed", layout=layout, losses=ranks[0]["losses"], params=ranks[0]["params"],
                        memory=[r["memory"] for r in ranks], collectives=[r["collectives"] for r in ranks],
                        settings=copy.deepcopy(ds_config), notes=_notes(ds_config, shims, ranks[0]["persistent"]))


# ---- the same training without DeepSpeed -------------------------------------------------------
def reference_run(ds_config: dict, steps: int = 3, *, seed: int = 0) -> FrameworkRun:
    """``ds_config``'s training in one process, plain PyTorch: the same TinyGPT, initialisation,
    data (the whole global batch at once) and optimizer (:func:`_torch_optimizer`), no clipping."""
    sizes = batch_sizes(ds_config)
    per_rank = sizes["train_micro_batch_size_per_gpu"] * sizes["gradient_accumulation_steps"]
    # the world size the config was written for (validation names the key if it does not divide)
    validate_deepspeed_config(ds_config, max(1, sizes["train_batch_size"] // per_rank))
    check_runnable(ds_config)
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    cls, kwargs = torch_optimizer(ds_config)
    optimizer = cls(model.parameters(), **kwargs)
    data = torch.from_numpy(token_batches(steps, ds_config["train_batch_size"], MODEL.seq, MODEL.vocab, seed))
    losses = []
    for tokens in data:
        loss = _loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
    return FrameworkRun(framework="one process", layout="1 process", losses=losses, params=params,
                        settings={"optimizer": cls.__name__, **kwargs})


def _dtlib_rank(rank: int, world_size: int, ds_config: dict, steps: int, seed: int) -> dict[str, Any]:
    from dtlib.parallel.collectives import all_reduce_coalesced
    from dtlib.parallel.fsdp import FSDP
    from dtlib.parallel.zero import ShardedOptimizer

    torch.manual_seed(seed)
    model = TinyGPT(MODEL).to(get_device())
    cls, kwargs = torch_optimizer(ds_config)
    stage = zero_stage(ds_config)
    forward: Any = model
    if stage == 3:
        forward = FSDP(model, unit_types=(Block,))
        optimizer: Any = cls(forward.parameters(), **kwargs)
    else:
        optimizer = ShardedOptimizer(model.parameters(), cls, stage=stage, **kwargs)
    counter = CollectiveCounter()
    losses = []
    for micro in _micro_batches(ds_config, world_size, rank, steps, seed):
        local = 0.0
        with counter:
            for tokens in micro:
                loss = _loss(forward, tokens.to(get_device()))
                (loss / len(micro)).backward()
                local += loss.item() / len(micro)
            if stage == 1:  # ZeRO-1 shards the optimizer only: gradients are averaged first
                all_reduce_coalesced([p.grad for p in model.parameters()], divisor=world_size)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(_global_mean(local))
    full = forward.gather_full_params() if stage == 3 else dict(model.named_parameters())
    full = {n: t.detach().cpu().numpy().copy() for n, t in full.items() if n in dict(model.named_parameters())}
    return {"losses": losses, "params": full if rank == 0 else None, "collectives": dict(counter.counts)}


def dtlib_run(ds_config: dict, world_size: int = 2, steps: int = 3, *, seed: int = 0,
              timeout: float = 60.0) -> FrameworkRun:
    """``ds_config``'s ZeRO stage (1-3) with dtlib's own sharding on ``world_size`` ranks: the same
    model, data, micro-batches and optimizer as :func:`run_deepspeed`, no clipping."""
    validate_deepspeed_config(ds_config, world_size)
    check_runnable(ds_config)
    stage = zero_stage(ds_config)
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 1, 2 or 3 for dtlib_run, got {stage}")
    ranks = launch(_dtlib_rank, world_size, args=(copy.deepcopy(ds_config), steps, seed), timeout=timeout,
                   output="none")
    what = "FSDP" if stage == 3 else f"ShardedOptimizer stage {stage}"
    return FrameworkRun(framework="dtlib", layout=f"{what} x {world_size} ranks", losses=ranks[0]["losses"],
                        params=ranks[0]["params"], collectives=[r["collectives"] for r in ranks],
                        settings=copy.deepcopy(ds_config))


# ---- what the estimators say -------------------------------------------------------------------
def _dtlib_optimizer(ds_config: dict) -> str:
    """``ds_config``'s optimizer in :mod:`dtlib.analytic.precision`'s names (its state bytes)."""
    optimizer = ds_config.get("optimizer", {})
    if optimizer.get("type") == "SGD":
        return "sgd-momentum" if optimizer.get("params", {}).get("momentum", 0) else "sgd"
    return "adam"


def memory_estimates(ds_config: dict, world_size: int = 2, measured: FrameworkRun | None = None) -> dict[str, dict]:
    """Model-state bytes per rank for ``ds_config`` on ``world_size`` ranks, four ways (each a dict
    with ``gpu`` - bytes per GPU - and ``cpu``, plus a breakdown where the source gives one):

    * ``"deepspeed"``: DeepSpeed's estimator (``estimate_zero2_model_states_mem_needs`` for stages
      0-2, ``estimate_zero3_...`` for stage 3; the pure functions behind the ``..._all_live``
      printers): fp16 mixed precision with Adam, ``2 + 18 / N`` bytes/param at ZeRO-2 (``2 +
      18`` unsharded below it, which it has no estimator for), ``18 / N`` plus ``4 x largest
      layer`` at ZeRO-3; its ``cpu`` is its host memory per node (x 1.5 buffer factor) divided by
      the ranks of the node;
    * ``"dtlib (megatron-fp16)"``: :func:`dtlib.analytic.memory.memory_per_gpu` with the convention
      that counts what DeepSpeed's 18 does (2-byte params and grads, fp32 master, fp32 gradient
      copy, Adam: 20 bytes/param);
    * ``"dtlib (fp32)"``: the same formula for what this run holds (fp32, its optimizer's states);
    * ``"measured"`` (with ``measured``): the most any rank of that run held.

    Where they disagree, and why, is in docs/frameworks.md ("DeepSpeed")."""
    validate_deepspeed_config(ds_config, world_size)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    stage, offload = zero_stage(ds_config), is_offloaded(ds_config)
    # a real model, not one on the meta device: model_to_params counts each data_ptr once
    total, largest = model_to_params(TinyGPT(MODEL))
    ranks = world_size if stage >= 2 else 1  # below ZeRO-2: its formula with nothing sharded
    if stage == 3:
        cpu, gpu, temporary = estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=ranks, cpu_offload=offload, cpu_offload_params=False)
        deepspeed_row = {"gpu": gpu, "temporary": temporary}
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=ranks, cpu_offload=offload)
        deepspeed_row = {"gpu": gpu}
    deepspeed_row["cpu"] = cpu / ranks  # DeepSpeed gives the host memory of a node of `ranks` GPUs
    layout = Parallelism(dp=world_size, zero=stage, offload="optimizer" if offload else "none")
    rows = {"deepspeed": deepspeed_row}
    for name, prec in (("dtlib (megatron-fp16)", "megatron-fp16"),
                       ("dtlib (fp32)", precision("fp32", "fp32", _dtlib_optimizer(ds_config)))):
        b = memory_per_gpu(MODEL, layout, precision=prec)
        rows[name] = {"parameters": b.parameters, "gradients": b.gradients, "optimizer": b.optimizer,
                      "temporary": b.temporary, "gpu": b.model_states + b.temporary, "cpu": b.cpu}
    if measured is not None:
        worst = {k: max(m[k] for m in measured.memory) for k in measured.memory[0]}
        on_gpu = worst["parameters"] + worst["gradients"] + (0 if offload else worst["optimizer"])
        rows["measured"] = {**worst, "gpu": on_gpu, "cpu": worst["offloaded"]}
    return rows
