"""Megatron-LM's command line as recorded from its own parser, and the launch rules of ``validate_args``.

:data:`RECORD` is ``data/megatron_args.json``, written by ``tools/megatron_args.py``: every flag
that Megatron-LM's ``add_megatron_arguments`` defines at tag ``core_v0.16.1`` (the release of the
installed megatron-core), with its destination, arity, type, choices and default, produced by that
parser itself (not copied by hand). :func:`parse_args` reads a flag list the way ``argparse`` would
with that parser (unknown flag, missing value, wrong type or choice: one line naming the flag) and
returns every destination with Megatron-LM's default where the flag is absent.
:func:`validate` then applies the rules of ``megatron/training/arguments.py``'s ``validate_args``
that the emitted flags touch, each citing its line at that tag (55ac7082).
"""
from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["RECORD", "record", "parse_args", "validate", "padded_vocab_size"]

RECORD = Path(__file__).with_name("data") / "megatron_args.json"


@cache
def record() -> dict[str, Any]:
    """The recorded parser: ``{"tag", "commit", "flags": {option: {...}}}``."""
    return json.loads(RECORD.read_text())


def _tuple_type(flag: str, text: str) -> tuple[int, ...]:  # arguments.py tuple_type: "a,b" -> (a, b)
    try:
        return tuple(int(v) for v in text.strip("()[] ").split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _moe_freq(flag: str, text: str) -> int | list[int]:
    """arguments.py ``moe_freq_type``: an integer (every N-th layer is MoE) or a Python list
    expression of 0/1 such as ``([0]*3+[1]*58)``, which Megatron-LM evaluates; only integers,
    brackets, commas, ``*`` and ``+`` are accepted here before evaluating."""
    if text.isdigit():
        return int(text)
    if not re.fullmatch(r"[\[\]()0-9,*+ ]+", text):
        raise ValueError(f"{flag} takes an integer or a list expression of 0/1, got {text!r}")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 -- characters checked above
    except SyntaxError:
        raise ValueError(f"{flag}: {text!r} is not a list expression") from None
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise ValueError(f"{flag} must be a list of 0/1, got {text!r}")
    return value


_TYPES = {"int": int, "float": float, "str": str, "tuple_type": _tuple_type, "moe_freq_type": _moe_freq}


def _convert(flag: str, spec: dict[str, Any], text: str) -> Any:
    kind = spec["type"]
    if kind in ("int", "float"):
        try:
            value = _TYPES[kind](text)
        except ValueError:
            raise ValueError(f"{flag} must be {'an integer' if kind == 'int' else 'a number'}, got {text!r}") from None
    elif kind in _TYPES and kind != "str":
        value = _TYPES[kind](flag, text)
    else:  # str, and the parser's own converters that dtlib never emits: the text itself
        value = text
    if spec["choices"] is not None and value not in spec["choices"]:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, spec['choices']))}, got {text!r}")
    return value


def parse_args(flags: list[str]) -> dict[str, Any]:
    """``flags`` read against the recorded parser: ``{dest: value}`` for every flag Megatron-LM
    defines, its default where absent. Raises ``ValueError`` naming the flag."""
    table = record()["flags"]
    args = {spec["dest"]: copy.deepcopy(spec["default"]) for spec in table.values()}  # callers may mutate
    i = 0
    while i < len(flags):
        flag = flags[i]
        spec = table.get(flag)
        if spec is None:
            raise ValueError(f"unknown Megatron-LM flag {flag!r} (not in add_megatron_arguments at {record()['tag']})")
        if spec["switch"]:
            args[spec["dest"]] = spec["const"]
            i += 1
            continue
        values = []
        j = i + 1
        while j < len(flags) and not (flags[j].startswith("--") and flags[j][2:3].isalpha()):
            values.append(flags[j])
            j += 1
        nargs = spec["nargs"]
        want = {None: (1, 1), "?": (0, 1), "+": (1, None), "*": (0, None)}.get(nargs, (nargs, nargs))
        if not values and want[0]:
            raise ValueError(f"{flag} needs a value")
        if len(values) < want[0] or (want[1] is not None and len(values) > want[1]):
            raise ValueError(f"{flag} takes {nargs or 1} value(s), got {len(values)}: {values}")
        converted = [_convert(flag, spec, v) for v in values]
        args[spec["dest"]] = converted if nargs in ("+", "*") or isinstance(nargs, int) else converted[0]
        i = j
    return args


def padded_vocab_size(vocab: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron-LM's vocabulary padding (``megatron/training/tokenizer``'s
    ``_vocab_size_with_padding``): up to a multiple of ``make_vocab_size_divisible_by x tp``."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab // multiple) * multiple


