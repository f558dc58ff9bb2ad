"""``dtlib plan``: search the layouts of a model on a cluster, predict step time, MFU, memory,
days, dollars, energy and failures (:mod:`dtlib.plan`).

Layout flags pin a knob of the search; giving all of them evaluates one configuration. ``--json``
prints ``{"configs": [...], "searched", "search_seconds", "training", "why"}``, each config with its
error ``band`` (:mod:`dtlib.plan.uncertainty`: step time and throughput, or why none); nothing fitting
in memory prints why (the smallest memory found and what to change) and exits 1. Bad input,
including pinned flags that no valid layout has: one line on stderr, exit 2 (:func:`dtlib.cli.main`).

About 550 lines, as every subcommand here: its flags, the report dict (the JSON) and the text printed
from that dict. The planning itself lives in :mod:`dtlib.plan`; what is left is one command's surface.
"""
from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.flops import ATTENTION
from dtlib.analytic.hardware import ACCELERATORS, LINKS, SYSTEMS, cluster, get_link, matmul_peak
from dtlib.analytic.layout import RECOMPUTE_OPTIONS, SCHEDULES
from dtlib.analytic.memory import stack_storage
from dtlib.analytic.precision import GRAD_REDUCE_DTYPES, get_precision, grad_reduce_dtype
from dtlib.analytic.presets import activation_convention
from dtlib.analytic.stacks import FP8_RECIPES, MOE_DISPATCHERS
from dtlib.analytic.units import GiB
from dtlib.cli.args import (PRECISION_HELP, bounded_float, convention_args, conventions_from_args, finetune_args,
                            finetune_from_args, gpu_name, model_args, model_from_args, non_negative_int,
                            packed_from_args, packed_note, packing_args, parse_count,
                            positive_int, precision_choice,
                            recompute_detail_args, system_name)
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, efficiency_source
from dtlib.plan.gemm import clock_scale
from dtlib.frameworks.rehearse import rehearsal_lines, rehearse_all
from dtlib.plan.emit import (FILENAMES, FRAMEWORK_STACKS, FRAMEWORKS, TimedPlan, check_emit_options, emit_all,
                             emitted_lines)
from dtlib.plan.measured import (attention_efficiency, calibrated_cluster, counted_forward_kernels,
                                 counted_zero3_kernels, load_profile, profile_sources)
from dtlib.plan.moe import check_imbalance, moe_numbers
from dtlib.plan.search import search, to_layout
from dtlib.plan.segments import segments
from dtlib.analytic.stacks import DEFAULT_STACK, get_stack
from dtlib.plan.steptime import DTYPES, TERMS, StepOptions, resolve
from dtlib.plan.vocab_parallel import CROSS_ENTROPY_ALL_REDUCES
from dtlib.plan.training import DEFAULT_PRICE_PER_GPU_HOUR, DEFAULT_PUE, PRICE_RANGE, training_plan
from dtlib.plan.uncertainty import METHODS, band, percent_band, rescale

__all__ = ["add_plan_command", "run_plan", "plan_report"]


INF = float("inf")
_fraction = bounded_float("a number in (0, 1]", lambda v: 0 < v <= 1)
_overlap = bounded_float("a number in [0, 1]", lambda v: 0 <= v <= 1)
_at_least_one = bounded_float("a finite number >= 1", lambda v: 1 <= v < INF)
_price = bounded_float("dollars > 0, e.g. 2.5", lambda v: 0 < v < INF)
_watts = bounded_float("watts > 0, e.g. 500", lambda v: 0 < v < INF)


