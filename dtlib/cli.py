"""The ``dtlib`` command: ``dtlib memory|flops|comm|plan|train|checkpoint ...`` (``--json`` for machines).

Each subcommand is a small ``add_*_command(subparsers)`` that registers its options and a
``run(args) -> int``; :data:`COMMANDS` lists them, so more can be added without touching the rest.
Bad input prints one line on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Callable

import dtlib
from dtlib.analytic import validate
from dtlib.analytic.comm import (ALGORITHMS, COLLECTIVES, comm_report, flat_link, hierarchical_time,
                        strategy_volumes)
from dtlib.analytic.flops import ATTENTION, flops_report
from dtlib.analytic.hardware import ACCELERATORS, LINKS, cluster, get_link
from dtlib.analytic.memory import GiB, memory_per_gpu, resolve_model
from dtlib.analytic.config import ACTIVATIONS, TransformerConfig
from dtlib.analytic.layout import OFFLOAD, RECOMPUTE, SCHEDULES, Parallelism, broken_rules, check_layout
from dtlib.analytic.precision import CONVENTIONS, PRECISIONS, OPTIMIZERS, get_precision, precision
from dtlib.analytic.presets import GPT_CONVENTION, PRESETS, training_of
from dtlib.plan.command import add_plan_command

__all__ = ["main", "build_parser", "COMMANDS", "parse_size", "parse_count"]


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors become ValueError (one line, exit 2, like every bad input)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # "argument --tp: must be an integer >= 1, got '0'" -> "--tp must be ...": the wording of
        # dtlib.analytic.validate, with the flag where Python names the parameter
        message = re.sub(r"^argument (\S+): must be ", r"\1 must be ", message)
        raise ValueError(f"{message} (see '{self.prog} --help')")


# Python parameters whose flag is not "--" + name with "-" for "_" (see _flag).
_FLAGS = {"nbytes": "--bytes", "overhead_bytes": "--overhead", "largest_layer_params": "--largest-layer",
          "micro_batch_size": "--micro-batch", "num_microbatches": "--microbatches"}


def _flag(name: str) -> str:
    """The command-line flag of a Python parameter: ``step_time`` -> ``--step-time``."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_COUNTS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}  # 7B = 7 billion parameters


def _checked(check: Callable[[], Any], text: str) -> Any:
    """Run a :mod:`dtlib.analytic.validate` check for an argparse ``type``; argparse names the flag."""
    try:
        return check()
    except validate.InvalidArgument as exc:
        raise argparse.ArgumentTypeError(f"must be {exc.requirement}, got {text!r}") from None