def validate(a: dict[str, Any], world_size: int) -> None:
    """The ``validate_args`` rules (arguments.py at core_v0.16.1, 55ac7082; line cited) that the
    emitted flags reach; raises ``ValueError`` with the flag and the line."""
    tp, pp, cp = a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"], a["context_parallel_size"]
    if world_size % (tp * pp * cp):  # initialize_model_parallel and validate_args' dp derivation
        raise ValueError(f"tp x pp x cp = {tp * pp * cp} must divide the world size {world_size} (Megatron-LM)")
    if a["num_layers"] is None:  # pretrain_gpt.py builds a decoder of --num-layers layers
        raise ValueError("--num-layers is required")
    layers = a["num_layers"] + bool(a["account_for_embedding_in_pipeline_split"]) \
        + bool(a["account_for_loss_in_pipeline_split"])
    uneven = a["decoder_first_pipeline_num_layers"] is not None or a["decoder_last_pipeline_num_layers"] is not None
    per_chunk, chunks_per_rank = a["num_layers_per_virtual_pipeline_stage"], a["num_virtual_stages_per_pipeline_rank"]
    layout = a["pipeline_model_parallel_layout"]
    if (per_chunk is not None) + (chunks_per_rank is not None) + (layout is not None) > 1:  # l. 503-514
        raise ValueError("give at most one of --num-layers-per-virtual-pipeline-stage, "
                         "--num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout (validate_args l. 503)")
    if layout is not None:  # l. 516-523: the layout's chunks, counted by Megatron-Core's own parser
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        chunks = PipelineParallelLayerLayout.get_num_stages_from_str(layout)
        if chunks % pp:
            raise ValueError(f"--pipeline-model-parallel-layout has {chunks} chunks, not a multiple of "
                             f"--pipeline-model-parallel-size {pp} (validate_args l. 519)")
        _validate_rest(a, tp)
        return
    if per_chunk is not None and uneven:  # l. 529-531
        raise ValueError("an uneven split (--decoder-first/last-pipeline-num-layers) takes interleaving as "
                         "--num-virtual-stages-per-pipeline-rank (validate_args l. 530)")
    if not uneven and layers % pp:  # l. 537-544 and 564-571
        raise ValueError(f"--num-layers {a['num_layers']} (+ accounted embedding/loss) = {layers} must be divisible by "
                         f"--pipeline-model-parallel-size {pp} (validate_args l. 570)")
    if per_chunk is not None and (layers // pp) % per_chunk:  # l. 547
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} must divide the {layers // pp} layers "
                         f"per pipeline stage (validate_args l. 547)")
    _validate_rest(a, tp)


def _validate_rest(a: dict[str, Any], tp: int) -> None:
    """The rules past the pipeline split (:func:`validate`)."""
    if a["overlap_param_gather"] and not ((a["use_distributed_optimizer"] or a["use_megatron_fsdp"])
                                          and a["overlap_grad_reduce"]):  # l. 597-600
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp, and "
                         "--overlap-grad-reduce (validate_args l. 597-600)")
    if a["recompute_granularity"] == "selective" and a["recompute_method"] is not None:  # l. 898
        raise ValueError("--recompute-method is not supported with --recompute-granularity selective "
                         "(validate_args l. 898)")
    if a["tp_comm_overlap"] and not (a["sequence_parallel"] and tp > 1):  # l. 905-916
        raise ValueError("--tp-comm-overlap needs --sequence-parallel with tp > 1 (validate_args l. 916)")
    ep = a["expert_model_parallel_size"]
    if ep > 1 and (a["num_experts"] is None or a["num_experts"] % ep):  # l. 1025-1028
        raise ValueError(f"--expert-model-parallel-size {ep} needs --num-experts a multiple of it "
                         f"(validate_args l. 1026-1027)")
    if a["multi_latent_attention"] and a["group_query_attention"]:  # l. 1265-1266
        raise ValueError("--multi-latent-attention excludes --group-query-attention (validate_args l. 1266)")
    if a["fp8_param_gather"] and not (a["use_distributed_optimizer"] or a["use_torch_fsdp2"]
                                      or a["use_megatron_fsdp"]):  # l. 655-657
        raise ValueError("--fp8-param-gather needs the distributed optimizer, torch FSDP2 or Megatron-FSDP "
                         "(validate_args l. 656)")
    if a["fp4"] and a["fp8"]:  # l. 660-661
        raise ValueError("--fp4-format and --fp8-format exclude each other (validate_args l. 661)")
    if a["fp8"] is not None and a["transformer_impl"] != "transformer_engine":  # FP8 GEMMs are TE's
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (Megatron-Core's FP8 "
                         "comes from Transformer Engine)")