def _link_name(text: str) -> str:
    try:
        return get_link(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_plan_command(sub: Any) -> None:

    p = sub.add_parser("plan", help="search layouts: step time, MFU, memory, days, cost, failures",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p)
    finetune_args(p)
    packing_args(p)
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=positive_int, required=True, help="total GPUs")
    c.add_argument("--system", type=system_name, metavar="NAME",
                   help=f"a whole system: GPU, NVLink domain, links and NICs; one of {', '.join(SYSTEMS)} "
                        "(--gpu, --gpus-per-node, --inter-link override its parts)")
    c.add_argument("--gpu", type=gpu_name, help=f"one of {', '.join(ACCELERATORS)} (default h100-sxm, or the system's)")
    c.add_argument("--gpus-per-node", type=positive_int,
                   help="GPUs per NVLink domain: 8 for DGX/HGX, 72 for an NVL72 rack (default 8, or the system's)")
    c.add_argument("--inter-link", type=_link_name,
                   help=f"one NIC per GPU, one of {', '.join(LINKS)} (default ib-ndr, or the system's)")
    c.add_argument("--oversubscription", type=_at_least_one, default=1.0,
                   help="fabric oversubscription above the leaf (bandwidth across nodes / it)")
    b = p.add_argument_group("batch and precision")
    b.add_argument("--global-batch", type=positive_int, required=True, help="sequences per step")
    b.add_argument("--precision", type=precision_choice(DTYPES), default="bf16",
                   metavar="{" + ",".join(DTYPES) + "}",
                   help="matmul precision of the linear layers; attention and the LM head stay in bf16; nvfp4: "
                        "NVIDIA's NVFP4 recipe at the FP4 peak (Blackwell GPUs); " + PRECISION_HELP)
    b.add_argument("--bf16-layers", type=non_negative_int, default=0, metavar="N",
                   help="with fp8 or nvfp4: transformer layers kept in BF16 (Megatron --first-last-layers-bf16, "
                        "start + end layers; default 0 as Megatron's)")
    b.add_argument("--attention-flops", choices=ATTENTION, default="full")
    g = p.add_argument_group("layout (each pins the search; all of them = one configuration)")
    for name in ("tp", "pp", "dp", "cp", "ep", "virtual-stages"):
        g.add_argument(f"--{name}", type=positive_int)
    g.add_argument("--etp", type=positive_int, metavar="T",
                   help="expert tensor parallel size (Megatron-Core --expert-tensor-parallel-size)")
    g.add_argument("--micro-batch", dest="micro_batch_size", type=positive_int)
    g.add_argument("--schedule", choices=SCHEDULES,
                   help="pin the pipeline schedule (searched: 1f1b and interleaved; 'dualpipe': DeepSeek-V3's "
                        "bidirectional schedule, even --pp and an even number of micro-batches >= 2 x pp)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    g.add_argument("--recompute", choices=RECOMPUTE_OPTIONS,
                   help="pin the recompute setting ('op': torchtitan's per-op checkpointing, never searched)")
    recompute_detail_args(g)
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    m = p.add_argument_group("model of the step (flags left out take the --stack's value)")
    convention_args(m)
    m.add_argument("--efficiency", type=_fraction,
                   help="one flat fraction of peak instead of the shape-aware compute model")
    m.add_argument("--gemm-efficiency", type=_fraction,
                   help=f"GEMM kernel efficiency of the compute model (default {GEMM_EFFICIENCY}, fitted)")
    m.add_argument("--attention-efficiency", type=_fraction,
                   help=f"FlashAttention efficiency: its time at the BF16 peak and the special-function units' "
                        f"exponential rate over its real time (default {ATTENTION_EFFICIENCY}, fitted)")
    m.add_argument("--power-limit", type=_watts, default=None, metavar="WATTS",
                   help="GPU power cap; below the TDP the clock scales as (cap/TDP)^(1/3)")
    m.add_argument("--dp-overlap", type=_overlap, help="DP communication hidden by compute")
    m.add_argument("--tp-overlap", type=_overlap,
                   help="TP communication hidden by the GEMMs (never more than their time); megatron's 1 is "
                        "Megatron-Bridge's recipes (tp_comm_overlap=True), Megatron-Core's own default is 0")
    m.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES,
                   help="dtype the DP gradients are kept and reduced in (default: the --stack's: megatron bf16, "
                        "Megatron-Core DistributedDataParallelConfig.grad_reduce_in_fp32=False; Megatron-LM's "
                        "script and NeMo reduce in fp32)")
    m.add_argument("--cp-overlap", type=_overlap, help="CP communication hidden by compute")
    m.add_argument("--ep-overlap", type=_overlap, metavar="FRACTION",
                   help="MoE: EP all-to-all hidden by compute (DualPipe, Megatron "
                        "--overlap-moe-expert-parallel-comm; default 0, exposed)")
    m.add_argument("--moe-imbalance", type=_at_least_one, metavar="X",
                   help="MoE, dropless routing: the busiest expert's tokens over the mean, 1 (balanced, "
                        "the default) to experts / top_k")
    m.add_argument("--moe-dispatcher", choices=MOE_DISPATCHERS, default=None,
                   help="MoE: alltoall (Megatron-Core's MoEAlltoAllTokenDispatcher, the router probabilities in an "
                        "all-to-all of their own) or flex (DeepEP / HybridEP carry them with the tokens); default: "
                        "the --stack's")
    m.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help="FP8 scaling recipe (with --precision fp8): the kernels a per-expert GEMM loop launches "
                        "for each expert (default: the --stack's)")
    m.add_argument("--fused-elementwise", action=argparse.BooleanOptionalAction, default=None,
                   help="memory-bound operators fused (Megatron/TE, torch.compile) or eager")
    m.add_argument("--grad-accumulation-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="weight-gradient GEMMs accumulate into the gradient buffer (Megatron; default) or, with "
                        "--no-grad-accumulation-fusion, each micro-batch after the first adds into .grad (eager PyTorch)")
    m.add_argument("--grad-bucket-copy", action="store_true",
                   help="gradients copied into a flat bucket and back around the reduce (PyTorch DDP's default, "
                        "dtlib train) instead of reduced in place (Megatron-Core's gradient buffer)")
    m.add_argument("--zero3-reduce-per-microbatch", action="store_true",
                   help="ZeRO-3 reduce-scatters after every micro-batch's backward (PyTorch FSDP without no_sync, "
                        "dtlib train) instead of once per step")
    m.add_argument("--zero3-unit-copies", action="store_true",
                   help="ZeRO-3 copies each gather's output out param-major and the gradients rank-major before "
                        "each reduce-scatter (dtlib train's FSDP) instead of gathering and reducing in place "
                        "(Megatron-Core's FSDP); with --calibration, also the operators its FSDP adds per layer, "
                        "as the profile counted them")
    m.add_argument("--cross-entropy-all-reduces", type=int, choices=CROSS_ENTROPY_ALL_REDUCES, default=3,
                   help="all-reduces of the vocabulary-parallel loss under TP: 3 (Megatron-Core's, the default) or 2 "
                        "(its --cross-entropy-loss-fusion, dtlib train)")
    m.add_argument("--headroom", type=_fraction, default=0.9, help="fraction of GPU memory a layout may use")
    m.add_argument("--band-method", choices=METHODS, default="quantile",
                   help="error band from the comparable runs' held-out residuals: their central --band-coverage "
                        "quantiles, or their min-max (docs/validation.md, 'The error band')")
    m.add_argument("--band-coverage", type=_fraction, default=0.8,
                   help="with --band-method quantile: the central fraction of residuals the band spans (0.8: "
                        "10th-90th percentiles)")
    k = p.add_argument_group("calibration (dtlib calibrate)")
    k.add_argument("--calibration", metavar="FILE",
                   help="a profile written by dtlib calibrate: the measured machine replaces --gpu/--system "
                        "(its ranks per node, GEMM seconds by shape, attention, elementwise bandwidth and "
                        "collectives' busbw per message size replace the catalogue's peaks and the fitted "
                        "efficiencies); the plan says which figures came from it")
    t = p.add_argument_group("training plan")
    t.add_argument("--tokens", type=parse_count, help="token budget, e.g. 1T or 2e12")
    t.add_argument("--price-per-gpu-hour", type=_price, default=DEFAULT_PRICE_PER_GPU_HOUR,
                   help=f"dollars (default {DEFAULT_PRICE_PER_GPU_HOUR}; H100 rental 2025-26: "
                        f"{PRICE_RANGE[0]}-{PRICE_RANGE[1]})")
    t.add_argument("--pue", type=_at_least_one, default=DEFAULT_PUE)
    t.add_argument("--top", type=positive_int, default=5)
    t.add_argument("--json", action="store_true")
    e = p.add_argument_group("framework configs of the top layout (or of the one the layout flags pin)")
    e.add_argument("--emit", type=_frameworks, action="extend", metavar="FRAMEWORK",
                   help=f"write its launch config, repeatable or a comma list: {', '.join(FRAMEWORKS)}")
    e.add_argument("--emit-dir", metavar="DIR", help="also write each config to DIR (" +
                   ", ".join(FILENAMES.values()) + ")")
    e.add_argument("--rehearse", action="store_true",
                   help="run each emitted layout, shrunk to <= 8 CPU ranks, under its framework vs one process")
    # no --stack: the first --emit framework's stack (so the printed run is the emitted one), else megatron
    p.set_defaults(run=run_plan, stack=None)


