"""The training loop: :func:`train` (one rank, inside ``dtlib.launch`` or torchrun) and :func:`run`
(check, then launch every rank from this process).

Each step is :meth:`_Run.step <dtlib.trainer.rank._Run.step>` between the hooks'
``before_step``/``after_step`` (:mod:`dtlib.trainer.hooks`); the last steps run under
:func:`dtlib.profile.profile_steps` with ``profile``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dtlib.analytic.flops import step_flops, utilization
from dtlib.analytic.hardware import catalogue_name, get_gpu
from dtlib.launcher import launch
from dtlib.measure import measure_cpu
from dtlib.profile import profile_steps, report
from dtlib.resilience.heartbeat import Heartbeat
from dtlib import monitor as _monitor  # lesson 12
from dtlib.trainer.checkpoints import CheckpointHook, check_resume
from dtlib.trainer.config import TrainConfig
from dtlib.trainer.hooks import FaultDrill, Hook, MonitorHook, Progress, SampleLog
from dtlib.trainer.rank import _Run, params_sha256

__all__ = ["train", "run"]


def train(rank: int, world_size: int, config: TrainConfig, keep_params: bool = False,
          progress: bool = False, groups: dict[str, list[list[int]]] | None = None,
          extra_hooks: Sequence[Hook] = ()) -> dict[str, Any]:
    """Train ``config`` on this rank (inside ``dtlib.launch`` or torchrun; with one rank and no
    process group it also runs in the calling process). Rank 0 returns the run's summary:
    ``steps``, ``first_step`` (after ``resume``), ``losses`` (global mean per step run), ``tokens_per_s``, ``mfu``,
    ``mfu_peak`` (the peak the MFU divides by, in words), ``layout``, ``model`` (its shape), ``backend``,
    ``peak_memory_bytes`` (per rank, where measurable) and ``params_sha256``; with checkpoints
    ``resumed`` (what ``resume`` found) and ``checkpoint_blocking_s`` (per save); ``params`` too with
    ``keep_params``. Other ranks return ``{"rank": rank}``. ``groups`` replaces some of the
    layout's process groups (lists of ranks per kind, see :func:`~dtlib.parallel.mesh.build_groups`).
    ``extra_hooks``: a launcher's hooks, called after the checkpoint hook (so after each save),
    e.g. Ray Train's report of each checkpoint (:mod:`dtlib.frameworks.ray_train`)."""
    config.check(world_size)
    run = _Run(rank, config, groups)
    losses, seconds = [], []
    peak = _peak_flops(world_size) if rank == 0 else None  # measured before the ranks get busy
    tokens = config.global_batch * config.seq
    bar = Progress(config.steps, tokens, lambda s: _mfu(config, s, peak)) if progress and rank == 0 else None
    checkpoints = CheckpointHook(config) if config.checkpoint_dir else None
    resumed = None
    if config.resume:
        resumed = checkpoints.resume(run)
        if rank == 0:
            print(resumed, file=sys.stderr, flush=True)
    first = run.step_count
    heartbeat = None
    if config.heartbeat and run.distributed:
        heartbeat = Heartbeat(timeout=config.heartbeat, interval=min(1.0, config.heartbeat / 4)).start()
        run.beat = heartbeat.beat
    watch = _monitor.Monitor.for_run(run, rank, tokens)  # lesson 12: metrics, alerts, checksums (or None)
    # the order every rank calls them in (the monitor's checksums and the saves are collectives)
    hooks: list[Hook] = [FaultDrill(config, rank)]
    if watch is not None:
        hooks.append(MonitorHook(watch))
    # the tp, cp and pp ranks of a data-parallel replica train on the same rows: its first rank logs them
    owns_rows = run.coords["tp"] == 0 and run.coords["cp"] == 0 and run.coords["pp"] == 0
    if config.sample_log and run.stream is not None and owns_rows:
        hooks.append(SampleLog(config.sample_log, rank))
    if checkpoints is not None:
        hooks.append(checkpoints)
    hooks.extend(extra_hooks)
    if bar is not None:
        hooks.append(bar)

    def one_step() -> None:
        for hook in hooks:
            hook.before_step(run)
        start = time.perf_counter()
        losses.append(run.step())
        seconds.append(time.perf_counter() - start)
        for hook in hooks:
            hook.after_step(run, losses[-1], seconds[-1])

    # --profile: the last steps run under dtlib.profile (one warm-up that counts FLOPs, then up to 3)
    profiled = min(3, config.steps - first - 1) if config.profile else 0
    if config.profile and profiled < 1:
        raise ValueError(f"--profile needs 2 steps left to run, {config.steps - first} are")
    for _ in range(first, config.steps - profiled - (1 if profiled else 0)):
        one_step()
    profile = None
    if profiled:
        gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        # on a GPU the catalogue's peak of this GPU at the trainer's precision; on CPU, measured
        accelerator, _, dtype = _peak_flops(world_size) if gpu else (None, 1, "fp32")
        flops = step_flops(tokens, **config.model_config().numbers())["model"]
        mine = profile_steps(one_step, steps=profiled, warmup=1, trace_dir=config.profile, rank=rank,
                             peak=get_gpu(accelerator) if gpu else None, dtype=dtype,
                             model_flops=flops / world_size, tokens=tokens // world_size)
        ranks = [mine]
        if run.distributed:
            ranks = [None] * world_size
            dist.all_gather_object(ranks, mine)
        profile = report(ranks)
    for hook in hooks:
        hook.close()
    full = run.full_parameters()
    memory = [_peak_memory()]
    if run.distributed:
        memory = [None] * world_size
        dist.all_gather_object(memory, _peak_memory())
    if heartbeat is not None:
        heartbeat.stop()
    if run.stream is not None:
        run.stream.close()
    if rank != 0:
        return {"rank": rank}
    timed = seconds[1:] or seconds
    steady = sorted(timed)[len(timed) // 2] if timed else None  # median, first step aside
    out = {"steps": config.steps, "first_step": first, "losses": losses, "tokens_per_s": tokens / steady if steady else None,
           "mfu": _mfu(config, steady, peak) if steady else None, "mfu_peak": _peak_name(peak),
           "layout": asdict(config.layout()), "model": _model_summary(config),
           "backend": dist.get_backend() if run.distributed else "none (one process)",
           "world_size": world_size, "global_batch": config.global_batch,
           "peak_memory_bytes": memory, "params_sha256": params_sha256(full)}
    if resumed is not None:
        out["resumed"] = resumed
    if profile is not None:
        out["profile"] = {k: profile[k] for k in ("breakdown", "mfu", "hfu", "findings", "step_time",
                                                  "achieved_flops_per_rank", "tokens_per_second")}
    for hook in hooks:
        out.update(hook.summary())
    if run.stream is not None:
        out["samples_consumed"] = run.stream.consumed
    if keep_params:
        out["params"] = full
    return out


def _peak_memory() -> int | None:
    """Peak allocated device memory of this rank (CUDA only; CPU ranks share one heap)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def _peak_flops(world_size: int) -> tuple[Any, int, str]:
    """(accelerator, how many of it, dtype) the MFU divides by. On CUDA: the catalogue's entry for
    this GPU (:func:`dtlib.analytic.hardware.catalogue_name`; an H100 SXM for one it does not
    have), one per rank, at the precision the trainer computes in -- fp32, or tf32 when PyTorch
    lets float32 matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``). On CPU the ranks
    share one machine, whose fp32 matmul peak is measured here (:func:`dtlib.measure.measure_cpu`),
    counted once."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = catalogue_name(torch.cuda.get_device_name()) or "h100-sxm"
        return gpu, world_size, "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return measure_cpu(n=256, repeats=3, copy_bytes=2 ** 20), 1, "fp32"


def _peak_name(peak: tuple[Any, int, str]) -> str:
    """Which peak the MFU divides by, in words (``dtlib train`` prints "MFU x% of <this>")."""
    accelerator, count, dtype = peak
    if isinstance(accelerator, str):
        each = get_gpu(accelerator).peak(dtype)
        return f"{count} x {accelerator} {dtype} peak ({each / 1e12:,.1f} TFLOP/s each)"
    return (f"this CPU's measured {dtype} matmul peak ({accelerator.peak(dtype) / 1e9:,.1f} GFLOP/s, "
            "shared by all ranks)")


def _model_summary(config: TrainConfig) -> dict[str, Any]:
    model = config.model_config()
    return {"layers": model.layers, "hidden": model.hidden, "heads": model.heads, "seq": model.seq,
            "parameters": model.num_parameters()}


def _mfu(config: TrainConfig, step_seconds: float, peak: tuple[Any, int, str]) -> float:
    """Model FLOPs utilisation (Chowdhery et al. 2022, App. B): the model FLOPs of a step
    (:func:`dtlib.analytic.flops.step_flops`) over ``step_seconds`` x the peak."""
    flops = step_flops(config.global_batch * config.seq, **config.model_config().numbers())["model"]
    accelerator, count, dtype = peak
    return float(utilization(flops, step_seconds, count, accelerator, dtype))




def run(config: TrainConfig, backend: str = "auto", timeout: float = 600.0, progress: bool = False,
        keep_params: bool = False, output: str = "rank0") -> dict[str, Any]:
    """Check ``config`` (and the checkpoint it resumes from), start its ``world_size`` ranks with
    :func:`dtlib.launch` and return rank 0's summary (see :func:`train`). ``output`` as
    :func:`dtlib.launch`'s: ``"none"`` keeps the ranks' log lines (alerts, drills, the profiler's
    own messages) out of a notebook that prints what it needs from the summary."""
    config.check()
    check_resume(config)
    if config.kill_agent:  # the parent of a dtlib.launch rank is this process, not an agent
        raise ValueError("--kill-agent kills a torchrun agent: start the run with torchrun")
    return launch(train, config.world_size, args=(config, keep_params, progress), backend=backend,
                  timeout=timeout, output=output)[0]
