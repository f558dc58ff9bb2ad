"""The ``dtlib`` command: ``dtlib memory|flops|comm ...`` (tables by default, ``--json`` for machines).

Each subcommand is a small ``add_*_command(subparsers)`` that registers its options and a
``run(args) -> int``; :data:`COMMANDS` lists them, so more can be added without touching the rest.
Bad input prints one line on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable

from dtlib.comm import ALGORITHMS, COLLECTIVES, comm_report, hierarchical_time, strategy_volumes
from dtlib.flops import ATTENTION, flops_report
from dtlib.hardware import ACCELERATORS, LINKS, cluster
from dtlib.memory import GiB, memory_per_gpu, resolve_model
from dtlib.models.config import ACTIVATIONS, TransformerConfig
from dtlib.parallelism import OFFLOAD, RECOMPUTE, SCHEDULES, Parallelism, check_layout
from dtlib.precision import CONVENTIONS, DTYPES, OPTIMIZERS, get_precision, precision

__all__ = ["main", "build_parser", "COMMANDS", "parse_size", "parse_count"]


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors become ValueError (one line, exit 2, like every bad input)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see '{self.prog} --help')")


_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_COUNTS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}  # 7B = 7 billion parameters


def _parse(text: str, units: dict[str, float], example: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write e.g. {example}")
    try:
        return float(m.group(1)) * units[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write e.g. {example}") from None


def parse_size(text: str) -> float:
    """Bytes: ``"1e9"``, ``"512MiB"``, ``"4GB"``."""
    return _parse(text, _BYTES, "1e9, 512MiB, 4GB")


def parse_count(text: str) -> float:
    """A count: ``"7e9"``, ``"7B"`` (billions), ``"350M"``."""
    return _parse(text, _COUNTS, "7e9, 7B, 350M")


# ---- shared options -------------------------------------------------------------------------------
def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (one of --model, --params, or --layers/--hidden/--heads)")
    g.add_argument("--model", help="preset name, e.g. llama3-8b")
    g.add_argument("--params", type=parse_count, help="bare parameter count, e.g. 7e9 or 7B")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn"):
        g.add_argument(f"--{name}", type=int)
    g.add_argument("--vocab", type=int, default=None, help="vocabulary (default 50257 for a custom shape)")
    g.add_argument("--activation", choices=ACTIVATIONS, default="gelu")
    g.add_argument("--seq", type=int, help="sequence length (default: the model's)")


def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--gpus", type=int, help="total GPUs (default dp*tp*pp*cp)")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(ACCELERATORS)}")
    for name in ("tp", "pp", "cp", "ep"):
        g.add_argument(f"--{name}", type=int, default=1)
    g.add_argument("--dp", type=int, help="data parallel size (default gpus/(tp*pp*cp))")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    g.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="activation recomputation (Korthikanti et al. 2022); 'selective' drops the "
                        "s^2 attention terms, which is also FlashAttention's memory footprint")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    g.add_argument("--virtual-stages", type=int, default=1)
    g.add_argument("--micro-batch", type=int, default=1)
    g.add_argument("--microbatches", type=int, default=1)
    g.add_argument("--offload", choices=OFFLOAD, default="none")


def _precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument("--precision", choices=DTYPES, default="bf16-mixed")
    g.add_argument("--grad-dtype", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    g.add_argument("--fp32-grad-copy", action="store_true", help="Megatron fp16: +4 bytes/param")
    g.add_argument("--convention", choices=tuple(CONVENTIONS), help="a named convention (overrides the above)")


def _model(args: argparse.Namespace) -> "TransformerConfig | float":
    shape = [args.layers, args.hidden, args.heads]
    given = sum(x is not None for x in (args.model, args.params)) + any(v is not None for v in shape)
    if given != 1:
        raise ValueError("give exactly one of --model PRESET, --params N, or --layers/--hidden/--heads")
    if args.model:
        return resolve_model(args.model)
    if args.params is not None:
        return resolve_model(args.params)
    if None in shape:
        raise ValueError("a custom shape needs all of --layers, --hidden and --heads")
    return TransformerConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                             kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab or 50257,
                             seq=args.seq or 2048, activation=args.activation)


def _layout(args: argparse.Namespace) -> Parallelism:
    model_parallel = args.tp * args.pp * args.cp
    dp = args.dp
    if dp is None:
        gpus = args.gpus or model_parallel
        if gpus % model_parallel:
            raise ValueError(f"--gpus {gpus} is not divisible by tp*pp*cp = {model_parallel}; "
                             f"valid --gpus are multiples of {model_parallel}")
        dp = gpus // model_parallel
    return Parallelism(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
                       sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                       virtual_stages=args.virtual_stages, micro_batch=args.micro_batch,
                       microbatches=args.microbatches, recompute=args.recompute, offload=args.offload)


def _checked_layout(args: argparse.Namespace, model: "TransformerConfig | float") -> Parallelism:
    """The layout, checked against the model shape and the GPU count (as memory_per_gpu does)."""
    layout = _layout(args)
    shape = model.numbers(args.seq) if isinstance(model, TransformerConfig) else {}
    check_layout(layout.numbers(**shape, gpus=args.gpus), layout.schedule, layout.offload)
    return layout


def _precision(args: argparse.Namespace):
    if args.convention:
        return get_precision(args.convention)
    return precision(args.precision, args.grad_dtype, args.optimizer, args.fp32_grad_copy)


# ---- output ------------------------------------------------------------------------------------
def _table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join([title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows])


def _gib(x: float | None) -> str:
    return "n/a (no model shape)" if x is None else f"{x / GiB:10.2f} GiB  ({x:,.0f} B)"


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> int:
    print(json.dumps(data, indent=2, default=str) if args.json else text)
    return 0


# ---- subcommands ---------------------------------------------------------------------------------
def add_memory_command(sub: Any) -> None:
    p = sub.add_parser("memory", help="memory per GPU (most loaded GPU)")
    _model_args(p), _layout_args(p), _precision_args(p)
    p.add_argument("--largest-layer", type=parse_count, help="ZeRO-3 gather unit in parameters, e.g. 32M")
    p.add_argument("--overhead", type=parse_size, default=0.0, help="framework overhead bytes, e.g. 2GiB")
    p.add_argument("--no-dropout", action="store_true", help="model trained without dropout")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    layout = _layout(args)
    m = memory_per_gpu(_model(args), layout, precision=_precision(args), gpu=args.gpu,
                       gpus=args.gpus, seq=args.seq, dropout=not args.no_dropout,
                       largest_layer_params=args.largest_layer, overhead_bytes=args.overhead)
    rows = [(k, _gib(v)) for k, v in m.to_dict()["per_gpu"].items()]
    rows += [("offloaded to CPU", _gib(m.cpu)), (f"{m.gpu.name} memory", _gib(m.gpu.memory_bytes)),
             ("fits", "yes" if m.fits else "NO")]
    title = (f"memory per GPU (stage {m.stage}; dp={layout.dp} tp={layout.tp} pp={layout.pp} "
             f"cp={layout.cp} zero={layout.zero} recompute={layout.recompute})")
    return _emit(args, m.to_dict(), _table(rows, title) + "\n" + "\n".join(m.notes))


def add_flops_command(sub: Any) -> None:
    p = sub.add_parser("flops", help="FLOPs per step, MFU and HFU")
    _model_args(p), _layout_args(p)
    p.add_argument("--batch", type=int, help="global batch in sequences (default dp*micro_batch*microbatches)")
    p.add_argument("--step-time", type=float, help="measured seconds per step (gives MFU/HFU)")
    p.add_argument("--attention-flops", choices=ATTENTION, default="full")
    p.add_argument("--no-logits", action="store_true", help="leave out the vocabulary projection")
    p.add_argument("--dtype", default="bf16", help="peak to compare with: fp32, tf32, bf16, fp16, fp8")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_flops)


def run_flops(args: argparse.Namespace) -> int:
    model = _model(args)
    layout = _checked_layout(args, model)
    r = flops_report(model, args.batch or layout.global_batch, seq=args.seq,
                     step_time=args.step_time, gpus=args.gpus or layout.gpus, gpu=args.gpu,
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
    return _emit(args, r, _table(rows, f"FLOPs: {r['model']} on {r['gpus']} GPUs"))


def add_comm_command(sub: Any) -> None:
    p = sub.add_parser("comm", help="collective cost (alpha-beta) or per-strategy volumes of a model")
    p.add_argument("--collective", choices=COLLECTIVES, default="all-reduce",
                   type=lambda s: s.replace("_", "-"))  # torch spells them all_reduce
    p.add_argument("--bytes", type=parse_size, help="buffer size, e.g. 1GiB")
    p.add_argument("--ranks", type=int, help="ranks in the collective")
    p.add_argument("--link", default="nvlink4", help=f"one of {', '.join(LINKS)}")
    p.add_argument("--inter-link", default="ib-ndr", help="inter-node link (hierarchical)")
    p.add_argument("--algorithm", choices=ALGORITHMS + ("both",), default="both")
    _model_args(p), _layout_args(p), _precision_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_comm)


def run_comm(args: argparse.Namespace) -> int:
    algs = ALGORITHMS if args.algorithm == "both" else (args.algorithm,)
    if any(x is not None for x in (args.model, args.params, args.layers)):
        return _comm_volumes(args)
    if args.bytes is None or args.ranks is None:
        raise ValueError("comm needs --bytes and --ranks (a single collective) or a model (--model ...)")
    r = comm_report(args.collective, args.bytes, args.ranks, args.link, algs)
    rows = [(alg, f"{v['time'] * 1e6:12.1f} us   algbw {(v['algbw'] or 0) / 1e9:8.2f} GB/s   "
                  f"busbw {(v['busbw'] or 0) / 1e9:8.2f} GB/s") for alg, v in r["algorithms"].items()]
    if args.ranks > args.gpus_per_node and args.ranks % args.gpus_per_node == 0 and \
            args.collective in ("all-reduce", "reduce-scatter", "all-gather"):
        cl = cluster(args.gpu, args.ranks // args.gpus_per_node, args.gpus_per_node, args.link, args.inter_link)
        r["hierarchical"] = hierarchical_time(args.collective, args.bytes, cl, algs[0])
        rows.append(("hierarchical", f"{r['hierarchical']['total'] * 1e6:12.1f} us "
                                     f"({cl.nodes} nodes x {cl.gpus_per_node}, {args.inter_link})"))
    title = f"{r['collective']} of {r['bytes']:,.0f} B over {r['ranks']} ranks on {r['link']}"
    return _emit(args, r, _table(rows, title))


def _comm_volumes(args: argparse.Namespace) -> int:
    cfg = _model(args)
    if not isinstance(cfg, TransformerConfig):
        raise ValueError("per-strategy volumes need a model shape (--model or --layers/--hidden/--heads)")
    v = strategy_volumes(cfg, _checked_layout(args, cfg), _precision(args), seq=args.seq)
    rows = [(k, f"{d['collective']:<15} {d['calls']:6.0f} x {d['bytes'] / 2**20:10.1f} MiB over "
                f"{d['ranks']:4d} ranks -> {d['bytes_sent_per_gpu'] / GiB:8.2f} GiB sent/GPU")
            for k, d in v.items()]
    return _emit(args, {"volumes": v}, _table(rows, f"communication per step: {cfg.name}"))


COMMANDS: list[Callable[[Any], None]] = [add_memory_command, add_flops_command, add_comm_command]


def build_parser() -> argparse.ArgumentParser:
    """The ``dtlib`` parser with every subcommand in :data:`COMMANDS`."""
    parser = _Parser(prog="dtlib", description="Distributed-training arithmetic: memory, FLOPs, communication.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dtlib`` console script; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except ValueError as exc:
        print(f"dtlib: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)


if __name__ == "__main__":
    sys.exit(main())
