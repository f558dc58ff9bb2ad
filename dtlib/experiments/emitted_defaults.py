"""What an emitted Megatron-LM config says that Megatron-LM would not do by itself (lesson 13, §4).

A flag list is a diff against Megatron-LM's defaults: every flag left out runs at the default of
``megatron/training/arguments.py`` (recorded at ``core_v0.16.1`` by
:mod:`dtlib.frameworks.megatron_args`). :func:`off_default` lists the flags of a config whose value
is not that default, i.e. exactly what a shorter, "naive" config would silently change;
:func:`dtlib_parameters_per_rank` is dtlib's count for the rank Megatron-Core builds, so that the two
can be compared (the vocabulary padded as Megatron-LM pads it).
"""
from __future__ import annotations

from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism

__all__ = ["off_default", "dtlib_parameters_per_rank"]


def off_default(flags: list[str], only: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """``{flag: (value in flags, Megatron-LM's default)}`` for each flag of ``flags`` whose value
    Megatron-LM reads otherwise when the flag is absent (``only``: restrict to these flags)."""
    from dtlib.frameworks.megatron_args import parse_args, record

    table, given = record()["flags"], parse_args(flags)
    out = {}
    for flag in flags:
        if not flag.startswith("--") or flag in out or (only and flag not in only):
            continue
        dest = table[flag]["dest"]
        if given[dest] != table[flag]["default"]:
            out[flag] = (given[dest], table[flag]["default"])
    return out


def dtlib_parameters_per_rank(model: TransformerConfig, layout: Parallelism, stage: str = "first",
                              make_vocab_size_divisible_by: int = 128) -> int:
    """dtlib's parameters on one rank of the ``stage`` ("first" or "last" pipeline stage) before
    any ZeRO sharding, the vocabulary padded to a multiple of ``make_vocab_size_divisible_by`` x tp
    as Megatron-LM pads it (``megatron/training/tokenizer``'s ``_vocab_size_with_padding``)."""
    from dtlib.analytic.memory import stage_parameters
    from dtlib.frameworks.megatron_args import padded_vocab_size

    if stage not in ("first", "last"):
        raise ValueError(f"stage must be 'first' or 'last', got {stage!r}")
    padded = model.with_(vocab=padded_vocab_size(model.vocab, layout.tp, make_vocab_size_divisible_by))
    s = stage_parameters(**layout.numbers(**padded.numbers()))[stage]
    return int(s["dense"] + s["expert"])