def _parse(text: str, units: dict[str, float], example: str, positive: bool = False) -> float:
    """A finite number with a unit; never negative, and > 0 when ``positive``."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text), re.IGNORECASE)
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write e.g. {example}")
    try:
        value = float(m.group(1)) * units[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write e.g. {example}") from None
    return _checked(lambda: validate.number("value", value, minimum=0, exclusive=positive), text)


def parse_size(text: str) -> float:
    """Bytes >= 0: ``"1e9"``, ``"512MiB"``, ``"4GB"``."""
    return _parse(text, _BYTES, "1e9, 512MiB, 4GB")


def parse_count(text: str) -> float:
    """A count >= 0: ``"7e9"``, ``"7B"`` (billions), ``"350M"``."""
    return _parse(text, _COUNTS, "7e9, 7B, 350M")


def _parameter_count(text: str) -> float:
    """``--params``: a count > 0."""
    return _parse(text, _COUNTS, "7e9, 7B, 350M", positive=True)


def _seconds(text: str) -> float:
    """``--step-time``: seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write seconds, e.g. 1.5") from None
    return _checked(lambda: validate.number("value", value), text)


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, widths): checked here, before any division by it."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = str(text)  # not an integer: validate says what is expected
    return _checked(lambda: validate.integer("value", value), text)


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--params -7B`` -> ``--params=-7B``: argparse takes a value starting with '-' for an
    option unless it looks like a plain number, so a negative size would be reported as a
    missing argument instead of a negative one."""
    out: list[str] = []
    for tok in argv:
        if out and re.match(r"^-\.?[0-9]", tok) and re.fullmatch(r"--[a-z][a-z0-9-]*", out[-1]):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


# ---- shared options -------------------------------------------------------------------------------
def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (one of --model, --params, or --layers/--hidden/--heads)")
    g.add_argument("preset", nargs="?", metavar="MODEL", help="a preset, as --model")
    g.add_argument("--model", help=f"preset name, one of: {', '.join(PRESETS)}")
    g.add_argument("--params", type=_parameter_count, help="bare parameter count, e.g. 7e9 or 7B")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn"):
        g.add_argument(f"--{name}", type=positive_int)
    g.add_argument("--vocab", type=positive_int, default=None,
                   help="vocabulary (default 50257 for a custom shape)")
    g.add_argument("--activation", choices=ACTIVATIONS, help="MLP activation of a custom shape (default gelu)")
    g.add_argument("--seq", type=positive_int, help="sequence length (default: the model's; 2048 for a custom shape)")


def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--gpus", type=positive_int, help="total GPUs (default dp*tp*pp*cp)")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(ACCELERATORS)}")
    for name in ("tp", "pp", "cp", "ep"):
        g.add_argument(f"--{name}", type=positive_int, default=1)
    g.add_argument("--dp", type=positive_int, help="data parallel size (default gpus/(tp*pp*cp))")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    g.add_argument("--recompute", choices=RECOMPUTE,
                   help="activation recomputation (Korthikanti et al. 2022); 'selective' drops the "
                        "s^2 attention terms, which is also FlashAttention's memory footprint "
                        "(default: how the preset was trained, e.g. 'selective' for Llama; else 'none')")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="pipeline schedule; 'interleaved' needs --pp >= 2, --virtual-stages >= 2 and "
                        "--microbatches a multiple of --pp (Megatron-LM)")
    g.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="model chunks per pipeline rank (interleaved schedule only)")
    g.add_argument("--micro-batch", dest="micro_batch_size", type=positive_int, default=1,
                   help="sequences per micro-batch per replica (Megatron's --micro-batch-size)")
    g.add_argument("--microbatches", dest="num_microbatches", type=positive_int, default=1,
                   help="micro-batches per step per pipeline (Megatron's num_microbatches)")
    g.add_argument("--offload", choices=OFFLOAD, default="none")


def _precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    g.add_argument("--grad-dtype", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    g.add_argument("--fp32-grad-copy", action="store_true", help="Megatron fp16: +4 bytes/param")
    g.add_argument("--convention", choices=tuple(CONVENTIONS), help="a named convention (overrides the above)")


def _model(args: argparse.Namespace) -> "TransformerConfig | float":
    if getattr(args, "preset", None) is not None:
        if args.model is not None and args.model != args.preset:
            raise ValueError(f"two models given: {args.preset!r} and --model {args.model!r}; give one")
        args.model = args.preset
    shape = [args.layers, args.hidden, args.heads]
    given = sum(x is not None for x in (args.model, args.params)) + any(v is not None for v in shape)
    if given != 1:
        raise ValueError("give exactly one of --model PRESET, --params N, or --layers/--hidden/--heads")
    custom_only = {"--kv-heads": args.kv_heads, "--ffn": args.ffn, "--vocab": args.vocab,
                   "--activation": args.activation}
    if args.model is not None or args.params is not None:
        ignored = [flag for flag, value in custom_only.items() if value is not None]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} only describe a custom shape (--layers/--hidden/"
                             f"--heads); a preset or a bare parameter count has its own")
    if args.model is not None:
        return resolve_model(args.model)
    if args.params is not None:
        return resolve_model(args.params)
    if None in shape:
        raise ValueError("a custom shape needs all of --layers, --hidden and --heads")
    return TransformerConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                             kv_heads=args.kv_heads, ffn=args.ffn,
                             vocab=50257 if args.vocab is None else args.vocab,
                             seq=2048 if args.seq is None else args.seq,
                             activation=args.activation or "gelu")


def _layout(args: argparse.Namespace, shape: dict[str, Any] | None = None) -> Parallelism:
    """The layout of the flags; ``dp`` defaults to ``--gpus`` / (tp*pp*cp). When ``--gpus`` does
    not divide, the suggestion is the smallest larger count that satisfies every rule of
    :data:`~dtlib.analytic.layout.RULES` for this model (``shape``), not only divisibility."""
    for name in ("tp", "pp", "cp", "ep"):
        validate.integer(name, getattr(args, name))
    model_parallel = args.tp * args.pp * args.cp
    dp = args.dp
    if dp is None:
        gpus = model_parallel if args.gpus is None else validate.integer("gpus", args.gpus)
        if gpus % model_parallel:
            raise ValueError(f"--gpus {gpus} is not divisible by tp*pp*cp = {model_parallel}; "
                             + _suggest_gpus(args, shape or {}, gpus, model_parallel))
        dp = gpus // model_parallel
    return Parallelism(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
                       sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                       virtual_stages=args.virtual_stages, micro_batch_size=args.micro_batch_size,
                       num_microbatches=args.num_microbatches, recompute=args.recompute or "none",
                       offload=args.offload)


def _suggest_gpus(args: argparse.Namespace, shape: dict[str, Any], gpus: int, model_parallel: int,
                  tries: int = 4096) -> str:
    """The smallest multiple of tp*pp*cp above ``gpus`` whose layout breaks no rule, or, when none
    does, the rule that no GPU count can fix (e.g. tp=3 and 32 heads)."""
    def first_broken(dp: int) -> str | None:
        n = dict(shape, dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
                 sequence_parallel=bool(args.sequence_parallel), virtual_stages=args.virtual_stages,
                 micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
                 shard_size=dp * args.cp)
        return next((message(**{f: n[f] for f in fields})
                     for valid, message, fields in broken_rules(n, args.schedule, args.offload)
                     if not bool(valid)), None)

    first = -(-gpus // model_parallel)
    for dp in range(first, first + tries):
        if first_broken(dp) is None:
            return f"the next valid count is --gpus {dp * model_parallel}"
    return f"no GPU count fixes this layout: {first_broken(first)}"


def _checked_layout(args: argparse.Namespace, model: "TransformerConfig | float") -> Parallelism:
    """The layout, checked against the model shape and the GPU count (as memory_per_gpu does)."""
    shape = model.numbers(args.seq) if isinstance(model, TransformerConfig) else {}
    layout = _layout(args, shape)
    check_layout(layout.numbers(**shape, gpus=args.gpus), layout.schedule, layout.offload)
    return layout


def _training_defaults(args: argparse.Namespace, model: "TransformerConfig | float") -> list[str]:
    """Fill ``--recompute`` and ``--dropout`` left unset with how the preset was trained
    (:func:`dtlib.analytic.presets.training_of`; the paper's GPT convention for a custom shape or
    a bare count). Returns the note saying what was assumed, if anything differs from the paper."""
    trained = training_of(model) if args.model is not None else GPT_CONVENTION
    assumed = []
    if args.recompute is None:
        args.recompute = trained.recompute
        if trained.flash_attention:
            assumed.append("FlashAttention-style attention (the s x s scores are not stored: counted "
                           "as --recompute selective)")
    if getattr(args, "dropout", False) is None:  # only `memory` has --dropout
        args.dropout = trained.dropout
        if not trained.dropout:
            assumed.append("no dropout")
    if not assumed:
        return []
    return [f"assuming {model.name} as trained: {' and '.join(assumed)} ({trained.source}); "
            "--recompute none --dropout for the paper's GPT convention"]


def _precision(args: argparse.Namespace):
    if args.convention:
        return get_precision(args.convention)
    return precision(args.precision, args.grad_dtype, args.optimizer, args.fp32_grad_copy)


# ---- output ------------------------------------------------------------------------------------
def _table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join([title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows])


def _bytes(x: float) -> str:
    """Whole bytes while a float holds them exactly (< 2^53), else 4 significant digits: never
    the noise digits of a huge float."""
    return f"{x:,.0f}" if abs(x) < 2 ** 53 else f"{x:.4g}"


def _gib(x: float | None) -> str:
    if x is None:
        return "n/a (no model shape)"
    gib = f"{x / GiB:10.2f}" if x < 1e6 * GiB else f"{x / GiB:10.4g}"
    return f"{gib} GiB  ({_bytes(x)} B)"


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> int:
    # allow_nan=False: JSON has no NaN or Infinity, and the inputs are checked so none can arise
    print(json.dumps(data, indent=2, default=str, allow_nan=False) if args.json else text)
    return 0


# ---- subcommands ---------------------------------------------------------------------------------
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
    _model_args(p), _layout_args(p), _precision_args(p)
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
    model = _model(args)
    assumed = _training_defaults(args, model)
    layout = _checked_layout(args, model)
    m = memory_per_gpu(model, layout, precision=_precision(args), gpu=args.gpu,
                       gpus=args.gpus, seq=args.seq, dropout=args.dropout,
                       largest_layer_params=args.largest_layer, overhead_bytes=args.overhead)
    if layout.zero == 3 and not isinstance(model, TransformerConfig) and args.largest_layer is None:
        m.notes.append("temporary: the ZeRO-3 gather buffer is counted as 0 because a bare parameter "
                       "count has no layer sizes; give --largest-layer N (DeepSpeed budgets 4 bytes x "
                       "the largest layer's parameters) or a model shape")
    m.notes.extend(assumed)
    rows = [(k, _gib(v)) for k, v in m.to_dict()["per_gpu"].items()]
    rows += [("offloaded to CPU", _gib(m.cpu)), (f"{m.gpu.name} memory", _gib(m.gpu.memory_bytes)),
             ("fits", "yes" if m.fits else "NO")]
    title = (f"memory per GPU (stage {m.stage}; dp={layout.dp} tp={layout.tp} pp={layout.pp} "
             f"cp={layout.cp} zero={layout.zero} recompute={layout.recompute})")
    return _emit(args, m.to_dict(), _table(rows, title) + "\n" + "\n".join(m.notes))


def add_flops_command(sub: Any) -> None:
    p = sub.add_parser("flops", help="FLOPs per step, MFU and HFU")
    _model_args(p), _layout_args(p)
    p.add_argument("--batch", type=positive_int,
                   help="global batch in sequences (default dp*micro_batch_size*num_microbatches)")
    p.add_argument("--step-time", type=_seconds, help="measured seconds per step (gives MFU/HFU)")
    p.add_argument("--attention-flops", choices=ATTENTION, default="full")
    p.add_argument("--no-logits", action="store_true", help="leave out the vocabulary projection")
    p.add_argument("--dtype", default="bf16", help="peak to compare with: fp32, tf32, bf16, fp16, fp8")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_flops)


def run_flops(args: argparse.Namespace) -> int:
    model = _model(args)
    assumed = _training_defaults(args, model)
    layout = _checked_layout(args, model)
    r = flops_report(model, layout.global_batch if args.batch is None else args.batch, seq=args.seq,
                     step_time=args.step_time, gpus=layout.gpus if args.gpus is None else args.gpus,
                     gpu=args.gpu,
                     dtype=args.dtype, recompute=args.recompute, attention=args.attention_flops,
                     count_logits=not args.no_logits)
    rows = [("tokens per step", f"{r['tokens_per_step']:,}"),
            ("FLOPs per token (train)", f"{r['flops_per_token']:.4g}"),
            ("model FLOPs per step", f"{r['model_flops_per_step']:.4g}"),
            ("hardware FLOPs per step", f"{r['hardware_flops_per_step']:.4g}"),
            (f"peak per GPU ({r['gpu']}, {r['dtype']})", f"{r['peak_flops_per_gpu']:.4g} FLOP/s"),
            ("step time at 100% MFU", f"{r['ideal_step_time']:.4g} s")]
    if "mfu" in r:
        rows += [("MFU", f"{100 * r['mfu']:.1f} %"), ("HFU", f"{100 * r['hfu']:.1f} %")]
    r["notes"] = assumed
    return _emit(args, r, "\n".join([_table(rows, f"FLOPs: {r['model']} on {r['gpus']} GPUs")] + assumed))


def add_comm_command(sub: Any) -> None:
    p = sub.add_parser(
        "comm", help="collective cost (alpha-beta) or per-strategy volumes of a model",
        description="Either one collective (--bytes and --ranks) or the per-step volumes of a model "
                    "(--model, --params or --layers/--hidden/--heads), not both. Ranks beyond "
                    "--gpus-per-node span nodes: the flat ring/tree rows are then timed on the "
                    "inter-node link (their slowest hop) and a hierarchical row is added.")
    p.add_argument("--collective", choices=COLLECTIVES, default="all_reduce",
                   type=lambda s: s.replace("-", "_"))  # "all-reduce" reads as all_reduce
    p.add_argument("--bytes", type=parse_size, help="buffer size, e.g. 1GiB")
    p.add_argument("--ranks", type=positive_int, help="ranks in the collective")
    p.add_argument("--link", default="nvlink4", help=f"intra-node link, one of {', '.join(LINKS)}")
    p.add_argument("--inter-link", default="ib-ndr",
                   help="inter-node link (one NIC per GPU), used when --ranks exceeds --gpus-per-node")
    p.add_argument("--algorithm", choices=ALGORITHMS + ("both",), default="both")
    _model_args(p), _layout_args(p), _precision_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_comm)


_SINGLE_COLLECTIVE_OPTIONS = {"collective", "bytes", "ranks", "link", "inter_link", "gpus_per_node",
                              "algorithm", "json", "command", "run"}


def run_comm(args: argparse.Namespace) -> int:
    algs = ALGORITHMS if args.algorithm == "both" else (args.algorithm,)
    if any(getattr(args, x) is not None for x in ("preset", "model", "params", "layers", "hidden", "heads")):
        if args.bytes is not None or args.ranks is not None:
            raise ValueError("give either --bytes and --ranks (one collective) or a model (--model, "
                             "--params or --layers/--hidden/--heads: per-strategy volumes), not both")
        return _comm_volumes(args)
    if args.bytes is None or args.ranks is None:
        raise ValueError("comm needs --bytes and --ranks (a single collective) or a model (--model ...)")
    # layout and precision options only shape a model's volumes: a single collective ignoring
    # them silently would answer a question the user did not ask
    defaults = vars(build_parser().parse_args(["comm"]))
    ignored = sorted(k for k, v in vars(args).items() if k not in _SINGLE_COLLECTIVE_OPTIONS
                     and k in defaults and v != defaults[k])
    if ignored:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in ignored)}: layout and "
                         "precision options describe a model, not a single collective, which takes "
                         "--collective, --bytes, --ranks, --link, --inter-link, --gpus-per-node and "
                         "--algorithm")
    validate.integer("ranks", args.ranks)
    validate.integer("gpus_per_node", args.gpus_per_node)
    intra, inter = get_link(args.link), get_link(args.inter_link)
    g, n = args.gpus_per_node, args.ranks
    nodes = -(-n // g)
    notes: list[str] = []
    if nodes == 1:
        flat = intra
        label = {alg: alg for alg in algs}
        title = f"{args.collective} of {_bytes(args.bytes)} B over {n} ranks in one node on {intra.name}"
    else:
        cl = cluster(args.gpu, nodes, g, intra.name, inter.name)
        flat = flat_link(cl)
        label = {alg: f"flat {alg} (bounded by {inter.name})" for alg in algs}
        title = (f"{args.collective} of {_bytes(args.bytes)} B over {n} ranks on {nodes} nodes "
                 f"({intra.name} within a node, {inter.name} across)")
        notes.append(f"flat rows: one {'/'.join(algs)} over all {n} ranks; every step waits for its "
                     f"slowest hop, the {inter.name} link between nodes "
                     f"({flat.bandwidth / 1e9:g} GB/s per GPU, {flat.latency * 1e6:g} us). That is "
                     "a single topology-unaware ring; NCCL runs one ring per NIC (channels) laid out "
                     "along the topology, which brings it close to the hierarchical row")
    r = comm_report(args.collective, args.bytes, n, flat, algs)
    r.update(intra_link=intra.name, inter_link=inter.name, gpus_per_node=g, nodes=nodes)
    rows = [(label[alg], f"{v['time'] * 1e6:12.1f} us   algbw {(v['algbw'] or 0) / 1e9:8.2f} GB/s   "
                         f"busbw {(v['busbw'] or 0) / 1e9:8.2f} GB/s") for alg, v in r["algorithms"].items()]
    if nodes > 1:
        if n % g:
            notes.append(f"no hierarchical row: {n} ranks are not whole nodes of {g} GPUs")
        elif args.collective not in ("all_reduce", "reduce_scatter", "all_gather"):
            notes.append("no hierarchical row: it covers all-reduce, reduce-scatter and all-gather")
        else:
            r["hierarchical"] = hierarchical_time(args.collective, args.bytes, cl, algs[0])
            rows.append((f"hierarchical {algs[0]}",
                         f"{r['hierarchical']['total'] * 1e6:12.1f} us   ({nodes} nodes x {g}: "
                         f"{intra.name} within, {inter.name} across)"))
    r["notes"] = notes
    return _emit(args, r, "\n".join([_table(rows, title)] + notes))


def _comm_volumes(args: argparse.Namespace) -> int:
    cfg = _model(args)
    if not isinstance(cfg, TransformerConfig):
        raise ValueError("per-strategy volumes need a model shape (--model or --layers/--hidden/--heads)")
    _training_defaults(args, cfg)  # recompute changes TP volumes only when 'full', never by default
    v = strategy_volumes(cfg, _checked_layout(args, cfg), _precision(args), seq=args.seq)
    rows = [(k, f"{d['collective']:<15} {d['calls']:6.0f} x {d['bytes'] / 2**20:10.1f} MiB over "
                f"{d['ranks']:4d} ranks -> {d['bytes_sent_per_gpu'] / GiB:8.2f} GiB sent/GPU")
            for k, d in v.items()]
    return _emit(args, {"volumes": v}, _table(rows, f"communication per step: {cfg.name}"))


def _non_negative_int(text: str) -> int:
    """An integer >= 0 (counts that may be zero: experts, seed, checkpoint interval)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = str(text)
    return _checked(lambda: validate.integer("value", value, minimum=0), text)


