"""``dtlib memory``: bytes on the most loaded GPU (:func:`dtlib.analytic.memory.memory_per_gpu`)."""
from __future__ import annotations

import argparse
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.memory import memory_per_gpu
from dtlib.cli.args import (checked_layout, emit, format_gib, layout_args, model_args, model_from_args, parse_count,
                            parse_size, precision_args, precision_from_args, table, training_defaults)

__all__ = ["add_memory_command", "run_memory"]


_MEMORY_DESCRIPTION = """\
Bytes on the most loaded GPU: parameters, gradients, optimizer states, activations, temporary
buffers and overhead.

Activations follow Korthikanti et al. 2022 (Sec. 4). Their GPT convention is *explicit*
attention, which stores the s x s attention scores (softmax output, its dropout mask and the
dropped-out scores: the 5as/h term of Table 2), and dropout masks in every block. A preset is
counted as its model was trained (dtlib.analytic.presets.TRAINING): Llama models use a
FlashAttention-style kernel, which never stores the s^2 scores (the footprint of --recompute
selective), and no dropout. The output says what was assumed; --recompute none --dropout gives
the paper's GPT convention for any model.
"""


def add_memory_command(sub: Any) -> None:
    p = sub.add_parser("memory", help="memory per GPU (most loaded GPU)",
                       description=_MEMORY_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p), layout_args(p), precision_args(p)
    p.add_argument("--largest-layer", type=parse_count,
                   help="ZeRO-3 gather unit in parameters, e.g. 32M (needed with --params: a bare "
                        "count has no layers, so the gather buffer is 0 without it)")
    p.add_argument("--overhead", type=parse_size, default=0.0, help="framework overhead bytes, e.g. 2GiB")
    p.add_argument("--dropout", action=argparse.BooleanOptionalAction,
                   help="1-byte dropout masks as Korthikanti et al. count them (default: as the preset "
                        "was trained, e.g. none for Llama; with dropout for other models)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    assumed = training_defaults(args, model)
    layout = checked_layout(args, model)
    m = memory_per_gpu(model, layout, precision=precision_from_args(args), gpu=args.gpu,
                       gpus=args.gpus, seq=args.seq, dropout=args.dropout,
                       largest_layer_params=args.largest_layer, overhead_bytes=args.overhead)
    if layout.zero == 3 and not isinstance(model, TransformerConfig) and args.largest_layer is None:
        m.notes.append("temporary: the ZeRO-3 gather buffer is counted as 0 because a bare parameter "
                       "count has no layer sizes; give --largest-layer N (DeepSpeed budgets 4 bytes x "
                       "the largest layer's parameters) or a model shape")
    m.notes.extend(assumed)
    rows = [(k, format_gib(v)) for k, v in m.to_dict()["per_gpu"].items()]
    rows += [("offloaded to CPU", format_gib(m.cpu)), (f"{m.gpu.name} memory", format_gib(m.gpu.memory_bytes)),
             ("fits", "yes" if m.fits else "NO")]
    # "pipeline stage", 0-based: next to zero= a bare "stage 3" reads like a ZeRO stage
    where = f"most loaded: pipeline stage {m.stage} of 0-{layout.pp - 1}; " if layout.pp > 1 else ""
    title = (f"memory per GPU ({where}dp={layout.dp} tp={layout.tp} pp={layout.pp} "
             f"cp={layout.cp} zero={layout.zero} recompute={layout.recompute})")
    return emit(args, m.to_dict(), table(rows, title) + "\n" + "\n".join(m.notes))
