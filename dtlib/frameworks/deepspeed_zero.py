"""DeepSpeed ZeRO 1-3 (and CPU optimizer offload), run on CPU ranks next to one process and dtlib.

* :func:`validate_deepspeed_config` - a DeepSpeed JSON config checked before any process starts:
  dtlib's one-line rules (batch sizes, stage, offload, optimizer, typoed keys), then DeepSpeed's own
  ``DeepSpeedConfig`` for the world size the run will have;
* :func:`run_deepspeed` - TinyGPT trained under ``deepspeed.initialize`` on ``world_size`` ranks
  (:func:`dtlib.launch`; gloo and the CPU accelerator on a machine without GPUs, NCCL and CUDA
  otherwise): losses, parameters gathered by DeepSpeed, bytes held per rank read from DeepSpeed's
  optimizer, collectives counted by :class:`dtlib.measure.CollectiveCounter`;
* :func:`reference_run` - the same model, data and optimizer in one process, plain PyTorch;
* :func:`dtlib_run` - the same with dtlib's :class:`~dtlib.parallel.ShardedOptimizer` (stage 1, 2)
  or :class:`~dtlib.parallel.FSDP` (stage 3);
* :func:`memory_estimates` - DeepSpeed's estimators next to :mod:`dtlib.analytic.memory`.

The model is :data:`dtlib.experiments.shrunk_layout.TINY`'s TinyGPT, the data
:func:`~dtlib.frameworks.common.token_batches` (global batch ``train_batch_size``; rank ``r`` takes
the ``r``-th contiguous block, cut into ``gradient_accumulation_steps`` micro-batches).

CPU shims (only where no GPU is visible): ``DS_ACCELERATOR=cpu``, with which DeepSpeed falls back to
gloo by itself, and the shared-memory all-reduce op marked unavailable
(``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False``): DeepSpeed compiles it
(~60 s) when its comm backend starts, but only inference's all-reduce uses it, never training.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import io
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.precision import precision
from dtlib.trainer.shrink import TINY
from dtlib.frameworks.common import FrameworkRun, token_batches
from dtlib.launcher import get_device, launch
from dtlib.measure import CollectiveCounter, optimizer_state_bytes
from dtlib.models.gpt import Block, TinyGPT

__all__ = ["run_deepspeed", "reference_run", "dtlib_run", "validate_deepspeed_config", "memory_estimates",
           "MODEL"]

MODEL = TINY.model_config()  # TinyGPT: 2 layers, hidden 32, 4 heads, 16 tokens, byte vocabulary
# the optimizers whose single-process equivalent reference_run can build (DeepSpeed's names)
OPTIMIZERS = ("SGD", "Adam", "AdamW")
# the optimizers DeepSpeed runs on the CPU when offloading (DeepSpeedEngine._configure_basic_optimizer)
CPU_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Lion")
# DeepSpeed 0.19's default gradient_clipping (1.0: clip the global norm): changes the numbers
DEFAULT_GRADIENT_CLIPPING = 1.0


# ---- the config ------------------------------------------------------------------------------
class _Recording(dict):
    """A config (or its ``keys()``) that adds every top-level key DeepSpeed looks up to ``read``
    (``copy.copy`` of it shares the set)."""

    def __init__(self, items: Any, read: set):
        super().__init__(items)
        self.read = read

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # ``KEY in config.keys()`` is how DeepSpeed reads some sections
        return _Recording(dict.fromkeys(dict.keys(self)), self.read)


def _keys_deepspeed_reads(ds_config: dict, world_size: int) -> set:
    """Run DeepSpeed's own ``DeepSpeedConfig`` on ``ds_config`` for ``world_size`` data-parallel
    ranks (raising what it raises); return the top-level keys it read. It takes the world size
    from an initialised process group (1 without one): the subclass gives it the run's instead,
    just before its batch-size rule."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class _PlannedConfig(DeepSpeedConfig):
        def _configure_train_batch_size(self) -> None:
            self.world_size = world_size
            super()._configure_train_batch_size()

    read: set = set()
    with contextlib.redirect_stdout(io.StringIO()):
        _PlannedConfig(_Recording(copy.deepcopy(ds_config), read))
    return read


def _section(ds_config: dict, key: str) -> dict:
    value = ds_config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object (a dict), got {value!r}")
    return value