def _positive_float(text: str, exclusive: bool = True) -> float:
    """A finite number > 0 (learning rate, capacity factor, timeout)."""
    try:
        value = float(text)
    except ValueError:
        value = str(text)
    return _checked(lambda: validate.number("value", value, minimum=0, exclusive=exclusive), text)


def _non_negative_float(text: str) -> float:
    """A finite number >= 0 (0 turns an option off: the heartbeat)."""
    return _positive_float(text, exclusive=False)


_TRAIN_DESCRIPTION = """Train TinyGPT on the bundled text (byte tokens) on a rank grid of dp x tp x pp x cp ranks.

Started three ways with the same code: this command launches the ranks itself (gloo on CPU, NCCL
with one GPU per rank); under torchrun it joins them (env:// rendezvous):
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr node0 -m dtlib.train --dp 2 --tp 4
and from Python: dtlib.launch(dtlib.train.train, n, args=(TrainConfig(...),)).
--json prints one JSON object (steps, losses, tokens_per_s, mfu, layout, peak_memory_bytes,
params_sha256: SHA-256 of the full parameters, names sorted, float32 little-endian).
Checkpoints and restarts (bit-identical resume, on this or another layout):
  torchrun --nproc-per-node 2 --max-restarts 1 -m dtlib.train --dp 2 --zero 2 \
      --checkpoint-dir ckpt --checkpoint-every 1 --resume --json"""


