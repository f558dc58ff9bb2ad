"""Checks for the frameworks exercise: one layout written in three frameworks' own languages.

* Q1 :func:`check_deepspeed_batch`, :func:`check_deepspeed_memory`, :func:`check_deepspeed_run` -
  ``deepspeed_config()``, DeepSpeed's JSON as a dict, for :data:`DEEPSPEED_TASK`: the three batch
  sizes multiply out (DeepSpeed's own rule, ``deepspeed/runtime/config.py:_batch_assertion``), the
  ZeRO stage shards what the task asks and no more, and two DeepSpeed ranks train equal to one process.
* Q2 :func:`check_megatron_layout`, :func:`check_megatron_batch`, :func:`check_megatron_run` -
  ``megatron_flags()``, Megatron-LM's command-line flags, for :data:`MEGATRON_TASK`: the parallel
  sizes and sequence parallelism, the batch flags, and a Megatron-Core run equal to one process.
* Q3 :func:`check_jax_tensor_parallel`, :func:`check_jax_fsdp`, :func:`check_jax_run` -
  ``partition_specs()``, a PartitionSpec per weight role and one for the batch, for
  :data:`JAX_TASK`: the Megatron split on the right dimension of each matrix, every weight sharded
  over ``fsdp``, and the GSPMD run on 8 host devices equal to the unsharded one.
* Q4 :func:`check_silent_flags`, :func:`check_silent_values` - ``silent_changes()``, a dict flag ->
  value, for :func:`broken_megatron_flags` (the flags ``dtlib plan --emit megatron`` writes for
  :data:`SILENT_TASK`, with :data:`_DROPPED` removed): every flag whose absence lets Megatron-LM's
  default change the planned model, and the value the plan needs. The expected flags and values
  are the emitter's own output, computed here, never in the learner's notebook.

Every failing check raises an ``AssertionError`` whose first line names the mistake and how to
think about it, never the answer. The runs are compared with one process within
:data:`TOLERANCE`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from dtlib.grading.feedback import first_line

__all__ = ["DEEPSPEED_TASK", "MEGATRON_TASK", "JAX_TASK", "TOLERANCE", "STEPS",
           "check_deepspeed_batch", "check_deepspeed_memory", "check_deepspeed_run",
           "check_megatron_layout", "check_megatron_batch", "check_megatron_run",
           "check_jax_tensor_parallel", "check_jax_fsdp", "check_jax_run", "answer",
           "SILENT_TASK", "broken_megatron_flags", "check_silent_flags", "check_silent_values"]

STEPS = 3
# fp32 runs that reorder sums (a reduce-scatter, an all-reduce, a sharded matmul) differ from one
# process by rounding: about 1e-7 per step in the losses (shared/notes/frameworks-on-cpu.md measured
# at most 2.4e-7 over 3 steps). A real mistake (clipping, a gradient off by a factor, a missing
# micro-batch) moves the losses by 1e-3 or more from step 2 on, so 1e-5 separates them by 40x.
TOLERANCE = 1e-5

# The layouts the questions ask for (the learner reads them in the exercise's markdown).
DEEPSPEED_TASK = {"world_size": 2, "global_batch": 8, "micro_batch_size": 4, "sharded": ("optimizer",)}
MEGATRON_TASK = {"world_size": 4, "tp": 2, "pp": 2, "sequence_parallel": True, "micro_batch_size": 1,
                 "global_batch": 4}
JAX_TASK = {"mesh": {"fsdp": 4, "model": 2}}
# Megatron's split (Shoeybi et al. 2019, Sec. 3): column-parallel layers split their output
# features, row-parallel layers their input features. Dim index of each kind in a (in, out) kernel.
_COLUMN, _ROW = ("attn.qkv", "mlp.up"), ("attn.out", "mlp.down")


def answer(fn: Callable, name: str) -> Any:
    """The learner's ``fn()``, with a stub (``...``/None) or an exception turned into a hint."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - any error of the learner's code becomes a hint
        raise AssertionError(f"{name}() raised {first_line(e)}") from e
    if value is ... or value is None:
        raise AssertionError(f"{name}() returned {value}: replace the ... with your answer")
    return value


