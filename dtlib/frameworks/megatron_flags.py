"""Megatron-LM's command line, read as ``pretrain_gpt.py`` reads it, and run on CPU ranks.

:func:`parse_megatron_flags` turns flags such as ``--tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 1
--global-batch-size 4`` into :func:`~dtlib.frameworks.megatron_core.run_megatron`'s keyword
arguments. It refuses what Megatron-LM refuses, with one line naming the flag, following
``megatron/training/arguments.py`` (``validate_args``; NVIDIA/Megatron-LM main at commit d98e8a6,
August 2026) and Megatron-Core 0.16.1's ``num_microbatches_calculator.py``:

* the world size must be a multiple of tp x pp x cp ("world size is not divisible by
  total_model_size"); dp = world size / (tp x pp x cp);
* the global batch (default: micro-batch x dp) must be a multiple of micro-batch x dp, and the
  quotient is the number of micro-batches ("global batch size is not divisible by micro batch size
  times data parallel size");
* the layers must divide by pp, the layers per stage by ``--num-layers-per-virtual-pipeline-stage``
  (which gives the virtual stages; 1 means no interleaving), and the interleaved schedule needs
  pp > 2, or pp > 1 with p2p overlap (the default; ``--no-overlap-p2p-communication`` turns it
  off). Megatron-LM's reason: with pp = 2 both neighbours are the same rank, and a batched p2p call
  would carry two sends to the same peer -- the ``batch_p2p_comm`` pitfall that
  :func:`~dtlib.frameworks.megatron_core.run_megatron` shows on gloo;
* ``--overlap-param-gather`` needs ``--use-distributed-optimizer`` and ``--overlap-grad-reduce``;
  ``--recompute-method`` is refused with ``--recompute-granularity selective``;
* ``--sequence-parallel`` with tp = 1 is *ignored with a warning*, as Megatron-LM does ("Disabling
  sequence parallelism because tensor model parallelism is disabled"); Megatron-Core's own
  ``ModelParallelConfig`` raises instead, and so does ``run_megatron``.

:func:`megatron_configs` then builds Megatron-Core's own ``TransformerConfig`` and
``DistributedDataParallelConfig`` from the flags, so Megatron's classes check them too;
:func:`~dtlib.frameworks.megatron_core.run_megatron_flags` parses and runs them.
"""
from __future__ import annotations

import difflib

import shlex
import warnings
from typing import Any

from dtlib.analytic import validate
from dtlib.launcher import resolve_backend

__all__ = ["parse_megatron_flags", "megatron_configs", "check_settings",
           "transformer_config", "ddp_config", "VALUE_FLAGS", "SWITCH_FLAGS", "MODELS", "OPTIMIZERS",
           "MAX_RANKS"]

MODELS = ("gpt", "mlp")
OPTIMIZERS = ("sgd", "adam")
MAX_RANKS = 8  # CPU ranks on one machine (a 2-core machine runs 4 comfortably)

# flags taking a value: flag -> (type, default); the model-size defaults are dtlib's tiny GPT
VALUE_FLAGS: dict[str, tuple[type, Any]] = {
    "--tensor-model-parallel-size": (int, 1),
    "--pipeline-model-parallel-size": (int, 1),
    "--context-parallel-size": (int, 1),
    "--num-layers-per-virtual-pipeline-stage": (int, None),
    "--micro-batch-size": (int, 1),
    "--global-batch-size": (int, None),
    "--num-layers": (int, 4),
    "--hidden-size": (int, 32),
    "--num-attention-heads": (int, 4),
    "--seq-length": (int, 16),
    "--max-position-embeddings": (int, None),
    "--vocab-size": (int, 64),
    "--recompute-granularity": (str, None),
    "--recompute-method": (str, None),
    "--recompute-num-layers": (int, None),
    "--optimizer": (str, "adam"),
    "--seed": (int, 1234),
}
# switches: flag -> (attribute, value when given)
SWITCH_FLAGS: dict[str, tuple[str, bool]] = {
    "--sequence-parallel": ("sequence_parallel", True),
    "--use-distributed-optimizer": ("use_distributed_optimizer", True),
    "--overlap-grad-reduce": ("overlap_grad_reduce", True),
    "--overlap-param-gather": ("overlap_param_gather", True),
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", False),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", True),
}
_CHOICES = {"--recompute-granularity": ("full", "selective"), "--recompute-method": ("uniform", "block"),
            "--optimizer": ("adam", "sgd")}