def add_train_command(sub: Any) -> None:
    p = sub.add_parser("train", help="train TinyGPT on dp x tp x pp x cp ranks (DP/ZeRO/FSDP, TP/SP, PP, CP, EP)",
                       description=_TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (TinyGPT)")
    g.add_argument("--layers", type=positive_int, default=2)
    g.add_argument("--hidden", type=positive_int, default=64)
    g.add_argument("--heads", type=positive_int, default=4)
    g.add_argument("--kv-heads", type=positive_int, help="K/V heads (grouped-query attention; default: --heads)")
    g.add_argument("--ffn", type=positive_int, help="MLP width (default 4 x hidden)")
    g.add_argument("--vocab", type=positive_int, default=256, help="vocabulary (>= 256: byte tokens)")
    g.add_argument("--seq", type=positive_int, default=32, help="sequence length in tokens")
    g.add_argument("--moe-experts", type=_non_negative_int, default=0, help="experts per MoE MLP (0: dense)")
    g.add_argument("--moe-top-k", type=_non_negative_int, default=0, help="experts per token (MoE)")
    g.add_argument("--capacity-factor", type=_positive_float,
                   help="MoE expert capacity factor (Switch Transformer); default: no token dropped")
    g.add_argument("--aux-loss-coef", type=float, default=0.01, help="MoE load-balancing loss weight")
    g = p.add_argument_group("layout (world size = dp x tp x pp x cp)")
    g.add_argument("--dp", type=positive_int, help="data-parallel size (default: the world size "
                                                   "under torchrun / (tp x pp x cp), else 1)")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context (ring attention)"),
                       ("ep", "expert (carved out of dp)")):
        g.add_argument(f"--{name}", type=positive_int, default=1, help=f"{what} parallel size")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="0 all-reduce, 1-2 ZeRO (sharded optimizer), 3 FSDP")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs --tp)")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"), default="1f1b",
                   help="pipeline schedule")
    g.add_argument("--virtual-stages", type=positive_int, default=1, help="model chunks per pipeline rank (interleaved)")
    g.add_argument("--micro-batch", dest="micro_batch_size", type=positive_int, default=2,
                   help="sequences per micro-batch per data-parallel replica")
    g.add_argument("--microbatches", dest="num_microbatches", type=positive_int,
                   help="micro-batches per step (pipeline, or gradient accumulation); default 1, or "
                        "from --global-batch-size")
    g.add_argument("--global-batch-size", type=positive_int,
                   help="sequences per step; sets --microbatches = global / (dp x micro-batch) "
                        "(Megatron-LM), so a torchrun restart on fewer ranks keeps the global batch")
    g.add_argument("--recompute", action="store_true", help="recompute each block in backward (full)")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=positive_int, default=5)
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--lr", type=_positive_float, default=3e-3)
    g.add_argument("--seed", type=_non_negative_int, default=0)
    g.add_argument("--checkpoint-dir", help="directory for torch.distributed.checkpoint saves")
    g.add_argument("--checkpoint-every", type=_non_negative_int, default=0, help="save every N steps (0: never)")
    g.add_argument("--keep-last", type=positive_int, default=2, help="complete checkpoints kept (older ones deleted)")
    g.add_argument("--milestone-every", type=_non_negative_int, default=0,
                   help="also keep every checkpoint whose step is a multiple of this (0: none)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (dcp.async_save): training waits only for the copy")
    g.add_argument("--resume", action="store_true",
                   help="start from the newest checkpoint in --checkpoint-dir if there is one (any layout "
                        "of the same model: resharded); the same command serves every torchrun restart")
    g.add_argument("--profile", metavar="DIR",
                   help="profile the last steps (torch.profiler): per-rank Chrome traces in DIR, "
                        "breakdown, MFU/HFU and findings printed (re-read with 'dtlib profile DIR')")
    g = p.add_argument_group("fault drill")
    g.add_argument("--kill-step", type=_non_negative_int,
                   help="SIGKILL one rank at the start of this step, on torchrun's first attempt only")
    g.add_argument("--kill-rank", type=_non_negative_int, help="the rank --kill-step kills (default: the last)")
    g.add_argument("--kill-agent", action="store_true",
                   help="also SIGKILL that rank's torchrun agent (a lost node: with --nnodes MIN:MAX the "
                        "others restart without it)")
    g.add_argument("--hang-step", type=_non_negative_int,
                   help="one rank hangs in the data phase of this step (a stuck data loader), first attempt only")
    g.add_argument("--hang-rank", type=_non_negative_int, help="the rank --hang-step hangs (default: the last)")
    g.add_argument("--heartbeat", type=_non_negative_float, default=0.0, metavar="SECONDS",
                   help="name a rank that makes no progress for this long and end the job (exit 75) so "
                        "torchrun restarts it; well below --timeout, above the longest step (0: off)")
    g = p.add_argument_group("launch")
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    g.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds before a hung run is stopped")
    g.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from dtlib import train

    env_world = int(os.environ["WORLD_SIZE"]) if train.under_torchrun() else None
    if args.dp is None:
        model_parallel = args.tp * args.pp * args.cp
        args.dp = 1 if env_world is None else max(env_world // model_parallel, 1)
    if args.global_batch_size is not None:
        per_step = args.micro_batch_size * args.dp  # sequences of one micro-batch on every replica
        if args.global_batch_size % per_step:
            raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch x dp "
                             f"= {args.micro_batch_size} x {args.dp} = {per_step}")
        derived = args.global_batch_size // per_step
        if args.num_microbatches not in (None, derived):
            raise ValueError(f"--microbatches {args.num_microbatches} contradicts --global-batch-size "
                             f"{args.global_batch_size} = dp {args.dp} x micro-batch {args.micro_batch_size} "
                             f"x {derived}: give one of them")
        args.num_microbatches = derived
    elif args.num_microbatches is None:
        args.num_microbatches = 1
    config = train.config_from_args(args).check(env_world)
    train.check_resume(config)
    if env_world is None:
        summary = train.run(config, backend=args.backend, timeout=args.timeout, progress=not args.json)
    else:
        from dtlib.launcher import run_from_env
        summary = run_from_env(train.train, config, False, not args.json, backend=args.backend,
                               timeout=args.timeout)
    if "losses" in summary:
        print(train.emit(summary, args.json))
    return 0