# ---------------------------------------------------------------- Q1: DeepSpeed's JSON

def _config(deepspeed_config: Callable) -> dict:
    cfg = answer(deepspeed_config, "deepspeed_config")
    if not isinstance(cfg, dict):
        raise AssertionError(f"deepspeed_config() must return a dict (DeepSpeed's JSON as a Python dict), "
                             f"got {type(cfg).__name__}")
    return cfg


def _positive(cfg: dict, key: str) -> int:
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AssertionError(f"{key} must be a positive integer, got {value!r}")
    return value


def check_deepspeed_batch(deepspeed_config: Callable) -> None:
    """The three batch keys (the runner asks for all three; DeepSpeed itself derives a missing one)
    multiply out with the ranks, and give the layout's global batch and micro-batch."""
    cfg = _config(deepspeed_config)
    world = DEEPSPEED_TASK["world_size"]
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise AssertionError(f"{', '.join(missing)} missing: give all three batch keys, so that the config "
                             "says the layout without DeepSpeed guessing")
    batch, micro, accumulate = (_positive(cfg, k) for k in keys)
    if batch != micro * accumulate * world:
        raise AssertionError(
            f"the batch sizes do not multiply out: train_batch_size ({batch}) must equal "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks ({micro} x {accumulate} x {world})")
    if batch != DEEPSPEED_TASK["global_batch"]:
        raise AssertionError(f"your config trains {batch} sequences per optimizer step: train_batch_size is the "
                             "global batch (all ranks, all micro-batches); read the layout's global batch again")
    if micro != DEEPSPEED_TASK["micro_batch_size"]:
        raise AssertionError(f"one forward pass of one rank runs {micro} sequences in your config: "
                             "train_micro_batch_size_per_gpu is what one rank holds at once; read the layout again")


_STAGE_HINTS = {
    0: "stage 0 shards nothing: every rank would hold all the optimizer states, where the layout asks for half",
    2: "stage 2 also shards the gradients: the layout keeps every gradient whole on each rank",
    3: "stage 3 also shards the gradients and the parameters: the layout keeps both whole on each rank "
       "(stage 3 pays an all_gather of the weights in every forward and backward)",
}


def check_deepspeed_memory(deepspeed_config: Callable) -> None:
    """``zero_optimization``: the stage that shards exactly what the layout asks, and no offload."""
    cfg = _config(deepspeed_config)
    zero = cfg.get("zero_optimization")
    if zero is None:
        raise AssertionError("zero_optimization is missing: without it DeepSpeed runs stage 0 and every rank "
                             "holds all optimizer states and gradients")
    if not isinstance(zero, dict):
        raise AssertionError(f"zero_optimization must be a dict such as {{'stage': ...}}, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise AssertionError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage in _STAGE_HINTS:
        raise AssertionError(_STAGE_HINTS[stage])
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if section is not None and (not isinstance(section, dict) or section.get("device", "none") != "none"):
            raise AssertionError(f"zero_optimization.{key} moves state to the CPU: the layout keeps its shards on "
                                 "the ranks (no offload)")


@functools.lru_cache(maxsize=None)
def _deepspeed_reference(key: str) -> Any:
    """One process on the same data and optimizer, shared by every check of a session with the same
    config (``key``: the config as sorted JSON)."""
    import json

    from dtlib.frameworks.deepspeed_zero import reference_run
    return reference_run(json.loads(key), STEPS)


def check_deepspeed_run(deepspeed_config: Callable) -> None:
    """Two DeepSpeed ranks train :data:`STEPS` steps with the config; losses and final parameters
    equal one process within :data:`TOLERANCE`."""
    import json

    from dtlib.frameworks.common import compare
    from dtlib.frameworks.deepspeed_zero import DEFAULT_GRADIENT_CLIPPING, run_deepspeed, validate_deepspeed_config

    cfg = _config(deepspeed_config)
    world = DEEPSPEED_TASK["world_size"]
    if "optimizer" not in cfg:
        raise AssertionError("optimizer is missing: without it DeepSpeed has no optimizer to shard; use the one "
                             "the question gives")
    try:
        validate_deepspeed_config(cfg, world)
    except ValueError as e:
        raise AssertionError(f"DeepSpeed would reject this config: {e}") from None
    clipping = cfg.get("gradient_clipping", DEFAULT_GRADIENT_CLIPPING)
    if clipping:  # before the run: a clipped step cannot equal one process, and the run costs seconds
        said = "gradient_clipping" in cfg
        raise AssertionError(
            f"gradient_clipping is {clipping}{'' if said else ' (DeepSpeed default)'}: DeepSpeed rescales every "
            "gradient whose norm is above it, so its steps differ from one process from step 2 on; the layout "
            "asks for the plain optimizer step")
    try:
        run = run_deepspeed(cfg, world_size=world, steps=STEPS)
    except Exception as e:  # noqa: BLE001 - a rank's error becomes the first line
        raise AssertionError(f"the DeepSpeed run failed: {first_line(e)}") from e
    diff = compare(run, _deepspeed_reference(json.dumps(cfg, sort_keys=True)))
    _equal_to_one_process("DeepSpeed", diff)


def _equal_to_one_process(who: str, diff: dict[str, float]) -> None:
    if diff["max_loss_diff"] > TOLERANCE or diff["max_param_diff"] > TOLERANCE:
        raise AssertionError(f"the {who} run differs from one process: losses by up to {diff['max_loss_diff']:.2g}, "
                             f"parameters by up to {diff['max_param_diff']:.2g} (rounding is below {TOLERANCE:g})")


# ---------------------------------------------------------------- Q2: Megatron-LM's flags

def _flags(megatron_flags: Callable) -> tuple[list[str], dict, list[str]]:
    """The learner's flags, Megatron-LM's reading of them for the task's world size, and the
    warnings that reading gave (Megatron-LM ignores some flags with a warning only)."""
    import warnings

    from dtlib.frameworks.megatron_flags import parse_megatron_flags

    flags = answer(megatron_flags, "megatron_flags")
    if isinstance(flags, str):
        flags = flags.split()
    if not (isinstance(flags, (list, tuple)) and all(isinstance(f, str) for f in flags)):
        raise AssertionError(f"megatron_flags() must return a list of strings such as ['--micro-batch-size', '4'], "
                             f"got {flags!r}")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            parsed = parse_megatron_flags(list(flags), MEGATRON_TASK["world_size"])
        except ValueError as e:
            raise AssertionError(f"Megatron-LM would refuse these flags: {e}") from None
    return list(flags), parsed, [str(w.message) for w in said]


def check_megatron_layout(megatron_flags: Callable) -> None:
    """The parallel sizes Megatron-LM reads from the flags (the data-parallel size is what the
    world size leaves) and sequence parallelism, as the layout asks."""
    _, parsed, said = _flags(megatron_flags)
    ignored = [w for w in said if "sequence-parallel" in w]
    if ignored:
        raise AssertionError("--sequence-parallel without tensor parallelism is ignored (Megatron-LM disables it "
                             "with a warning): sequence parallelism splits the activations of a tensor-parallel "
                             "group, so it needs one")
    for key, flag, what in (("tp", "--tensor-model-parallel-size", "tensor-parallel group"),
                            ("pp", "--pipeline-model-parallel-size", "pipeline")):
        if parsed[key] != MEGATRON_TASK[key]:
            raise AssertionError(f"{flag} is {parsed[key]}: the layout's {what} has another size (an absent flag "
                                 f"means 1)")
    if parsed["sequence_parallel"] != MEGATRON_TASK["sequence_parallel"]:
        raise AssertionError("sequence parallelism is off: the layout splits the activations outside the tensor-"
                             "parallel matmuls (norms, dropout) over the tensor-parallel ranks too; Megatron-LM has "
                             "a switch for it")
    if parsed["virtual_stages"] != 1:
        raise AssertionError("--num-layers-per-virtual-pipeline-stage turns on the interleaved schedule: the layout "
                             "asks for plain 1F1B (one model chunk per pipeline rank)")


def check_megatron_batch(megatron_flags: Callable) -> None:
    """``--micro-batch-size`` and ``--global-batch-size``: the layout's micro-batch and global batch
    (the number of micro-batches is what Megatron derives from them)."""
    flags, parsed, _ = _flags(megatron_flags)
    if parsed["micro_batch_size"] != MEGATRON_TASK["micro_batch_size"]:
        raise AssertionError(f"--micro-batch-size is {parsed['micro_batch_size']}: one micro-batch of the layout holds "
                             "another number of sequences (an absent flag means 1)")
    if "--global-batch-size" not in " ".join(flags):
        raise AssertionError("no --global-batch-size: Megatron-LM then trains micro-batch x data-parallel size "
                             "sequences per step, a single micro-batch that leaves the pipeline nothing to overlap")
    global_batch = parsed["micro_batch_size"] * parsed["dp"] * parsed["num_microbatches"]
    if global_batch != MEGATRON_TASK["global_batch"]:
        raise AssertionError(f"--global-batch-size is {global_batch}: the layout trains another number of sequences "
                             "per optimizer step")


@functools.lru_cache(maxsize=None)
def _megatron_reference(settings: tuple) -> Any:
    """One process with the flags' model, seed, optimizer and global batch (``settings``: the
    parsed flags as sorted items, so that equal flags share one run)."""
    from dtlib.frameworks.megatron_core import run_megatron

    s = dict(settings)
    one = dict(s, tp=1, pp=1, dp=1, sequence_parallel=False, virtual_stages=1, batch_p2p_comm=False,
               num_microbatches=s["num_microbatches"] * s["dp"])
    return run_megatron(**one, steps=STEPS)


def check_megatron_run(megatron_flags: Callable) -> None:
    """Megatron-Core trains :data:`STEPS` steps on the flags' ranks, equal to one process with the
    same global batch within :data:`TOLERANCE`."""
    from dtlib.frameworks.common import compare
    from dtlib.frameworks.megatron_core import run_megatron_flags

    flags, parsed, _ = _flags(megatron_flags)
    if parsed["optimizer"] != "sgd":
        raise AssertionError(f"the run would use Megatron-LM's default optimizer, {parsed['optimizer']}: the layout "
                             "asks for plain SGD, whose steps one process repeats to rounding (Adam turns rounding "
                             "noise into whole steps)")
    try:
        run = run_megatron_flags(flags, MEGATRON_TASK["world_size"], STEPS)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"the Megatron-Core run failed: {first_line(e)}") from e
    reference = _megatron_reference(tuple(sorted(parsed.items())))
    _equal_to_one_process("Megatron-Core", compare(run, reference))


# ---------------------------------------------------------------- Q3: JAX PartitionSpecs

def _specs(partition_specs: Callable) -> tuple[dict, Any]:
    value = answer(partition_specs, "partition_specs")
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], dict)):
        raise AssertionError("partition_specs() must return (specs, batch_spec): a dict role -> spec and the "
                             "batch's spec")
    specs, batch = value
    specs = {role: list(spec) if isinstance(spec, tuple) else spec for role, spec in specs.items()}
    from dtlib.frameworks.jax_gspmd import ROLE_SHAPES, validate_layout
    missing = [role for role in ROLE_SHAPES if role not in specs]
    if missing:
        raise AssertionError(f"no spec for {', '.join(missing)}: give every role a spec (a list with one entry "
                             "per dim: None, an axis name or a list of axis names)")
    try:
        validate_layout(dict(JAX_TASK["mesh"]), specs, batch)
    except ValueError as e:
        raise AssertionError(str(e)) from None
    return specs, batch