def _attr(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _tokens(flags: str | list[str]) -> list[str]:
    if isinstance(flags, str):
        return shlex.split(flags)
    if isinstance(flags, (list, tuple)) and all(isinstance(f, str) for f in flags):
        return list(flags)
    raise ValueError(f"flags must be a string or a list of strings, got {flags!r}")


def _read(flags: str | list[str]) -> dict[str, Any]:
    """The flags as Megatron-LM's argparse would store them (defaults filled in)."""
    args: dict[str, Any] = {_attr(f): default for f, (_, default) in VALUE_FLAGS.items()}
    args.update({attr: not value for attr, value in SWITCH_FLAGS.values()})
    tokens = _tokens(flags)
    i = 0
    while i < len(tokens):
        flag, _, inline = tokens[i].partition("=")
        if flag in SWITCH_FLAGS:
            if inline:
                raise ValueError(f"{flag} is a switch and takes no value, got {tokens[i]!r}")
            attr, value = SWITCH_FLAGS[flag]
            args[attr] = value
        elif flag in VALUE_FLAGS:
            kind = VALUE_FLAGS[flag][0]
            if not inline:
                i += 1
                if i == len(tokens) or tokens[i].startswith("--"):
                    raise ValueError(f"{flag} needs a value")
                inline = tokens[i]
            try:
                value = kind(inline)
            except ValueError:
                raise ValueError(f"{flag} must be an integer, got {inline!r}") from None
            if flag in _CHOICES and value not in _CHOICES[flag]:
                raise ValueError(f"{flag} must be one of {', '.join(_CHOICES[flag])}, got {value!r}")
            least = 0 if flag == "--seed" else 1
            if kind is int and value < least:
                raise ValueError(f"{flag} must be an integer >= {least}, got {value}")
            args[_attr(flag)] = value
        else:
            close = difflib.get_close_matches(flag, [*VALUE_FLAGS, *SWITCH_FLAGS], n=1, cutoff=0.6)
            guess = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"unknown or unsupported Megatron-LM flag {flag!r}{guess}; the flags dtlib runs are "
                             f"dtlib.frameworks.megatron_flags.VALUE_FLAGS and SWITCH_FLAGS")
        i += 1
    return args