def add_checkpoint_command(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="inspect or convert a dtlib checkpoint directory",
                       description="A directory of step checkpoints (dtlib.resilience.checkpoint), or one of them.")
    actions = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    inspect = actions.add_parser("inspect", help="steps, layout, parameters and files of the newest checkpoint")
    inspect.add_argument("directory")
    inspect.add_argument("--step", type=int, default=None, help="a step other than the newest")
    inspect.add_argument("--json", action="store_true")
    convert = actions.add_parser("convert", help="one torch.save file with the full parameters")
    convert.add_argument("directory")
    convert.add_argument("--to-torch", required=True, metavar="FILE.pt")
    convert.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_checkpoint)


def _run_checkpoint(args: argparse.Namespace) -> int:
    from dtlib.resilience.checkpoint import (CheckpointError, checkpoint_steps, read_manifest, to_torch,
                                             verify_files)
    steps = checkpoint_steps(args.directory)
    own = os.path.exists(os.path.join(args.directory, "manifest.json"))
    if not steps and not own:
        raise ValueError(f"no complete checkpoint in {args.directory} (no step*/manifest.json)")
    try:
        if args.action == "convert":
            out = to_torch(args.directory, args.to_torch)
            data = {"file": args.to_torch, "step": out["step"], "tensors": len(out["model"])}
            return _emit(args, data, f"wrote {args.to_torch}: step {out['step']}, {len(out['model'])} tensors")
        step = args.step if args.step is not None else (steps[-1] if steps else None)
        path = args.directory if own else os.path.join(args.directory, f"step{step:08d}")
        manifest = read_manifest(path)
        verify_files(path, manifest)
    except CheckpointError as exc:  # names the file: one line, exit 2
        raise ValueError(str(exc)) from None
    rows = [("checkpoints", ", ".join(f"step{s:08d}" for s in steps) or path),
            ("step", str(manifest["step"])), ("data position", json.dumps(manifest["data_position"])),
            ("layout", json.dumps(manifest["layout"])), ("written by", f"{manifest['world_size']} ranks")]
    rows += [(name, str(shape)) for name, shape in manifest["shapes"].items()]
    rows += [(f, f"{d['bytes']:,} bytes, sha256 {d['sha256'][:12]}") for f, d in manifest["files"].items()]
    return _emit(args, {"steps": steps, "path": path, **manifest}, _table(rows, f"checkpoint {path}"))