def _axes(entry: Any) -> list[str]:
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def _dims_with(spec: list, axis: str) -> list[int]:
    return [d for d, entry in enumerate(spec) if axis in _axes(entry)]


def check_jax_tensor_parallel(partition_specs: Callable) -> None:
    """The ``model`` axis splits the four matrices of a block as Megatron splits them, and nothing
    else: column-parallel layers their output features, row-parallel ones their input features."""
    specs, _ = _specs(partition_specs)
    from dtlib.frameworks.jax_gspmd import ROLE_SHAPES
    for role in _COLUMN + _ROW:
        dims = _dims_with(specs[role], "model")
        if not dims:
            raise AssertionError(f"{role} is not split over 'model': tensor parallelism splits every matrix of the "
                                 "attention and the MLP over the model axis")
        kind, right = ("column", 1) if role in _COLUMN else ("row", 0)
        if dims != [right]:
            (name, _size) = ROLE_SHAPES[role][dims[0]]
            raise AssertionError(
                f"{role} splits its {name} dimension over 'model', the wrong dimension for a {kind}-parallel layer: "
                "XLA still computes the right numbers, but inserts an all_gather or all_reduce around it that "
                "Megatron's split avoids (look at which features the next matrix needs whole)")
    for role, spec in specs.items():
        if role not in _COLUMN + _ROW and _dims_with(spec, "model"):
            raise AssertionError(f"{role} is split over 'model': in this layout tensor parallelism splits only the "
                                 "attention and MLP matrices; the other weights are sharded by fsdp alone")


