"""``dtlib flops``: FLOPs per step, MFU and HFU (:func:`dtlib.analytic.flops.flops_report`)."""
from __future__ import annotations

import argparse
from typing import Any

from dtlib.analytic.flops import ATTENTION, flops_report
from dtlib.analytic.hardware import COMPUTE_DTYPES
from dtlib.cli.args import (checked_layout, emit, finetune_args, finetune_from_args, layout_args, model_args,
                            model_from_args, packed_from_args, packed_note, packing_args, positive_int, seconds, table,
                            training_defaults)

__all__ = ["add_flops_command", "run_flops"]


def add_flops_command(sub: Any) -> None:
    p = sub.add_parser("flops", help="FLOPs per step, MFU and HFU")
    model_args(p), layout_args(p), finetune_args(p), packing_args(p)
    p.add_argument("--batch", type=positive_int,
                   help="global batch in sequences (default dp*micro_batch_size*num_microbatches)")
    p.add_argument("--step-time", type=seconds, help="measured seconds per step (gives MFU/HFU)")
    p.add_argument("--attention-flops", choices=ATTENTION, default="full")
    p.add_argument("--no-logits", action="store_true", help="leave out the vocabulary projection")
    p.add_argument("--dtype", "--precision", dest="dtype", choices=COMPUTE_DTYPES + ("nvfp4",), default="bf16",
                   help="peak to compare with (nvfp4: the FP4 peak of a Blackwell GPU, NVIDIA's NVFP4 recipe)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_flops)


def run_flops(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    assumed = training_defaults(args, model)
    layout = checked_layout(args, model)
    packed = packed_from_args(args, model)
    r = flops_report(model, layout.global_batch if args.batch is None else args.batch, seq=args.seq,
                     step_time=args.step_time, gpus=layout.gpus if args.gpus is None else args.gpus,
                     gpu=args.gpu,
                     dtype=args.dtype, recompute=args.recompute, attention=args.attention_flops,
                     count_logits=not args.no_logits, finetune=finetune_from_args(args),
                     packed_doc_length=packed, packed_flops=args.packed_flops)
    rows = [("parameters (total)", f"{r['parameters']:,.0f}"),
            ("parameters (active per token)", f"{r['active_parameters']:,.0f}"),
            *([("parameters (trained: LoRA adapters)", f"{r['trainable_parameters']:,.0f}")]
              if "trainable_parameters" in r else []),
            ("tokens per step", f"{r['tokens_per_step']:,}"),
            ("FLOPs per token (train)", f"{r['flops_per_token']:.4g}"),
            ("model FLOPs per step", f"{r['model_flops_per_step']:.4g}"),
            ("hardware FLOPs per step", f"{r['hardware_flops_per_step']:.4g}"),
            (f"peak per GPU ({r['gpu']}, {r['dtype']})", f"{r['peak_flops_per_gpu']:.4g} FLOP/s"),
            ("step time at 100% MFU", f"{r['ideal_step_time']:.4g} s")]
    if "mfu" in r:
        rows += [("MFU", f"{100 * r['mfu']:.1f} %"), ("HFU", f"{100 * r['hfu']:.1f} %")]
    assumed = (assumed + [f"fine-tuning: {r['conventions']['finetune']}"] * ("trainable_parameters" in r)
               + packed_note(packed, args.packed_flops))
    r["notes"] = assumed
    return emit(args, r, "\n".join([table(rows, f"FLOPs: {r['model']} on {r['gpus']} GPUs")] + assumed))
