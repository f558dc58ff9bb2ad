"""``dtlib calibrate``: measure this machine for a model and write the profile ``dtlib plan
--calibration`` reads (:mod:`dtlib.plan.calibrate`).

GEMMs on the model's own shapes (the planner's list for each --tp and --micro-batch), attention,
elementwise bandwidth and every collective's busbw per message size, on --nproc gloo ranks of this
CPU, or under torchrun on its GPUs (NCCL) and nodes:
  dtlib calibrate --nproc 2 --output calibration.json         # dtlib train's TinyGPT, 2 gloo ranks
  torchrun --nproc-per-node 8 -m dtlib calibrate --model llama3-8b --output h200.json     # 8 GPUs
The profile holds the machine, the versions, the date and every figure with its unit; --clock cpu
(the default on CPU ranks) times the ranks' CPU time, robust to other jobs' load; --statistic says
how each figure's repeats become one (default median).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from dtlib.analytic.presets import PRESETS, get_preset
from dtlib.analytic.timing import STATISTICS
from dtlib.cli.args import positive_int
from dtlib.outputs import check_output_file, write_atomically
from dtlib.plan.steptime import StepOptions

__all__ = ["add_calibrate_command", "run_calibrate", "calibration_text"]

_DTYPES = ("fp32", "bf16", "fp16")


def _int_list(text: str) -> list[int]:
    """A comma list of integers >= 1, e.g. ``1,2,4``."""
    return [positive_int(v) for v in text.split(",")]


def _preset(text: str) -> str:
    try:
        return get_preset(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_calibrate_command(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (GEMMs, attention, memory, collectives) into "
                                         "a profile for plan --calibration",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model whose GEMM shapes are timed (default: dtlib train's TinyGPT, same flags)")
    g.add_argument("--model", type=_preset, help=f"a preset instead: {', '.join(PRESETS)}")
    for name, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("vocab", 256), ("seq", 32)):
        g.add_argument(f"--{name}", type=positive_int, default=None, help=f"as dtlib train (default {default})")
    g.add_argument("--ffn", type=positive_int, help="as dtlib train (default 4 x hidden)")
    g.add_argument("--tp", type=_int_list, metavar="T,T", help="tensor-parallel sizes whose GEMM shapes are "
                   "timed (default 1 and every divisor of the ranks per node that divides the heads)")
    g.add_argument("--micro-batch", type=_int_list, default=[1, 2, 4], metavar="B,B",
                   help="micro-batch sizes whose GEMM shapes are timed (default 1,2,4)")
    g.add_argument("--dtype", choices=_DTYPES, help="precision of the GEMMs (default fp32 on CPU, bf16 on GPUs)")
    m = p.add_argument_group("measurement")
    m.add_argument("--nproc", type=positive_int, default=2,
                   help="gloo ranks started on this machine (ignored under torchrun); default 2")
    m.add_argument("--min-bytes", type=positive_int, default=1024, help="smallest message (default 1 KiB)")
    m.add_argument("--max-bytes", type=positive_int, default=16 * 2 ** 20, help="largest message (default 16 MiB)")
    m.add_argument("--factor", type=positive_int, default=4, help="message size step (default 4)")
    m.add_argument("--repeats", type=positive_int, default=7, help="timed calls per figure (default 7, >= 3)")
    m.add_argument("--statistic", choices=tuple(STATISTICS), default="median",
                   help="how a figure's repeats become one: median (default: the typical call), min (the least "
                        "disturbed call, Chen & Revels 2016: a profile that a loaded machine moves less, but a lower "
                        "bound that plans fast, docs/plan.md) or mean (nccl-tests')")
    m.add_argument("--clock", choices=("cpu", "wall"),
                   help="cpu: the ranks' CPU time, all threads (default on CPU: robust to other jobs' load); "
                        "wall: elapsed time (default on GPUs)")
    m.add_argument("--timeout", type=positive_int, default=600, help="seconds before the ranks are stopped")
    p.add_argument("--output", "-o", metavar="FILE", required=True, help="where to write the profile (JSON)")
    p.add_argument("--json", action="store_true", help="also print the profile")
    p.set_defaults(run=run_calibrate)


def _model(args: argparse.Namespace) -> Any:
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "ffn")
             if getattr(args, k) is not None}
    if args.model:
        if shape:
            raise ValueError(f"--model {args.model} fixes the shape; drop --{next(iter(shape))} "
                             "(or --model, for dtlib train's TinyGPT)")
        return get_preset(args.model)
    from dtlib.trainer import TrainConfig  # the trainer's model, exactly as dtlib train builds it

    return TrainConfig(**shape).model_config()


def calibration_text(profile: dict[str, Any], path: str) -> str:
    """What ``dtlib calibrate`` prints: the machine, and each kind of figure's range."""
    m = profile["machine"]
    rates = [r["flops_per_s"] for r in profile["gemm"]]
    lines = [f"{m['hostname']}: {m['gpu'] or m['cpu']}, {m['ranks']} {profile['backend']} ranks on {m['nodes']} "
             f"node(s), {profile['clock']} clock, {profile.get('statistic', 'median')} of {profile['repeats']}; "
             f"torch {profile['versions']['torch']}, dtlib {profile['versions']['dtlib']}, {profile['date']}",
             f"GEMMs ({profile['dtype']}, {len(rates)} shapes of {profile['model_config']['name']}): "
             f"{min(rates) / 1e9:,.1f} - {max(rates) / 1e9:,.1f} GFLOP/s",
             f"attention (causal, {profile['attention']['seq']} tokens): {1e3 * profile['attention']['seconds']:.3f} ms "
             f"forward + backward",
             f"elementwise: {profile['elementwise']['bytes_per_s'] / 1e9:.2f} GB/s at "
             f"{profile['elementwise']['bytes']:,} bytes"]
    if profile.get("kernel"):
        k = profile["kernel"]
        lines.append(f"kernel cost: {1e6 * k['seconds_per_kernel']:.3g} us per operator ({k['operators']} operators "
                     f"forward + backward in {1e3 * k['seconds']:.3f} ms)")
    step = profile.get("step")
    if step:
        rates = {key: f"{step[key] / 1e9:.3g} GB/s" if step.get(key) else "not told: the GEMMs take it all"
                 for key in ("bytes_per_s", "optimizer_bytes_per_s")}
        lines.append(f"one-rank step of {step['micro_batch_size']} sequences: forward + backward "
                     f"{1e3 * step['forward_backward_seconds']:.1f} ms (elementwise {rates['bytes_per_s']}), optimizer "
                     f"{1e3 * step['optimizer_seconds']:.1f} ms ({rates['optimizer_bytes_per_s']}); "
                     f"{step['layer_forward_kernels']} operators per layer forward"
                     + (f", {step['zero3_layer_kernels']} more per layer and micro-batch under ZeRO-3 "
                        "(dtlib.parallel.FSDP)" if step.get("zero3_layer_kernels") else ""))
    for where in ("intra", "inter"):
        section = profile.get(where)
        if not section:
            continue
        for op in dict.fromkeys(r["op"] for r in section["rows"]):
            rows = [r for r in section["rows"] if r["op"] == op]
            lines.append(f"{op} {where} ({section['ranks']} ranks): busbw "
                         + ", ".join(f"{r['bytes'] // 1024:,} KiB {r['busbw_bytes_per_s'] / 1e9:.3f}" for r in rows)
                         + " GB/s")
    lines.append(f"profile written to {path}")
    return "\n".join(lines)