def check_jax_fsdp(partition_specs: Callable) -> None:
    """Every weight is sharded over ``fsdp`` (ZeRO-3: each device holds a quarter) and the batch is
    split over ``fsdp`` (each device computes its own sequences)."""
    specs, batch = _specs(partition_specs)
    whole = [role for role, spec in specs.items() if not _dims_with(spec, "fsdp")]
    if whole:
        raise AssertionError(f"{', '.join(whole)} {'is' if len(whole) == 1 else 'are'} not sharded over 'fsdp': "
                             "FSDP shards every weight, so each device stores only its part of each")
    if batch is None or _dims_with(list(batch), "fsdp") != [0]:
        raise AssertionError("the batch's sequences are not split over 'fsdp': in FSDP each device of the fsdp axis "
                             "trains on its own part of the global batch (the fsdp axis is a data-parallel axis)")
    if _dims_with(list(batch), "model"):
        raise AssertionError("the batch is split over 'model': the ranks of one tensor-parallel group must see "
                             "the same sequences")


@functools.lru_cache(maxsize=None)
def _jax_reference() -> Any:
    from dtlib.frameworks.jax_gspmd import reference_run
    return reference_run(STEPS)


def check_jax_run(partition_specs: Callable) -> Any:
    """GSPMD on 8 host devices with these specs trains :data:`STEPS` steps equal to the unsharded
    run; returns the run (the collectives XLA inserted are in its ``collectives``)."""
    from dtlib.frameworks.common import compare
    from dtlib.frameworks.jax_gspmd import run_jax

    specs, batch = _specs(partition_specs)
    try:
        run = run_jax(dict(JAX_TASK["mesh"]), specs, batch, STEPS)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"the JAX run failed: {first_line(e)}") from e
    _equal_to_one_process("JAX", compare(run, _jax_reference()))
    return run


