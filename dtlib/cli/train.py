"""``dtlib train``: the flags of :class:`dtlib.trainer.TrainConfig`, and how the ranks start --
launched here (:func:`dtlib.trainer.run`), joined under torchrun (``torchrun ... -m dtlib train ...``)
or run as a Ray Train job (``--launcher ray``, :func:`dtlib.frameworks.ray_train.run_ray`)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from dtlib.cli.args import non_negative_float, non_negative_int, positive_float, positive_int

if TYPE_CHECKING:
    from dtlib.trainer import TrainConfig

__all__ = ["add_train_command", "run_train", "config_from_args", "header", "summary_text", "LAUNCHERS"]

LAUNCHERS = ("local", "torchrun", "ray")


_TRAIN_DESCRIPTION = """Train TinyGPT on the bundled text (byte tokens) on a rank grid of dp x tp x pp x cp ranks.

Started three ways with the same code: this command launches the ranks itself (gloo on CPU, NCCL
with one GPU per rank); under torchrun it joins them (env:// rendezvous):
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr node0 -m dtlib train --dp 2 --tp 4
and from Python: dtlib.launch(dtlib.trainer.train, n, args=(TrainConfig(...),)).
--launcher ray runs the same ranks as Ray Train workers (TorchTrainer, gloo); with --max-failures
Ray restarts the group after a worker dies, from the last --checkpoint-every save:
  dtlib train --launcher ray --dp 2 --checkpoint-dir ckpt --checkpoint-every 2 --max-failures 1 --json
--json prints one JSON object on stdout and nothing else (rank messages go to stderr): steps,
losses, tokens_per_s, mfu, layout, peak_memory_bytes, params_sha256 (SHA-256 of the full
parameters, names sorted, float32 little-endian).
Checkpoints and restarts (bit-identical resume, on this or another layout):
  torchrun --nproc-per-node 2 --max-restarts 1 -m dtlib train --dp 2 --zero 2 \
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
    g.add_argument("--moe-experts", type=non_negative_int, default=0, help="experts per MoE MLP (0: dense)")
    g.add_argument("--moe-top-k", type=non_negative_int, default=0, help="experts per token (MoE)")
    g.add_argument("--capacity-factor", type=positive_float,
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
    g.add_argument("--tied-embeddings", action="store_true",
                   help="the LM head reuses the token embedding (GPT-2); across pipeline stages the two "
                        "copies' gradients are summed (Megatron's embedding group)")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=positive_int, default=5)
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--lr", type=positive_float, default=3e-3)
    g.add_argument("--clip-grad", type=non_negative_float, default=0.0,
                   help="clip the global gradient norm to this before each step, right on every layout "
                        "(0: off; Megatron-LM and nanoGPT default to 1.0)")
    g.add_argument("--seed", type=non_negative_int, default=0)
    g.add_argument("--checkpoint-dir", help="directory for torch.distributed.checkpoint saves")
    g.add_argument("--checkpoint-every", type=non_negative_int, default=0, help="save every N steps (0: never)")
    g.add_argument("--keep-last", type=positive_int, default=2, help="complete checkpoints kept (older ones deleted)")
    g.add_argument("--milestone-every", type=non_negative_int, default=0,
                   help="also keep every checkpoint whose step is a multiple of this (0: none)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (dcp.async_save): training waits only for the copy")
    g.add_argument("--resume", action="store_true",
                   help="start from the newest checkpoint in --checkpoint-dir if there is one (any layout "
                        "of the same model: resharded); the same command serves every torchrun restart")
    g.add_argument("--override-optimizer-params", action="store_true",
                   help="with --resume: train at this command's --lr, not the checkpoint's (a changed --lr "
                        "is refused otherwise; Megatron-LM's --override-opt_param-scheduler)")
    g.add_argument("--profile", metavar="DIR",
                   help="profile the last steps (torch.profiler): per-rank Chrome traces in DIR, "
                        "breakdown, MFU/HFU and findings printed (re-read with 'dtlib profile DIR')")
    g = p.add_argument_group("fault drill")
    g.add_argument("--kill-step", type=non_negative_int,
                   help="SIGKILL one rank at the start of this step, on torchrun's first attempt only")
    g.add_argument("--kill-rank", type=non_negative_int, help="the rank --kill-step kills (default: the last)")
    g.add_argument("--kill-agent", action="store_true",
                   help="also SIGKILL that rank's torchrun agent (a lost node: with --nnodes MIN:MAX the "
                        "others restart without it)")
    g.add_argument("--hang-step", type=non_negative_int,
                   help="one rank hangs in the data phase of this step (a stuck data loader), first attempt only")
    g.add_argument("--hang-rank", type=non_negative_int, help="the rank --hang-step hangs (default: the last)")
    g.add_argument("--heartbeat", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="name a rank that makes no progress for this long and end the job (exit 75) so "
                        "torchrun restarts it; well below --timeout, above the longest step (0: off)")
    # lesson 12: dtlib.streaming, dtlib.monitor, dtlib.resilience.integrity / .incremental
    g = p.add_argument_group("data, monitoring and integrity")
    g.add_argument("--data", metavar="DIR", help="stream samples from a shard directory "
                   "(dtlib.streaming.write_shards) in one global order, resumable on any world size "
                   "(default: the bundled text)")
    g.add_argument("--data-workers", type=non_negative_int, default=0, help="reader threads per rank (--data)")
    g.add_argument("--prefetch", type=non_negative_int, default=1, help="steps read ahead in the background (--data)")
    g.add_argument("--data-delay", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="drill: every read of --data sleeps this long (slow storage)")
    g.add_argument("--sample-log", metavar="DIR", help="each data-parallel replica's first rank (tp, cp, pp "
                   "rank 0) appends the sample ids of every step to DIR/rankN.jsonl")
    g.add_argument("--metrics", metavar="FILE", help="rank 0 appends one JSON line per step (loss, grad_norm, ...)")
    g.add_argument("--tensorboard", metavar="DIR", help="rank 0 writes TensorBoard scalars to DIR")
    g.add_argument("--checksum-every", type=non_negative_int, default=0,
                   help="compare the replicas' parameter checksums every N steps and name a diverged rank (0: off)")
    g.add_argument("--flip-bit-step", type=non_negative_int, help="drill: flip one parameter bit after this step")
    g.add_argument("--flip-bit-rank", type=non_negative_int, help="the rank --flip-bit-step corrupts (default: the last)")
    g.add_argument("--spike-step", type=non_negative_int,
                   help="drill: multiply every gradient by 1000 at this step (a gradient explosion the alerts catch)")
    g.add_argument("--loss-spike-factor", type=positive_float, default=2.0,
                   help="alert when the loss exceeds this x the median of the last 10 steps")
    g.add_argument("--grad-norm-factor", type=positive_float, default=5.0,
                   help="alert when the gradient norm exceeds this x the median of the last 10 steps")
    g.add_argument("--incremental", action="store_true",
                   help="checkpoints as deltas against the last full one (same layout to resume; --zero 0)")
    g.add_argument("--full-every", type=positive_int, default=4, help="with --incremental: every Nth save is full")
    g = p.add_argument_group("launch")
    g.add_argument("--launcher", choices=LAUNCHERS,
                   help="local: dtlib.launch starts the ranks here; torchrun: join torchrun's ranks "
                        "(torchrun ... -m dtlib train); ray: a Ray Train TorchTrainer job, restarted from "
                        "the last checkpoint by --max-failures (default: torchrun under torchrun, else local)")
    g.add_argument("--max-failures", type=non_negative_int,
                   help="with --launcher ray: worker-group restarts Ray may do (FailureConfig; default 0)")
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    g.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before a hung run is stopped")
    g.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    # the trainer needs torch: imported when training, not for `dtlib memory`
    from dtlib import trainer
    from dtlib.launcher import run_from_env, under_torchrun

    launcher = args.launcher or ("torchrun" if under_torchrun() else "local")
    _check_launcher(launcher, args, under_torchrun())
    env_world = int(os.environ["WORLD_SIZE"]) if launcher == "torchrun" else None
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
    config = config_from_args(args).check(env_world)
    trainer.check_resume(config)
    if launcher == "ray":
        ray_train = _import_ray_train()
        with contextlib.redirect_stdout(sys.stderr):  # Ray's forwarded worker and raylet lines
            summary = ray_train.run_ray(config, max_failures=args.max_failures or 0, timeout=args.timeout)
    elif launcher == "local":
        # rank 0's output (resume line, drills, alerts, progress: all meant for stderr) reaches this
        # process through the launcher, which writes it to sys.stdout: stdout is the summary's alone
        with contextlib.redirect_stdout(sys.stderr):
            summary = trainer.run(config, backend=args.backend, timeout=args.timeout, progress=not args.json)
    else:
        summary = run_from_env(trainer.train, config, False, not args.json, backend=args.backend,
                               timeout=args.timeout)
    if "losses" in summary:
        print(summary_text(summary, args.json))
    return 0


def _check_launcher(launcher: str, args: argparse.Namespace, in_torchrun: bool) -> None:
    """Refuse, by flag, what the chosen launcher cannot do (before anything starts)."""
    if in_torchrun and launcher != "torchrun":
        raise ValueError(f"--launcher {launcher} under torchrun would start ranks inside each torchrun rank: "
                         f"drop --launcher (torchrun's ranks join one job)")
    if launcher == "torchrun" and not in_torchrun:
        raise ValueError("--launcher torchrun: this process was not started by torchrun (RANK, WORLD_SIZE, "
                         "MASTER_ADDR, MASTER_PORT unset); run torchrun --nproc-per-node N -m dtlib train ...")
    if args.max_failures is not None and launcher != "ray":
        raise ValueError(f"--max-failures is Ray Train's FailureConfig: use it with --launcher ray "
                         f"(torchrun restarts with its own --max-restarts), not --launcher {launcher}")
    if launcher == "ray" and args.backend == "nccl":
        raise ValueError("--backend nccl: --launcher ray starts CPU workers over gloo (ScalingConfig "
                         "use_gpu=False); use --backend auto or gloo")


def _import_ray_train() -> Any:
    """:mod:`dtlib.frameworks.ray_train`, or a one-line error saying how to install Ray Train."""
    from dtlib.extras import require

    require("frameworks", "ray", feature="dtlib train --launcher ray")
    from dtlib.frameworks import ray_train

    return ray_train


def config_from_args(args: Any) -> "TrainConfig":
    """A :class:`~dtlib.trainer.TrainConfig` from parsed ``dtlib train`` arguments (same names)."""
    from dtlib.trainer import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})


