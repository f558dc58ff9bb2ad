"""A DeepSpeed JSON config checked before any process starts, and read the way DeepSpeed reads it.

:func:`validate_deepspeed_config` applies dtlib's one-line rules (batch sizes that multiply out as
DeepSpeed requires, ZeRO stage, offload, optimizer, top-level keys DeepSpeed never reads), then
DeepSpeed's own ``DeepSpeedConfig`` for the world size the run will have; the small readers below
(:func:`batch_sizes`, :func:`zero_stage`, :func:`is_offloaded`, :func:`torch_optimizer`) are what
:mod:`dtlib.frameworks.deepspeed_zero` runs from.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import io
import os
from typing import Any

import torch

__all__ = ["use_cpu_accelerator", "OPTIMIZERS", "CPU_OPTIMIZERS", "DEFAULT_GRADIENT_CLIPPING", "validate_deepspeed_config",
           "config_section", "batch_sizes", "check_runnable", "is_offloaded", "zero_stage", "torch_optimizer"]

# the optimizers whose single-process equivalent reference_run can build (DeepSpeed's names)
OPTIMIZERS = ("SGD", "Adam", "AdamW")
# the optimizers DeepSpeed runs on the CPU when offloading (DeepSpeedEngine._configure_basic_optimizer)
CPU_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Lion")
# DeepSpeed 0.19's default gradient_clipping (1.0: clip the global norm): changes the numbers
DEFAULT_GRADIENT_CLIPPING = 1.0


def use_cpu_accelerator() -> bool:
    """Where no GPU is visible, tell DeepSpeed so before it is first imported; True when it did.

    Two settings, both read from DeepSpeed 0.19.8's own code: ``DS_ACCELERATOR=cpu`` (an override
    of its accelerator detection, which otherwise logs ``[WARNING] Setting accelerator to CPU``;
    ``deepspeed/accelerator/real_accelerator.py``); and its table of buildable ops given before it
    probes for it (``deepspeed.ops.__compatible_ops__``, computed on first access by compiling a
    test program for every op: the async-io op's is what prints ``ld: cannot find -laio`` and
    ``collect2: error`` on a machine without libaio). The only reader of that table,
    ``deepspeed/comm/torch.py: build_shm_op``, asks for the shared-memory all-reduce, which only
    inference uses and which takes ~60 s to compile: marked unavailable, nothing is probed."""
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):  # not probed yet: never probe
        deepspeed.ops.__compatible_ops__ = {}
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True


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
    use_cpu_accelerator()  # before DeepSpeed's first import picks an accelerator
    from deepspeed.runtime.config import DeepSpeedConfig

    class _PlannedConfig(DeepSpeedConfig):
        def _configure_train_batch_size(self) -> None:
            self.world_size = world_size
            super()._configure_train_batch_size()

    read: set = set()
    with contextlib.redirect_stdout(io.StringIO()):
        _PlannedConfig(_Recording(copy.deepcopy(ds_config), read))
    return read


def config_section(ds_config: dict, key: str) -> dict:
    value = ds_config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object (a dict), got {value!r}")
    return value


def batch_sizes(ds_config: dict) -> dict[str, int]:
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
    sizes = batch_sizes(ds_config)
    product = sizes["train_micro_batch_size_per_gpu"] * sizes["gradient_accumulation_steps"] * world_size
    if sizes["train_batch_size"] != product:
        raise ValueError(
            f"train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"world_size = {sizes['train_micro_batch_size_per_gpu']} x {sizes['gradient_accumulation_steps']} x "
            f"{world_size} = {product}, got {sizes['train_batch_size']}")
    zero = config_section(ds_config, "zero_optimization")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for what in ("offload_optimizer", "offload_param"):
        device = config_section(zero, what).get("device", "none") if what in zero else "none"
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"zero_optimization.{what}.device must be 'none', 'cpu' or 'nvme', got {device!r}")
        lowest = 3 if what == "offload_param" else 1
        if device != "none" and stage < lowest:
            raise ValueError(f"zero_optimization.{what} needs zero_optimization.stage >= {lowest}, got stage {stage}")
    optimizer = config_section(ds_config, "optimizer")
    for name in ("optimizer", "scheduler"):  # DeepSpeed reads their "type" and "params" only
        extra = sorted(set(config_section(ds_config, name)) - {"type", "params", "legacy_fusion"})
        if extra:
            raise ValueError(f"{name}.{extra[0]} is not a key DeepSpeed reads (it would be ignored "
                             f"silently); {name} takes 'type' and 'params'")
    if (is_offloaded(ds_config) and "type" in optimizer and optimizer["type"] not in CPU_OPTIMIZERS
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


def check_runnable(ds_config: dict) -> None:
    """What the side-by-side runs can mirror in one process (a narrower rule than DeepSpeed's):
    an optimizer of :data:`OPTIMIZERS`, fp32 training, no learning-rate scheduler."""
    optimizer = config_section(ds_config, "optimizer")
    if optimizer.get("type") not in OPTIMIZERS:
        raise ValueError(f"optimizer.type must be one of {', '.join(OPTIMIZERS)} (what reference_run can "
                         f"mirror in one process), got {optimizer.get('type')!r}")
    for key in ("fp16", "bf16", "bfloat16", "torch_autocast"):
        if config_section(ds_config, key).get("enabled", False):
            raise ValueError(f"{key}.enabled must be false here: the runs train in fp32 on CPU, as the "
                             "one-process reference does")
    if "scheduler" in ds_config:
        raise ValueError("scheduler must be left out here: reference_run keeps optimizer.params.lr constant")
    cls, kwargs = torch_optimizer(ds_config)
    try:  # a typo in optimizer.params fails here, not in every rank
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer.params are not valid for {cls.__name__}: {exc}") from None


def is_offloaded(ds_config: dict) -> bool:
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {})
    return offload.get("device", "none") != "none"


def zero_stage(ds_config: dict) -> int:
    return ds_config.get("zero_optimization", {}).get("stage", 0)


def torch_optimizer(ds_config: dict) -> tuple[type, dict]:
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