# ---------------------------------------------------------------- Q4: the flag a config silently drops

# The plan whose emitted Megatron-LM flags lose some model flags: Llama 3 8B (rope base 500,000,
# trained without dropout) on dp 8 x tp 2 with sequence parallelism.
SILENT_TASK = {"model": "llama3-8b", "dp": 8, "tp": 2, "micro_batch_size": 1, "global_batch": 64,
               "precision": "bf16"}
# Model flags whose absence Megatron-LM accepts and fills with its own default (rotary base 10000,
# dropouts 0.1: megatron/training/arguments.py at core_v0.16.1, dtlib.frameworks.megatron_args).
_DROPPED = ("--rotary-base", "--hidden-dropout", "--attention-dropout")
# what a learner should compare each dropped flag with (a pointer, never the value)
_WHERE = {"--rotary-base": "the preset's rope_theta (dtlib.analytic.presets.get_preset)",
          "--hidden-dropout": "what the plan counts (dtlib plan has no dropout masks unless --dropout)",
          "--attention-dropout": "what the plan counts (dtlib plan has no dropout masks unless --dropout)"}


@functools.lru_cache(maxsize=None)
def _emitted_flags() -> tuple[str, ...]:
    """The flags ``dtlib plan --emit megatron`` writes for :data:`SILENT_TASK` (the emitter's own)."""
    from dtlib.analytic.layout import Parallelism
    from dtlib.analytic.presets import get_preset
    from dtlib.plan.emit import emit

    t = SILENT_TASK
    layout = Parallelism(dp=t["dp"], tp=t["tp"], sequence_parallel=True, micro_batch_size=t["micro_batch_size"],
                         num_microbatches=t["global_batch"] // (t["dp"] * t["micro_batch_size"]))
    return tuple(emit("megatron", layout, get_preset(t["model"]), t["global_batch"], t["precision"]).data)


def _needed() -> dict[str, str]:
    """Each dropped flag and the value the emitter wrote for it."""
    flags = list(_emitted_flags())
    return {f: flags[flags.index(f) + 1] for f in _DROPPED}


def broken_megatron_flags() -> list[str]:
    """:func:`_emitted_flags` without the flags of :data:`_DROPPED` (and their values): Megatron-LM
    accepts this list and builds a model with the planned parameter count, but not the planned model."""
    flags, out = list(_emitted_flags()), []
    i = 0
    while i < len(flags):
        if flags[i] in _DROPPED:
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return out


def _silent(silent_changes: Callable) -> dict[str, Any]:
    value = answer(silent_changes, "silent_changes")
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise AssertionError("silent_changes() must return a dict such as {'--some-flag': value}: each flag the "
                             "config should have written, with the value the plan needs")
    return value


def check_silent_flags(silent_changes: Callable) -> None:
    """The flags named are exactly those whose absence lets Megatron-LM's default change the model."""
    from dtlib.frameworks.megatron_args import record

    named, known, broken = _silent(silent_changes), record()["flags"], broken_megatron_flags()
    for flag in named:
        if flag not in known:
            raise AssertionError(f"{flag} is not a Megatron-LM flag (its argument list at {record()['tag']}, "
                                 "dtlib.frameworks.megatron_args.record()): name flags as pretrain_gpt.py reads them")
        if flag in broken:
            raise AssertionError(f"{flag} is in the config already, and a written flag is read as written: look "
                                 "for a model field the config does not write at all")
        if flag not in _DROPPED:
            raise AssertionError(f"{flag} is absent, but its default does not change this plan's model: compare "
                                 "Megatron-LM's default with what the plan needs before naming a flag")
    found = len(set(named) & set(_DROPPED))
    if found < len(_DROPPED):
        raise AssertionError(f"{found} of the {len(_DROPPED)} flags whose default silently changes the model are "
                             "named: compare every model field of the preset, and what the plan counts, with "
                             "Megatron-LM's default for the flags that are missing")


def check_silent_values(silent_changes: Callable) -> None:
    """Each named flag's value is the one the plan needs (the emitter's), compared as numbers."""
    named, needed = _silent(silent_changes), _needed()
    for flag in (f for f in _DROPPED if f in named):
        try:
            value = float(named[flag])
        except (TypeError, ValueError):
            raise AssertionError(f"{flag}: {named[flag]!r} is not a number; Megatron-LM reads a number "
                                 "there") from None
        if value != float(needed[flag]):
            raise AssertionError(f"{flag} {named[flag]} is not what the plan needs: read {_WHERE[flag]}")
    if not any(f in named for f in _DROPPED):
        raise AssertionError("none of the flags named is one whose default changes the model: find them first "
                             "(the check above)")