def parse_megatron_flags(flags: str | list[str], world_size: int) -> dict[str, Any]:
    """``run_megatron``'s keyword arguments for Megatron-LM ``flags`` on ``world_size`` ranks,
    after Megatron-LM's own checks (module docstring); a refused combination raises ``ValueError``
    naming the flag. ``--optimizer`` defaults to Adam, as in Megatron-LM."""
    validate.integer("world_size", world_size)
    a = _read(flags)
    tp, pp = a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"]
    cp = a["context_parallel_size"]
    model_size = tp * pp * cp
    if world_size % model_size:
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
                         f"--context-parallel-size {cp} = {model_size} must divide the world size "
                         f"{world_size} (Megatron-LM: world size is not divisible by total_model_size)")
    dp = world_size // model_size
    mbs = a["micro_batch_size"]
    global_batch = a["global_batch_size"] or mbs * dp  # Megatron-LM's default
    if global_batch % (mbs * dp):
        raise ValueError(f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size "
                         f"{mbs} x data-parallel size {dp} = {mbs * dp} (Megatron-Core: global batch "
                         f"size is not divisible by micro batch size times data parallel size)")
    layers = a["num_layers"]
    if layers % pp:
        raise ValueError(f"--num-layers {layers} must be divisible by --pipeline-model-parallel-size "
                         f"{pp} (Megatron-LM)")
    virtual_stages = 1
    per_chunk = a["num_layers_per_virtual_pipeline_stage"]
    if per_chunk is not None:
        if (layers // pp) % per_chunk:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} must divide the "
                             f"{layers // pp} layers per pipeline stage (--num-layers {layers} / "
                             f"--pipeline-model-parallel-size {pp}; Megatron-LM)")
        virtual_stages = layers // pp // per_chunk
    if virtual_stages > 1:
        least = 2 if a["overlap_p2p_comm"] else 3
        if pp < least:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage (interleaved schedule) needs "
                f"--pipeline-model-parallel-size >= {least}, got {pp}"
                + ("" if a["overlap_p2p_comm"] else " with --no-overlap-p2p-communication (Megatron-LM: "
                   "two p2p sends to the same rank in one batch)"))
    if a["overlap_param_gather"] and not (a["use_distributed_optimizer"] and a["overlap_grad_reduce"]):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer and "
                         "--overlap-grad-reduce (Megatron-LM)")
    if a["recompute_granularity"] == "selective" and a["recompute_method"] is not None:
        raise ValueError("--recompute-method is not supported with --recompute-granularity selective "
                         "(Megatron-LM)")
    sequence_parallel = a["sequence_parallel"]
    if sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel ignored: it needs --tensor-model-parallel-size > 1 "
                      "(Megatron-LM disables it the same way)", stacklevel=2)
        sequence_parallel = False
    if (a["max_position_embeddings"] or a["seq_length"]) < a["seq_length"]:
        raise ValueError(f"--max-position-embeddings {a['max_position_embeddings']} must be >= "
                         f"--seq-length {a['seq_length']}")
    return dict(tp=tp, pp=pp, dp=dp, context_parallel_size=cp, sequence_parallel=sequence_parallel,
                virtual_stages=virtual_stages, micro_batch_size=mbs,
                num_microbatches=global_batch // (mbs * dp), batch_p2p_comm=not a["overlap_p2p_comm"],
                seed=a["seed"], num_layers=layers, hidden_size=a["hidden_size"],
                num_attention_heads=a["num_attention_heads"], seq_length=a["seq_length"],
                vocab_size=a["vocab_size"], optimizer=a["optimizer"],
                use_distributed_optimizer=a["use_distributed_optimizer"],
                overlap_grad_reduce=a["overlap_grad_reduce"],
                overlap_param_gather=a["overlap_param_gather"],
                recompute_granularity=a["recompute_granularity"],
                recompute_method=a["recompute_method"], recompute_num_layers=a["recompute_num_layers"],
                untie_embeddings_and_output_weights=a["untie_embeddings_and_output_weights"])