def _batch_sizes(ds_config: dict) -> dict[str, int]:
    """The three batch keys, each a positive integer (DeepSpeed derives a missing one; the side
    by side runs need all three to cut the same data)."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"ds_config must be a dict (DeepSpeed's JSON config), got {type(ds_config).__name__}")
    sizes = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1 (all three batch keys are required here), "
                             f"got {value!r}")
        sizes[key] = value
    return sizes


def validate_deepspeed_config(ds_config: dict, world_size: int) -> None:
    """Refuse ``ds_config`` for ``world_size`` ranks with one line naming the key and the valid
    range, before any process starts: DeepSpeed's batch rule (``train_batch_size`` =
    ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x ``world_size``), ZeRO
    stage 0-3, optimizer offload only with stage >= 1 (DeepSpeed's ZeRO-Offload) and one of
    DeepSpeed's CPU optimizers, and keys DeepSpeed does not read (it ignores them silently, so a
    typo such as ``gradient_cliping`` would leave its default in force). Then DeepSpeed's own
    ``DeepSpeedConfig`` runs, and its error (an assertion or pydantic's) becomes one line."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    sizes = _batch_sizes(ds_config)
    product = sizes["train_micro_batch_size_per_gpu"] * sizes["gradient_accumulation_steps"] * world_size
    if sizes["train_batch_size"] != product:
        raise ValueError(
            f"train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"world_size = {sizes['train_micro_batch_size_per_gpu']} x {sizes['gradient_accumulation_steps']} x "
            f"{world_size} = {product}, got {sizes['train_batch_size']}")
    zero = _section(ds_config, "zero_optimization")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for what in ("offload_optimizer", "offload_param"):
        device = _section(zero, what).get("device", "none") if what in zero else "none"
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"zero_optimization.{what}.device must be 'none', 'cpu' or 'nvme', got {device!r}")
        lowest = 3 if what == "offload_param" else 1
        if device != "none" and stage < lowest:
            raise ValueError(f"zero_optimization.{what} needs zero_optimization.stage >= {lowest}, got stage {stage}")
    optimizer = _section(ds_config, "optimizer")
    for section in ("optimizer", "scheduler"):  # DeepSpeed reads their "type" and "params" only
        extra = sorted(set(_section(ds_config, section)) - {"type", "params", "legacy_fusion"})
        if extra:
            raise ValueError(f"{section}.{extra[0]} is not a key DeepSpeed reads (it would be ignored "
                             f"silently); {section} takes 'type' and 'params'")
    if (_offloaded(ds_config) and "type" in optimizer and optimizer["type"] not in CPU_OPTIMIZERS
            and ds_config.get("zero_force_ds_cpu_optimizer", True)):
        raise ValueError(f"optimizer.type must be one of {', '.join(CPU_OPTIMIZERS)} with "
                         f"zero_optimization.offload_optimizer (DeepSpeed's CPU optimizers; "
                         f"zero_force_ds_cpu_optimizer), got {optimizer['type']!r}")
    try:
        read = _keys_deepspeed_reads(ds_config, world_size)
    except Exception as exc:  # noqa: BLE001 - any refusal of DeepSpeed's becomes one line
        raise ValueError(f"DeepSpeedConfig refused the config: {_one_line(exc)}") from None
    unknown = sorted(set(ds_config) - read)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(read), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{unknown[0]!r} is not a key DeepSpeed reads (it would be ignored silently){hint}")


# pydantic models of DeepSpeed's config sections -> the key a user writes
# ("" where pydantic's location already starts with the key, as for the monitors)
_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16", "DeepSpeedBF16Config": "bf16",
             "DeepSpeedMonitorConfig": ""}