def add_profile_command(sub: Any) -> None:
    p = sub.add_parser("profile", help="re-read saved per-rank traces: breakdown, MFU/HFU, findings",
                       description="Summarise the rank<k>.json Chrome traces that 'dtlib train "
                                   "--profile DIR' or dtlib.profile.profile_steps wrote.")
    p.add_argument("dir", help="folder holding rank0.json, rank1.json, ...")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    from dtlib.profile import Finding, format_summary, read_dir  # torch only when profiling

    if not os.path.isdir(args.dir):
        raise ValueError(f"DIR {args.dir!r} is not a folder of traces")
    profile = read_dir(args.dir)
    return _emit(args, {"profile": profile},
                 format_summary(profile, [Finding(**f) for f in profile["findings"]]))


COMMANDS: list[Callable[[Any], None]] = [add_memory_command, add_flops_command, add_comm_command,
                                          add_plan_command, add_train_command, add_checkpoint_command,
                                          add_profile_command]


def build_parser() -> argparse.ArgumentParser:
    """The ``dtlib`` parser with every subcommand in :data:`COMMANDS`."""
    parser = _Parser(prog="dtlib", description="Distributed-training arithmetic: memory, FLOPs, communication.")
    parser.add_argument("--version", action="version", version=f"dtlib {dtlib.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dtlib`` console script; returns the exit status."""
    try:
        args = build_parser().parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the try
        return code
    except validate.InvalidArgument as exc:  # a Python parameter: say its flag
        print(f"dtlib: error: {exc.renamed(_flag(exc.name))}".replace("\n", " "), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"dtlib: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except BrokenPipeError:
        # the reader went away (``dtlib ... | head``): the Python docs' recipe (library/signal,
        # "Note on SIGPIPE"): point stdout at devnull so the flush at exit cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