def run_calibrate(args: argparse.Namespace) -> int:
    from dtlib.plan.calibrate import calibrate  # torch: only when measuring

    if args.repeats < 3:
        raise ValueError(f"--repeats must be an integer >= 3, got {args.repeats}")
    if args.max_bytes < args.min_bytes:
        raise ValueError(f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}")
    if args.factor < 2:
        raise ValueError(f"--factor must be an integer >= 2, got {args.factor}")
    model = _model(args)
    bad = [t for t in args.tp or [] if model.heads % t]
    if bad:
        raise ValueError(f"--tp {bad[0]} does not divide the model's {model.heads} heads")
    # checked, not created: a run that fails or is interrupted leaves no empty profile behind
    check_output_file("--output", args.output)
    # the shapes the plan will ask for: dtlib train's TinyGPT computes attention explicitly (its
    # batched GEMMs), a preset is planned with FlashAttention-style attention (the plan's default)
    options = StepOptions(flash_attention=bool(args.model))
    profile = calibrate(model, args.nproc, tp=args.tp, micro_batch=args.micro_batch, dtype=args.dtype,
                        options=options, measure_step=not args.model,
                        min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor,
                        repeats=args.repeats, clock=args.clock, statistic=args.statistic, timeout=args.timeout)
    if not profile:  # a torchrun rank other than 0
        return 0
    write_atomically(args.output, json.dumps(profile, indent=1))
    print(json.dumps(profile, indent=1) if args.json else calibration_text(profile, args.output))
    return 0
