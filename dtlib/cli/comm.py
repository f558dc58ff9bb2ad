"""``dtlib comm``: one collective's alpha-beta cost, or a model's per-strategy volumes
(:mod:`dtlib.analytic.comm`)."""
from __future__ import annotations

import argparse
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.comm import (ALGORITHMS, COLLECTIVES, comm_report, flat_link, hierarchical_time,
                                 strategy_volumes)
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import LINKS, cluster, get_link
from dtlib.analytic.units import GiB
from dtlib.cli.args import (Parser, checked_layout, emit, format_bytes_exact, layout_args, model_args,
                            model_from_args, parse_size, positive_int, precision_args, precision_from_args,
                            table, training_defaults)

__all__ = ["add_comm_command", "run_comm"]


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
    model_args(p), layout_args(p), precision_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_comm)


_SINGLE_COLLECTIVE_OPTIONS = {"collective", "bytes", "ranks", "link", "inter_link", "gpus_per_node",
                              "algorithm", "json", "command", "run"}


def _default_comm_args() -> argparse.Namespace:
    """What ``dtlib comm`` alone parses to: the defaults a single collective must leave untouched."""
    sub = Parser(prog="dtlib").add_subparsers(dest="command", parser_class=Parser)
    add_comm_command(sub)
    return sub.choices["comm"].parse_args([])


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
    defaults = vars(_default_comm_args())
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
        title = f"{args.collective} of {format_bytes_exact(args.bytes)} B over {n} ranks in one node on {intra.name}"
    else:
        cl = cluster(args.gpu, nodes, g, intra.name, inter.name)
        flat = flat_link(cl)
        label = {alg: f"flat {alg} (bounded by {inter.name})" for alg in algs}
        title = (f"{args.collective} of {format_bytes_exact(args.bytes)} B over {n} ranks on {nodes} nodes "
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
    return emit(args, r, "\n".join([table(rows, title)] + notes))


def _comm_volumes(args: argparse.Namespace) -> int:
    cfg = model_from_args(args)
    if not isinstance(cfg, TransformerConfig):
        raise ValueError("per-strategy volumes need a model shape (--model or --layers/--hidden/--heads)")
    training_defaults(args, cfg)  # recompute changes TP volumes only when 'full', never by default
    v = strategy_volumes(cfg, checked_layout(args, cfg), precision_from_args(args), seq=args.seq)
    rows = [(k, f"{d['collective']:<15} {d['calls']:6.0f} x {d['bytes'] / 2**20:10.1f} MiB over "
                f"{d['ranks']:4d} ranks -> {d['bytes_sent_per_gpu'] / GiB:8.2f} GiB sent/GPU")
            for k, d in v.items()]
    return emit(args, {"volumes": v}, table(rows, f"communication per step: {cfg.name}"))