def _frameworks(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",")]
    bad = [n for n in names if n not in FRAMEWORKS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown framework {bad[0]!r}; valid: {', '.join(FRAMEWORKS)}")
    return names


def _check_moe_flags(args: argparse.Namespace, model: TransformerConfig) -> None:
    """``--ep-overlap`` and ``--moe-imbalance`` need an MoE model, ``--moe-imbalance`` dropless routing
    (a capacity factor sets the load itself) and at most experts / top_k
    (:func:`dtlib.plan.moe.check_imbalance`): checked before the search starts."""
    given = [flag for flag, key in (("--ep-overlap", "ep_overlap"), ("--moe-imbalance", "moe_imbalance"))
             if getattr(args, key) is not None]
    if given and not model.moe_experts:
        raise ValueError(f"{given[0]} applies to MoE models; {model.name} is dense (set --experts >= 2 "
                         f"and --top-k for MoE)")
    if args.moe_imbalance is None:
        return
    if model.moe_capacity_factor:
        raise ValueError(f"--moe-imbalance sets the busiest expert's load under dropless routing, but "
                         f"{model.name} caps it at capacity factor {model.moe_capacity_factor:g}; "
                         f"give --dropless (and no --capacity-factor) to route without a cap")
    check_imbalance(moe_numbers(model.numbers()), args.moe_imbalance)


def _plan_stack(args: argparse.Namespace) -> str:
    """``--stack``, else the stack of the first ``--emit`` framework that has one (dtlib.analytic.stacks),
    else the default; a ``--stack`` another than an emitted framework runs is refused."""
    emitted = [(f, FRAMEWORK_STACKS[f]) for f in args.emit or [] if FRAMEWORK_STACKS[f]]
    for framework, stack in emitted:
        if args.stack and args.stack != stack:
            raise ValueError(f"--stack {args.stack} contradicts --emit {framework}: {framework} runs as dtlib's "
                             f"{stack} stack; drop --stack (the plan then times {stack}) or give --stack {stack}")
    return args.stack or (emitted[0][1] if emitted else DEFAULT_STACK)


def _framework_configs(args: argparse.Namespace, model: TransformerConfig, best: dict[str, Any],
                       options: StepOptions, cl: Any) -> dict[str, Any]:
    """``--emit``: the configs of the best layout as it was timed (written to ``--emit-dir``) and
    ``--rehearse``'s numerics runs and full-size measurement. Where the first framework runs it
    otherwise, ``best`` takes the re-timed numbers (key ``retimed``: that framework's lines), so the
    printed step is the emitted run's."""
    timing = {k: best[k] for k in ("step_time_s", "tokens_per_s", "mfu", "memory_per_gpu_bytes", "breakdown")}
    plan = TimedPlan(to_layout(best), model, args.global_batch, options, args.precision, cl, args.dropout, timing)
    emitted = emit_all(args.emit, plan, args.emit_dir)
    first = emitted[args.emit[0]]
    if first["retimed"] and first["timing"]:
        best.update(first["timing"], retimed={"framework": args.emit[0], "why": first["retimed"],
                                              "timed": timing})
        best["band"] = rescale(best["band"], timing["step_time_s"], best["step_time_s"], best["tokens_per_s"])
    if not args.rehearse:
        return {"emitted": emitted}
    from dtlib.frameworks.fullsize import rehearse_full_size  # torch: the course extra

    layout = to_layout(best)
    out = {"emitted": emitted}
    if "megatron" in emitted and not emitted["megatron"]["unsupported"]:  # before the fake world of fullsize
        from dtlib.frameworks.megatron_meta import model_state_on_rank

        precision = resolve(options)[0].precision
        out["megatron_meta"] = model_state_on_rank(emitted["megatron"]["data"], model, layout,
                                                   precision if isinstance(precision, str) else precision.name)
    return out | {"fullsize": rehearse_full_size(model, layout),
                  "rehearsals": rehearse_all(emitted, layout, args.precision, model=model)}


def _calibration(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--calibration``'s profile (:func:`dtlib.plan.measured.load_profile`), or None; the flags
    that describe another machine or replace the measured figures are refused with it."""
    if args.calibration is None:
        return None
    clash = [flag for flag, key in (("--gpu", "gpu"), ("--system", "system"), ("--gpus-per-node", "gpus_per_node"),
                                    ("--inter-link", "inter_link"), ("--efficiency", "efficiency"),
                                    ("--gemm-efficiency", "gemm_efficiency"), ("--power-limit", "power_limit"))
             if getattr(args, key) is not None]
    if clash:
        raise ValueError(f"{clash[0]} contradicts --calibration: the profile is the machine and its measured "
                         f"figures; drop {clash[0]} (or --calibration)")
    return load_profile(args.calibration)


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON document of ``dtlib plan`` (see the module docstring)."""

    check_emit_options(args.emit, args.emit_dir, args.rehearse)
    if args.rehearse and args.precision == "nvfp4":  # the CPU rehearsal has no NVFP4 kernels
        raise ValueError("--rehearse runs the emitted layout on CPU ranks, which have no NVFP4 kernels; "
                         "rehearse the --precision bf16 plan of the same layout")
    if args.bf16_layers and args.precision not in ("fp8", "nvfp4"):
        raise ValueError(f"--bf16-layers keeps layers in BF16 under --precision fp8 or nvfp4; with "
                         f"--precision {args.precision} every layer is already {args.precision}")
    model = model_from_args(args)
    if not isinstance(model, TransformerConfig):
        raise ValueError("plan needs a model shape (--model PRESET or --layers/--hidden/--heads), not --params")
    if args.seq is not None:
        model = model.with_(seq=args.seq)
    profile = _calibration(args)
    g = (calibrated_cluster(profile).gpus_per_node if profile else
         cluster(args.gpu, 1, args.gpus_per_node, system=args.system).gpus_per_node)
    placed = segments(args.gpus, g)
    nodes, per_node = placed.domains, placed.gpus_per_domain
    cl = (calibrated_cluster(profile, nodes, per_node) if profile else
          cluster(args.gpu, nodes, per_node, inter=args.inter_link, system=args.system))
    if profile and args.attention_efficiency is None:
        args.attention_efficiency = attention_efficiency(profile)
    _check_moe_flags(args, model)
    activation, named_precision = conventions_from_args(args)
    moe = {k: getattr(args, k) for k in ("ep_overlap", "moe_imbalance") if getattr(args, k) is not None}
    options = StepOptions(stack=_plan_stack(args), dtype=args.precision, efficiency=args.efficiency,
                          attention=args.attention_flops, packed_flops=args.packed_flops, dp_overlap=args.dp_overlap, tp_overlap=args.tp_overlap,
                          cp_overlap=args.cp_overlap, fused_elementwise=args.fused_elementwise,
                          oversubscription=args.oversubscription, precision=named_precision,
                          flash_attention=args.flash_attention, convention=activation,
                          gemm_efficiency=args.gemm_efficiency,
                          attention_efficiency=args.attention_efficiency, power_limit_w=args.power_limit,
                          fp8_recipe=args.fp8_recipe, moe_dispatcher=args.moe_dispatcher, bf16_layers=args.bf16_layers,
                          grad_reduce_dtype=args.grad_reduce_dtype,
                          grad_accumulation_fusion=args.grad_accumulation_fusion,
                          grad_bucket_copy=args.grad_bucket_copy,
                          zero3_reduce_per_microbatch=args.zero3_reduce_per_microbatch,
                          zero3_unit_copies=args.zero3_unit_copies,
                          cross_entropy_all_reduces=args.cross_entropy_all_reduces,
                          # eager: the kernels per layer the profile counted on dtlib train's model
                          forward_kernels=(counted_forward_kernels(profile, model) if profile and args.fused_elementwise is False
                                           else None),
                          # dtlib train's FSDP: the operators per layer the profile counted on it
                          zero3_kernels=(counted_zero3_kernels(profile, model) if profile and args.zero3_unit_copies
                                         else None), **moe)
    matmul_peak(cl.gpu, args.precision)  # a GPU without FP8 (or NVFP4) tensor cores says so here
    fixed = {k: getattr(args, k) for k in ("dp", "tp", "pp", "cp", "ep", "etp", "virtual_stages", "micro_batch_size",
                                           "schedule", "zero", "recompute", "sequence_parallel", "recompute_layers",
                                           "activation_offload_layers", "recompute_modules", "first_stage_layers",
                                           "last_stage_layers")
             if getattr(args, k) is not None}
    if args.pipeline_layout:
        fixed["pipeline_layout"] = args.pipeline_layout  # True: spread evenly; a string: that layout
    if args.account_for_embedding_and_loss:
        fixed["account_for_embedding_and_loss"] = True
    band_of = functools.partial(band, method=args.band_method, coverage=args.band_coverage)
    finetune = finetune_from_args(args)
    packed = packed_from_args(args, model)
    r = search(model, cl, args.global_batch, options=options, fixed=fixed, headroom=args.headroom,
               tp_within_node=args.tp is None or args.tp <= per_node, dropout=args.dropout, top=args.top,
               band_of=band_of, finetune=finetune, packed_doc_length=packed)
    if r.searched == 0:  # the pinned flags break a rule: bad input, not a result
        raise ValueError(r.why)
    frameworks = _framework_configs(args, model, r.configs[0], options, cl) if args.emit and r.configs else {}
    training = None
    if r.configs and args.tokens:
        best = r.configs[0]
        training = training_plan(tokens=args.tokens, tokens_per_step=best["tokens_per_s"] * best["step_time_s"],
                                 step_time=best["step_time_s"], gpus=args.gpus, gpus_per_node=per_node,
                                 gpu=cl.gpu.name, price_per_gpu_hour=args.price_per_gpu_hour,
                                 pue=args.pue).to_dict()
    clock = clock_scale(cl.gpu, args.power_limit)  # a GPU without a TDP in the catalogue says so here
    if profile:
        sources = profile_sources(profile, args.calibration)
        source = "calibrated: " + "; ".join(f"{k}: {v}" for k, v in sources.items())
    elif args.efficiency is not None:
        source = (f"--efficiency {args.efficiency:g}: hardware FLOPs / (peak x {args.efficiency:g}), "
                  f"Narayanan et al. 2021 eq. 3")
    else:
        gemm = GEMM_EFFICIENCY if args.gemm_efficiency is None else args.gemm_efficiency
        attention = ATTENTION_EFFICIENCY if args.attention_efficiency is None else args.attention_efficiency
        if args.gemm_efficiency is None and args.attention_efficiency is None:
            fitted = efficiency_source()
        else:
            fitted = (f"GEMM efficiency {gemm:.2f}{' (--gemm-efficiency)' if args.gemm_efficiency else ''}, "
                      f"FlashAttention efficiency {attention:.2f}"
                      f"{' (--attention-efficiency)' if args.attention_efficiency else ''}")
        source = (f"compute from GEMM shapes (tile/wave quantization on {cl.gpu.sms} SMs, roofline at "
                  f"{cl.gpu.memory_bandwidth / 1e12:g} TB/s; NVIDIA matmul guide), clock x{clock:.3f}"
                  f"{f' at {args.power_limit:g} W' if args.power_limit else ''}"
                  f"{' (the clock it sustains, docs/hardware.md)' if cl.gpu.sustained_clock < 1 else ''}; {fitted}")
    d = {"model": model.name, "parameters": model.num_parameters(), "experts": model.moe_experts, "gpus": args.gpus, "gpu": cl.gpu.name,
         "system": args.system, "gpus_per_node": per_node, "intra_link": cl.intra.name, "inter_link": cl.inter.name,
         "global_batch": args.global_batch, "seq": model.seq, "precision": args.precision,
         "configs": r.configs, "searched": r.searched,
         "fitting": r.fitting, "search_seconds": r.seconds, "training": training, "why": r.why,
         "efficiency": args.efficiency, "clock_scale": clock, "efficiency_source": source,
         "memory_capacity_bytes": r.capacity, "assumed": _assumed(options, args.dropout, packed),
         "finetune": finetune.describe(), "lora": finetune.lora,
         "placement": {"domains": placed.domains, "gpus_per_domain": placed.gpus_per_domain,
                       "domain_size": placed.domain_size, "text": placed.describe()},
         "caveats": ([MOE_CAVEAT] if model.moe_experts else [])
         + ([LORA_EMIT_CAVEAT] if finetune.lora and args.emit else [])
         + ([PACKED_EMIT_CAVEAT] if packed is not None and args.emit else []),
         "calibration": {"file": args.calibration, "dtype": profile["dtype"], "sources": sources} if profile else None}
    d.update(frameworks)
    return d


# what the validation says of MoE step times (docs/validation.md): printed under every MoE plan
MOE_CAVEAT = ("caveat: published mixture-of-experts runs are the planner's largest misses, most of them timed "
              "too fast (GPT-OSS; Qwen3 on Megatron-Core's alltoall dispatcher): read an MoE step time as a "
              "lower bound (docs/validation.md)")
LORA_EMIT_CAVEAT = ("caveat: the emitted framework configs train every weight; set up LoRA in the framework "
                    "(e.g. Megatron-Bridge's or PEFT's LoRA) with the same rank and targets")
PACKED_EMIT_CAVEAT = ("caveat: the emitted framework configs read unpacked sequences; pack the data in the framework "
                      "(NeMo / Megatron-Bridge packed_sequence_specs, Megatron-Core's THD format with cu_seqlens)")
_LEGEND = ("columns: dp tp pp cp ep: data, tensor, pipeline, context, expert parallel sizes; v: virtual stages per "
           "pipeline rank; mb: micro-batch size in sequences; m: micro-batches per step; zero: ZeRO stage; "
           "sp: sequence parallelism")
# MoE models add the etp column (Megatron-Core --expert-tensor-parallel-size), after ep
_LEGEND_ETP = "; etp: expert tensor parallel size (each expert's matrices split etp ways)"


def _assumed(options: StepOptions, dropout: bool | None, packed_doc_length: int | None = None) -> dict[str, Any]:
    """What the plan assumed: the stack and every option it filled, how activations were counted, and
    the packed documents' length (None: not packed) with what model FLOPs count of their attention."""
    filled, drop = resolve(options, dropout)
    stack = get_stack(filled.stack)
    _, note = activation_convention(options.convention, options.flash_attention, dropout)
    return {"stack": stack.name, "tp_overlap": filled.tp_overlap, "cp_overlap": filled.cp_overlap,
            "ep_overlap": filled.ep_overlap, "moe_imbalance": filled.moe_imbalance,
            "moe_dispatcher": filled.moe_dispatcher,
            "fp8_recipe": filled.fp8_recipe if filled.dtype == "fp8" else None,
            "bf16_layers": filled.bf16_layers if filled.dtype != "bf16" else None,
            "dp_overlap": filled.dp_overlap if filled.dp_overlap is not None
            else {"zero<3": stack.dp_overlap, "zero3": stack.dp_overlap_zero3},
            "fused_elementwise": filled.fused_elementwise, "attention_kernel": stack.attention_kernel,
            "precision": get_precision(filled.precision).name, "flash_attention": filled.flash_attention,
            "grad_reduce_dtype": grad_reduce_dtype(filled.precision),
            "grad_reduce_source": ("--grad-reduce-dtype" if options.grad_reduce_dtype else
                                   "the precision convention given" if options.precision is not None else
                                   stack.sources.get("grad_reduce", f"stack {stack.name}'s precision")),
            "tp_overlap_source": ("--tp-overlap" if options.tp_overlap is not None else
                                  stack.sources.get("tp_overlap", f"stack {stack.name}")),
            "dropout": drop, "activations": note[0] + "; " + stack_storage(stack, filled.dtype),
            "packed_doc_length": packed_doc_length, "packed_flops": filled.packed_flops,
            "packing": "; ".join(packed_note(packed_doc_length, filled.packed_flops))}


def _megatron_meta_lines(m: dict[str, Any]) -> list[str]:
    """``--rehearse``'s Megatron-Core line: the emitted flags' GPTModel counted on the meta device."""
    same = "equal" if m["parameters_megatron"] == m["parameters_dtlib"] else \
        f"{m['parameters_megatron'] - m['parameters_dtlib']:+,} against dtlib's"
    b = m["bytes"]
    optimizer = "left to dtlib memory (experts shard over their own group)" if b["optimizer"] is None \
        else f"{b['optimizer'] / GiB:.2f} GiB"
    return [f"Megatron-Core (meta device, the emitted flags): rank {m['rank']} holds {m['parameters_megatron']:,} "
            f"parameters, dtlib {m['parameters_dtlib']:,} ({same}); at {m['precision']} that is weights "
            f"{b['parameters'] / GiB:.2f} GiB, gradients {b['gradients'] / GiB:.2f} GiB, optimizer {optimizer}"]


def _clause(source: str) -> str:
    """A source's first clause, without the value it starts with ("bf16: X (where)" -> "X")."""
    return source.split(": ", 1)[-1].split(" (")[0].split(";")[0] if ": " in source[:6] else source.split(" (")[0]


def _text(d: dict[str, Any]) -> str:
    a = d["assumed"]
    moe = d["experts"] > 0
    moe_options = (f"EP overlap {a['ep_overlap']:g}, expert imbalance {a['moe_imbalance']:g}, "
                   f"{a['moe_dispatcher']} dispatcher, " if moe else "")
    if a["fp8_recipe"]:
        moe_options += f"FP8 recipe {a['fp8_recipe']}, "
    etp_head, etp_cells = (f" {'etp':>3}", lambda c: f" {c['etp']:>3}") if moe else ("", lambda c: "")
    system = f" ({d['system']})" if d.get("system") else ""
    calibrated = d.get("calibration")
    domain = "node (calibrated)" if calibrated else "NVLink domain"
    matmuls = f"{d['precision']} (timed as measured in {calibrated['dtype']})" if calibrated else d["precision"]
    lines = [f"{d['model']} ({d['parameters'] / 1e9:.2f}B) on {d['gpus']} x {d['gpu']}{system}, "
             f"{d['gpus_per_node']} per {domain} ({d['intra_link']}; {d['inter_link']} across), global batch "
             f"{d['global_batch']} sequences of {d['seq']:,} tokens, {matmuls} matmuls"
             f"{f' ({bf16} layers in bf16)' if (bf16 := a['bf16_layers']) else ''}, stack "
             f"{a['stack']}: {d['searched']:,} valid layouts, {d['fitting']:,} fit, searched in "
             f"{d['search_seconds']:.2f} s",
             d["placement"]["text"],
             f"stack {a['stack']}: TP overlap {a['tp_overlap']:g}, DP overlap {a['dp_overlap']}, CP overlap "
             f"{a['cp_overlap']:g}, {moe_options}attention {a['attention_kernel']}, "
             f"{'fused' if a['fused_elementwise'] else 'eager'} elementwise, precision {a['precision']} "
             f"(dtlib.analytic.stacks, docs/stacks.md)",
             f"assumed: grad reduce {a['grad_reduce_dtype']} ({_clause(a['grad_reduce_source'])}), TP overlap "
             f"{a['tp_overlap']:g} ({_clause(a['tp_overlap_source'])}); --grad-reduce-dtype, --tp-overlap change "
             f"them" + (f"; {a['packing']}" if a.get("packing") else ""), a["activations"],
             f"where the numbers come from: {d['efficiency_source']}; the other "
             f"terms: dtlib.plan.steptime.TERMS (docs/plan.md)"] + [f"training: {d['finetune']}"] * d["lora"]
    if d["why"]:
        return "\n".join(lines + [d["why"]])
    lines.append(_LEGEND + (_LEGEND_ETP if moe else ""))
    lines.append(f"{'#':>2} {'dp':>5} {'tp':>2} {'pp':>3} {'cp':>2} {'ep':>2}{etp_head} {'v':>2} {'mb':>2} {'m':>4} "
                 f"{'zero':>4} {'recompute':>9} {'sp':>3} {'step s':>8} {'tokens/s':>11} {'MFU':>6} {'GiB/GPU':>8} "
                 f"{'stage':>5}  split")
    for i, c in enumerate(d["configs"], 1):
        lines.append(f"{i:>2} {c['dp']:>5} {c['tp']:>2} {c['pp']:>3} {c['cp']:>2} {c['ep']:>2}{etp_cells(c)} "
                     f"{c['virtual_stages']:>2} {c['micro_batch']:>2} {c['microbatches']:>4} {c['zero']:>4} "
                     f"{c['recompute']:>9} {'yes' if c['sequence_parallel'] else 'no':>3} "
                     f"{sig3(c['step_time_s']):>8} {sig3(c['tokens_per_s']):>11} {100 * c['mfu']:>5.1f}% "
                     f"{c['memory_per_gpu_bytes'] / GiB:>8.1f} {c['memory_stage']:>5}  {split_label(c)}")
    lines.append(band_line(d["configs"][0]))
    pinned = sorted({c["schedule"] for c in d["configs"]} - {"1f1b", "interleaved"})
    if pinned:  # the table's v column tells 1F1B from interleaving, not these (--schedule)
        lines.append(f"schedule: {', '.join(pinned)} (pinned with --schedule)")
    again = d["configs"][0].get("retimed")
    if again:
        lines.append(f"#1 is the run the {again['framework']} config makes, re-timed (timed "
                     f"{again['timed']['step_time_s']:.3f} s, MFU {100 * again['timed']['mfu']:.1f}%): "
                     + "; ".join(again["why"]))
    lines.append("breakdown of the step (seconds):")
    lines.append("   " + " ".join(f"{k:>11}" for k in TERMS))
    for i, c in enumerate(d["configs"], 1):
        lines.append(f"{i:>2} " + " ".join(f"{c['breakdown'][k]:>11.4f}" for k in TERMS))
    t = d["training"]
    if t:
        band, step_s = d["configs"][0]["band"]["step_time_s"], d["configs"][0]["step_time_s"]
        days = (f"; {t['days'] * band['low'] / step_s:.3g} .. {t['days'] * band['high'] / step_s:.3g} days at the "
                f"error band" if band["covered"] else "")
        lines.append(f"training {t['tokens']:.3g} tokens with #1: {t['days']:.1f} days ({t['compute_days']:.1f} of "
                     f"compute / goodput {100 * t['goodput']:.1f}%{days}), {t['gpu_hours']:,.0f} GPU-hours, "
                     f"${t['cost_usd']:,.0f} at ${t['price_per_gpu_hour']:g}/GPU-hour, {t['energy_mwh']:,.0f} MWh "
                     f"(PUE {t['pue']:g}), {t['expected_failures']:.1f} failures expected (job MTBF "
                     f"{t['job_mtbf_hours']:.1f} h), checkpoint every {t['checkpoint_interval_s'] / 60:.0f} min")
    lines += emitted_lines(d.get("emitted", {}))
    if "fullsize" in d:
        from dtlib.frameworks.fullsize import fullsize_lines

        lines += fullsize_lines(d["fullsize"])
    if "megatron_meta" in d:
        lines += _megatron_meta_lines(d["megatron_meta"])
    lines += rehearsal_lines(d.get("rehearsals", {})) + d["caveats"]
    return "\n".join(lines)


def sig3(x: float) -> str:
    """``x`` to 3 significant figures, without an exponent: 0.0123, 1.23, 1,230,000 (the model is not
    more precise than that: docs/validation.md)."""
    return f"{float(f'{x:.3g}'):,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def band_line(c: dict[str, Any]) -> str:
    """The error band of a search row (:mod:`dtlib.plan.uncertainty`): ``error band: step 1.23 s (-8% .. +12%,
    14 runs: megatron, hopper, dense, ...), tokens/s 1,230,000 (1,100,000 .. 1,300,000)``, or why there is none."""
    step, tokens = c["band"]["step_time_s"], c["band"]["tokens_per_s"]
    if not step["covered"]:
        return (f"error band of #1: step {sig3(c['step_time_s'])} s, {percent_band(step, c['step_time_s'])}; "
                f"the validation does not cover this plan (docs/validation.md, 'The error band')")
    return (f"error band of #1 (leave-one-source-out residuals of comparable published runs, {step['method']}): "
            f"step {sig3(c['step_time_s'])} s ({percent_band(step, c['step_time_s'])}; {sig3(step['low'])} .. "
            f"{sig3(step['high'])} s), tokens/s {sig3(c['tokens_per_s'])} ({sig3(tokens['low'])} .. "
            f"{sig3(tokens['high'])}); the same relative band for every layout of this job")


def split_label(c: dict[str, Any]) -> str:
    """A search row's pipeline split in Megatron-LM's terms (dtlib.analytic.layout.split_problem)."""
    if c["pp"] == 1:
        return "-"
    if isinstance(c.get("pipeline_layout"), str):
        return c["pipeline_layout"]
    if c.get("pipeline_layout"):
        return "layout string"
    ends = [f"{name} {c[key]}" for name, key in (("first", "first_stage_layers"), ("last", "last_stage_layers"))
            if c.get(key)]
    return ", ".join(ends) if ends else "even"


def run_plan(args: argparse.Namespace) -> int:
    d = plan_report(args)
    print(json.dumps(d, indent=2, allow_nan=False) if args.json else _text(d))  # strict JSON: no NaN or inf
    failed = [r for r in d.get("rehearsals", {}).values() if r.get("passed") is False]
    return 1 if failed or not d["configs"] else 0