def header(summary: dict[str, Any]) -> str:
    """What ran: the model, the steps, the layout on how many ranks, the backend."""
    m, layout = summary["model"], summary["layout"]
    sizes = " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if k in layout)
    steps = len(summary["losses"])
    first = summary.get("first_step", 0)
    return (f"TinyGPT ({m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, "
            f"{m['parameters']:,} parameters), {steps} step{'s' * (steps != 1)}"
            + (f" from step {first + 1}" if first else "")
            + f" of {summary['global_batch']} sequences x {m['seq']} tokens on {summary['world_size']} "
            f"rank{'s' * (summary['world_size'] != 1)} ({sizes}), backend {summary['backend']}")


def summary_text(summary: dict[str, Any], as_json: bool) -> str:
    """What ``dtlib train`` prints on rank 0: one JSON object, or the losses, throughput and hash."""
    if as_json:
        return json.dumps({k: v for k, v in summary.items() if k != "params"})
    lines = [header(summary)]
    lines += [f"step {i + 1:4d}  loss {loss:.4f}" for i, loss in enumerate(summary["losses"])]
    if summary["tokens_per_s"] is not None:
        lines.append(f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}% of "
                     f"{summary['mfu_peak']}")
    lines.append(f"params_sha256 {summary['params_sha256']}")
    if "profile" in summary:
        from dtlib.profile import Finding, format_summary

        profile = summary["profile"]
        lines.append("profile (ms per step of the profiled steps; traces in --profile DIR):")
        lines.append(format_summary(profile, [Finding(**f) for f in profile["findings"]]))
    return "\n".join(lines)