def _one_line(exc: Exception) -> str:
    """DeepSpeed's refusal in one line: pydantic's first error as ``key.path: message (got value)``."""
    if hasattr(exc, "errors") and hasattr(exc, "title"):
        error = exc.errors()[0]
        where = ".".join(p for p in [_SECTIONS.get(exc.title, exc.title), *map(str, error["loc"])] if p)
        return f"{where}: {error['msg']} (got {error.get('input')!r})"
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _check_runnable(ds_config: dict) -> None:
    """What the side-by-side runs can mirror in one process (a narrower rule than DeepSpeed's):
    an optimizer of :data:`OPTIMIZERS`, fp32 training, no learning-rate scheduler."""
    optimizer = _section(ds_config, "optimizer")
    if optimizer.get("type") not in OPTIMIZERS:
        raise ValueError(f"optimizer.type must be one of {', '.join(OPTIMIZERS)} (what reference_run can "
                         f"mirror in one process), got {optimizer.get('type')!r}")
    for key in ("fp16", "bf16", "bfloat16", "torch_autocast"):
        if _section(ds_config, key).get("enabled", False):
            raise ValueError(f"{key}.enabled must be false here: the runs train in fp32 on CPU, as the "
                             "one-process reference does")
    if "scheduler" in ds_config:
        raise ValueError("scheduler must be left out here: reference_run keeps optimizer.params.lr constant")
    cls, kwargs = _torch_optimizer(ds_config)
    try:  # a typo in optimizer.params fails here, not in every rank
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer.params are not valid for {cls.__name__}: {exc}") from None


def _offloaded(ds_config: dict) -> bool:
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {})
    return offload.get("device", "none") != "none"


def _stage(ds_config: dict) -> int:
    return ds_config.get("zero_optimization", {}).get("stage", 0)


def _torch_optimizer(ds_config: dict) -> tuple[type, dict]:
    """The torch optimizer (class, keyword arguments) that updates like the one DeepSpeed builds
    (``DeepSpeedEngine._configure_basic_optimizer``): ``SGD`` is ``torch.optim.SGD`` itself;
    ``Adam`` is AdamW unless ``adam_w_mode`` is false, ``AdamW`` always. DeepSpeed's own Adams
    (CPU Adam, FusedAdam) default to ``weight_decay=0``, torch's AdamW to 0.01: made explicit."""
    optimizer = ds_config["optimizer"]
    params = dict(optimizer.get("params", {}))
    if optimizer["type"] == "SGD":
        return torch.optim.SGD, params
    adam_w_mode = params.pop("adam_w_mode", True) or optimizer["type"] == "AdamW"
    torch_adam = params.pop("torch_adam", False)
    params.pop("fp32_optimizer_states", None)
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), params


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
    if torch.cuda.is_available():
        return []
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks its accelerator
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
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


def _deepspeed_rank(rank: int, world_size: int, ds_config: dict, steps: int, seed: int) -> dict[str, Any]:
    import deepspeed

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
    gather = (deepspeed.zero.GatheredParameters(params) if _stage(ds_config) == 3
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
    if not _offloaded(ds_config) or optimizer.get("params", {}).get("torch_adam", False):
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
    if _stage(ds_config) == 3 and persistent:
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
    _check_runnable(ds_config)
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
    stage = _stage(ds_config)
    layout = f"ZeRO-{stage} x {world_size} ranks" + (", optimizer offloaded to CPU" if _offloaded(ds_config) else "")
    return FrameworkRun(framework="DeepSpeed", layout=layout, losses=ranks[0]["losses"], params=ranks[0]["params"],
                        memory=[r["memory"] for r in ranks], collectives=[r["collectives"] for r in ranks],
                        settings=copy.deepcopy(ds_config), notes=_notes(ds_config, shims, ranks[0]["persistent"]))


# ---- the same training without DeepSpeed -------------------------------------------------------
def reference_run(ds_config: dict, steps: int = 3, *, seed: int = 0) -> FrameworkRun:
    """``ds_config``'s training in one process, plain PyTorch: the same TinyGPT, initialisation,
    data (the whole global batch at once) and optimizer (:func:`_torch_optimizer`), no clipping."""
    sizes = _batch_sizes(ds_config)
    per_rank = sizes["train_micro_batch_size_per_gpu"] * sizes["gradient_accumulation_steps"]
    # the world size the config was written for (validation names the key if it does not divide)
    validate_deepspeed_config(ds_config, max(1, sizes["train_batch_size"] // per_rank))
    _check_runnable(ds_config)
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    cls, kwargs = _torch_optimizer(ds_config)
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
    cls, kwargs = _torch_optimizer(ds_config)
    stage = _stage(ds_config)
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
    _check_runnable(ds_config)
    stage = _stage(ds_config)
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

    stage, offload = _stage(ds_config), _offloaded(ds_config)
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
