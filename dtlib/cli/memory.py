"""``dtlib memory``: bytes on the most loaded GPU (:func:`dtlib.analytic.memory.memory_per_gpu`)."""
from __future__ import annotations

import argparse
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import get_gpu, matmul_peak
from dtlib.analytic.memory import memory_per_gpu
from dtlib.cli.args import (checked_layout, conventions_from_args, emit, finetune_args, finetune_from_args,
                            format_gib, layout_args, model_args, model_from_args, packed_from_args, packed_note,
                            packing_args, parse_count, parse_size, precision_args, precision_from_args,
                            recompute_detail_args, table)

__all__ = ["add_memory_command", "run_memory"]


_MEMORY_DESCRIPTION = """\
Bytes on the most loaded GPU: parameters, gradients, optimizer states, activations, temporary
buffers and overhead.

Activations follow Korthikanti et al. 2022 (Sec. 4), counted for today's training by default,
for every model: FlashAttention-style attention, which never stores the s x s scores (the
footprint of their selective recompute), and no dropout. --convention korthikanti-2022 restores
the paper's GPT counting (explicit attention storing the scores, dropout masks everywhere);
--no-flash-attention and --dropout change one of the two. --stack says what the framework's
kernels store (dtlib.analytic.stacks: fused SwiGLU, FP8 copies of GEMM inputs with --precision fp8;
NVFP4 copies of GEMM inputs and of the layers' weights with --precision nvfp4)
and, unless --precision/--convention say otherwise, its bytes per parameter: the same counting as
dtlib plan. The output says what was assumed.
"""


def add_memory_command(sub: Any) -> None:
    p = sub.add_parser("memory", help="memory per GPU (most loaded GPU)",
                       description=_MEMORY_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p), layout_args(p), precision_args(p, activations=True), finetune_args(p), packing_args(p, flops=False)
    recompute_detail_args(p.add_argument_group("what the layout keeps (docs/stacks.md)"))
    p.add_argument("--largest-layer", type=parse_count,
                   help="ZeRO-3 gather unit in parameters, e.g. 32M (needed with --params: a bare "
                        "count has no layers, so the gather buffer is 0 without it)")
    p.add_argument("--overhead", type=parse_size, default=0.0, help="framework overhead bytes, e.g. 2GiB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    matmuls = args.precision if args.precision in ("fp8", "nvfp4") else "bf16"
    if matmuls == "nvfp4":
        matmul_peak(get_gpu(args.gpu), matmuls)  # a GPU without NVFP4 tensor cores says so here
    layout = checked_layout(args, model)
    packed = packed_from_args(args, model)
    m = memory_per_gpu(model, layout, precision=precision_from_args(args), gpu=args.gpu,
                       gpus=args.gpus, seq=args.seq, dropout=args.dropout, flash_attention=args.flash_attention,
                       convention=conventions_from_args(args)[0], stack=args.stack,
                       dtype=matmuls,
                       largest_layer_params=args.largest_layer, overhead_bytes=args.overhead,
                       finetune=finetune_from_args(args))
    if layout.zero == 3 and not isinstance(model, TransformerConfig) and args.largest_layer is None:
        m.notes.append("temporary: the ZeRO-3 gather buffer is counted as 0 because a bare parameter "
                       "count has no layer sizes; give --largest-layer N (DeepSpeed budgets 4 bytes x "
                       "the largest layer's parameters) or a model shape")
    m.notes += [note + ": memory unchanged (FlashAttention keeps no s x s scores, packed or not; explicit attention "
                "computes and keeps all s x s under the documents' block-diagonal mask)" for note in packed_note(packed)]
    rows = [(k, format_gib(v)) for k, v in m.to_dict()["per_gpu"].items()]
    rows += [("offloaded to CPU", format_gib(m.cpu)), (f"{m.gpu.name} memory", format_gib(m.gpu.memory_bytes)),
             ("fits", "yes" if m.fits else "NO")]
    # "pipeline stage", 0-based: next to zero= a bare "stage 3" reads like a ZeRO stage
    split = ("; layers placed by a layout string" if layout.pipeline_layout else
             "".join(f"; {name} stage {n} layers" for name, n in (("first", layout.first_stage_layers),
                                                                    ("last", layout.last_stage_layers)) if n))
    where = (f"most loaded: pipeline stage {m.stage} of 0-{layout.pp - 1} (every stage evaluated{split}); "
             if layout.pp > 1 else "")
    partial = f" recompute_layers={layout.recompute_layers}" if layout.recompute_layers is not None else ""
    partial += f" recompute_modules={','.join(layout.recompute_modules)}" if layout.recompute_modules else ""
    title = (f"memory per GPU ({where}dp={layout.dp} tp={layout.tp} pp={layout.pp} "
             f"cp={layout.cp} zero={layout.zero} recompute={layout.recompute}{partial} stack={args.stack})")
    return emit(args, m.to_dict(), table(rows, title) + "\n" + "\n".join(m.notes))