def check_settings(s: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the argument for settings ``run_megatron`` cannot run, before
    any process starts: dtlib's layout rules (:func:`dtlib.analytic.layout.check_layout`: sizes,
    head/FFN/sequence divisibility, the interleaved schedule's needs), then Megatron-Core's."""
    from dtlib.analytic.layout import check_layout

    validate.one_of("model", s["model"], MODELS)
    validate.one_of("optimizer", s["optimizer"], OPTIMIZERS)
    for name in ("sequence_parallel", "batch_p2p_comm", "use_distributed_optimizer",
                 "overlap_grad_reduce", "overlap_param_gather", "untie_embeddings_and_output_weights"):
        validate.boolean(name, s[name])
    for name in ("steps", "context_parallel_size"):
        validate.integer(name, s[name])
    validate.integer("seed", s["seed"], minimum=0)
    validate.one_of("recompute_granularity", s["recompute_granularity"], (None, "full", "selective"))
    validate.one_of("recompute_method", s["recompute_method"], (None, "uniform", "block"))
    if s["recompute_num_layers"] is not None:
        validate.integer("recompute_num_layers", s["recompute_num_layers"])
    interleaved = isinstance(s["virtual_stages"], int) and s["virtual_stages"] > 1
    check_layout({"tp": s["tp"], "pp": s["pp"], "dp": s["dp"], "cp": 1,
                  "virtual_stages": s["virtual_stages"], "micro_batch_size": s["micro_batch_size"],
                  "num_microbatches": s["num_microbatches"], "layers": s["num_layers"],
                  "hidden": s["hidden_size"], "heads": s["num_attention_heads"],
                  "ffn": 4 * s["hidden_size"], "vocab": s["vocab_size"], "seq": s["seq_length"],
                  "sequence_parallel": s["sequence_parallel"]},
                 schedule="interleaved" if interleaved else "1f1b")
    world = s["tp"] * s["pp"] * s["dp"]
    if world > MAX_RANKS:
        raise ValueError(f"tp x pp x dp = {world} ranks; at most {MAX_RANKS} run on one machine")
    if s["sequence_parallel"] and s["tp"] == 1:
        raise ValueError("sequence_parallel=True needs tp > 1 (Megatron-Core's ModelParallelConfig: "
                         "Cannot use sequence parallelism without tensor parallelism)")
    if s["num_layers"] % (s["pp"] * s["virtual_stages"]):
        raise ValueError(f"num_layers ({s['num_layers']}) must be divisible by pp x virtual_stages = "
                         f"{s['pp'] * s['virtual_stages']} (Megatron-Core splits layers evenly)")
    if s["model"] == "gpt" and s["vocab_size"] % s["tp"]:
        raise ValueError(f"vocab_size ({s['vocab_size']}) must be divisible by tp={s['tp']} "
                         f"(VocabParallelEmbedding; Megatron-LM pads the vocabulary to a multiple)")
    if s["model"] == "mlp" and s["pp"] * s["virtual_stages"] > 1:
        raise ValueError("model='mlp' is one block: it runs with pp=1 and virtual_stages=1")
    if s["context_parallel_size"] > 1:
        raise ValueError(f"context_parallel_size={s['context_parallel_size']}: Megatron-Core's context "
                         "parallelism needs Transformer Engine's attention (TEDotProductAttention); "
                         "the local-spec GPTModel runs only context_parallel_size=1")
    if s["overlap_param_gather"] and not (s["use_distributed_optimizer"] and s["overlap_grad_reduce"]):
        raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True and "
                         "overlap_grad_reduce=True (Megatron-LM)")
    if s["use_distributed_optimizer"] and resolve_backend("auto", world) != "nccl":
        raise ValueError(f"use_distributed_optimizer=True needs one GPU per rank ({world}): Megatron-Core's "
                         "DistributedOptimizer accepts only torch.cuda tensors (distrib_optimizer.py)")
    if s["use_distributed_optimizer"] and s["optimizer"] != "adam":
        raise ValueError("use_distributed_optimizer=True needs optimizer='adam' (Megatron-Core's "
                         "DistributedOptimizer: only Adam currently supported)")


def transformer_config(s: dict[str, Any]) -> Any:
    """Megatron-Core's ``TransformerConfig`` for settings ``s``: fp32, dropout 0 (runs then differ
    only by their math, never by random numbers), the CPU settings of
    :data:`~dtlib.frameworks.megatron_cpu.CPU_CONFIG` where there is no GPU. Megatron validates it."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from dtlib.frameworks.megatron_cpu import CPU_CONFIG, needs_cpu_shims

    cpu = {name: value for name, (value, _) in CPU_CONFIG.items()} if needs_cpu_shims() else {}
    full = s["recompute_granularity"] == "full"
    return TransformerConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"], hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
        context_parallel_size=s["context_parallel_size"],
        virtual_pipeline_model_parallel_size=s["virtual_stages"] if s["virtual_stages"] > 1 else None,
        sequence_parallel=s["sequence_parallel"], pipeline_dtype=torch.float32,
        batch_p2p_comm=s["batch_p2p_comm"], recompute_granularity=s["recompute_granularity"],
        recompute_method=s["recompute_method"] or ("uniform" if full else None),
        recompute_num_layers=s["recompute_num_layers"] or (1 if full else None), **cpu)


def ddp_config(s: dict[str, Any]) -> Any:
    """Megatron-Core's ``DistributedDataParallelConfig`` for settings ``s``."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(use_distributed_optimizer=s["use_distributed_optimizer"],
                                         overlap_grad_reduce=s["overlap_grad_reduce"],
                                         overlap_param_gather=s["overlap_param_gather"])


def megatron_configs(flags: str | list[str], world_size: int) -> tuple[Any, Any]:
    """Megatron-Core's ``(TransformerConfig, DistributedDataParallelConfig)`` for ``flags`` on
    ``world_size`` ranks, built by Megatron's own classes, which refuse what they cannot run
    (e.g. attention heads not divisible by the tensor-parallel size)."""
    s = parse_megatron_flags(flags, world_size)
    return transformer_config(s), ddp_config(s)
