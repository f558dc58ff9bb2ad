"""What lesson 08 runs on real ranks: a training run that can be killed and resumed, a checkpoint
resharded across layouts, sync vs async checkpoint time, a hang caught by the heartbeat.

``python -m dtlib.experiments.resilience OUTDIR STEPS [--kill-rank R --kill-step S [--kill-agent]]
[--hang-rank R --hang-step S --heartbeat T]`` runs :func:`train_drill` under torchrun (the kill
on the first attempt, the hang on the second: ``TORCHELASTIC_RESTART_COUNT``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlib.launcher import RankFailedError, launch, run_from_env
from dtlib.resilience.checkpoint import Checkpointer, to_torch
from dtlib.resilience.elastic import describe_restart, num_microbatches_for, restart_count
from dtlib.resilience.heartbeat import EXIT_CODE, Heartbeat

__all__ = ["GLOBAL_BATCH", "MICRO_BATCH_SIZE", "drill_batch", "train_drill", "kill_and_resume", "failure_line",
           "reshard", "checkpoint_blocking", "hang_detection", "main"]

GLOBAL_BATCH, MICRO_BATCH_SIZE = 8, 2


def drill_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch number ``index`` (the data position is this index)."""
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def drill_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def params_sha256(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def train_drill(rank: int, world_size: int, outdir: str, steps: int, kill_rank: int = -1, kill_step: int = -1,
                hang_rank: int = -1, hang_step: int = -1, heartbeat: float = 0.0, kill_agent: bool = False,
                attempt: int | None = None) -> dict[str, Any] | None:
    """Data-parallel training with dropout and AdamW that checkpoints every step into
    ``outdir/ck`` and resumes from it. On attempt 0 rank ``kill_rank`` SIGKILLs itself (and its
    torchrun agent with ``kill_agent``) at ``kill_step``; on attempt 1 rank ``hang_rank`` hangs in
    its data phase at ``hang_step`` (the heartbeat, if ``heartbeat`` > 0 seconds, aborts the job).
    Rank 0 returns (and writes ``outdir/result.json``) the parameters' sha256, the batches this
    attempt used and the world size."""
    attempt = restart_count() if attempt is None else attempt
    model = drill_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # each rank's own dropout stream: restored from the checkpoint
    ck = Checkpointer(os.path.join(outdir, "ck"), keep_last=2)
    info = ck.load(model, opt)
    step = info["step"] if info else 0
    log = []
    if info:
        log.append(describe_restart(info["layout"]["world_size"], world_size, GLOBAL_BATCH, MICRO_BATCH_SIZE, step))
        print(log[-1], flush=True)
    monitor = Heartbeat(timeout=heartbeat, interval=0.1).start() if heartbeat else None
    beat = monitor.beat if monitor else (lambda step, phase: None)
    accumulate = num_microbatches_for(GLOBAL_BATCH, MICRO_BATCH_SIZE, world_size)
    rows = GLOBAL_BATCH // world_size
    seen = []
    while step < steps:
        if attempt == 0 and rank == kill_rank and step == kill_step:
            if kill_agent:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        beat(step, "data")
        if attempt == 1 and rank == hang_rank and step == hang_step:
            while True:  # a stuck data loader: no collective, no progress
                time.sleep(0.01)
        x, y = drill_batch(step)
        seen.append(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        beat(step, "forward-backward")
        for mx, my in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (nn.functional.cross_entropy(model(mx), my) / accumulate).backward()
        beat(step, "all_reduce")
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
        opt.zero_grad()
        step += 1
        beat(step, "checkpoint")
        ck.save(step, model, opt, data_position=step)
    ck.close()
    if monitor:
        monitor.stop()
    if rank != 0:
        return None
    result = {"params_sha256": params_sha256(model), "steps_seen": seen, "world_size": world_size,
              "restart_count": attempt, "log": log}
    with open(os.path.join(outdir, "result.json"), "w") as f:
        json.dump(result, f)
    return result


def kill_and_resume(directory: str, steps: int = 6, kill_step: int = 3, world_size: int = 2) -> dict[str, Any]:
    """The drill with ``dtlib.launch``: an uninterrupted run; a run whose rank 1 is SIGKILLed at
    ``kill_step``; the same job launched again, which resumes from the last checkpoint."""
    # the ranks print nothing (output="none"): each run's log comes back, in the order it happened
    straight = launch(train_drill, world_size, args=(os.path.join(directory, "straight"), steps), timeout=120,
                      output="none")[0]
    killed_dir = os.path.join(directory, "killed")
    try:
        launch(train_drill, world_size, args=(killed_dir, steps, 1, kill_step), timeout=120, output="none")
        failure = "no failure"
    except RankFailedError as e:  # the first error reported: the killed rank, or a peer it left behind
        failure = f"rank 1 SIGKILLed at step {kill_step}; the launcher reports: {failure_line(e)}"
    resumed = launch(_resume, world_size, args=(killed_dir, steps), timeout=120,  # "torchrun restarts it"
                     output="none")
    return {"straight": straight, "failure": failure, "resumed": resumed[0]}


def failure_line(error: RankFailedError) -> str:
    """The first sentence of the launcher's first line, whole words only, with the source paths
    gloo puts in its messages shortened to the file (``[/__w/pytorch/.../tcp/pair.cc:534]`` ->
    ``[pair.cc:534]``); " …" when more followed (gloo's advice to check the remote worker)."""
    line = re.sub(r"\[/\S*/([^/\s\]]+:\d+)\]", r"[\1]", str(error).splitlines()[0])
    first, dot, rest = line.partition(". ")
    return f"{first}. …" if dot and rest.strip() else line


def _resume(rank: int, world_size: int, outdir: str, steps: int) -> dict[str, Any] | None:
    """The restarted attempt (torchrun would set TORCHELASTIC_RESTART_COUNT=1)."""
    return train_drill(rank, world_size, outdir, steps, attempt=1)


def _fsdp_save_or_load(rank: int, world_size: int, source: str | None, target: str, steps: int) -> int:
    from dtlib.parallel import FSDP
    model = FSDP(drill_model(), unit_types=(nn.Linear,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if source is None:
        for step in range(steps):
            x, y = drill_batch(step)
            rows = GLOBAL_BATCH // world_size
            nn.functional.cross_entropy(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
            opt.step()
            opt.zero_grad()
    else:
        steps = Checkpointer(source).load(model, opt)["step"]
    Checkpointer(target).save(steps, model, opt, data_position=steps)
    return sum(p.numel() for p in model.parameters())


def reshard(directory: str, steps: int = 2) -> dict[str, Any]:
    """FSDP on 4 ranks trains and saves; FSDP on 2 ranks loads it and saves again; one process
    converts both to full tensors. Returns elements held per rank and the largest difference."""
    four, two = os.path.join(directory, "fsdp4"), os.path.join(directory, "fsdp2")
    held4 = launch(_fsdp_save_or_load, 4, args=(None, four, steps), timeout=120)
    held2 = launch(_fsdp_save_or_load, 2, args=(four, two, steps), timeout=120)
    a = to_torch(four, os.path.join(directory, "fsdp4.pt"))
    b = to_torch(two, os.path.join(directory, "fsdp2.pt"))
    diff = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    diff = max([diff] + [(a["optimizer"][k]["exp_avg"] - b["optimizer"][k]["exp_avg"]).abs().max().item()
                         for k in a["optimizer"]])
    return {"held_per_rank_4": held4, "held_per_rank_2": held2, "max_difference": diff,
            "parameters": sum(t.numel() for t in a["model"].values()), "step": b["step"]}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _blocking(rank: int, world_size: int, mib: float, repeats: int, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    width = int((mib * 2 ** 20 / 4 / 3) ** 0.5)  # parameters + AdamW's exp_avg and exp_avg_sq = mib
    model = nn.Linear(width, width, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    makers = {"sync": Checkpointer(os.path.join(directory, "sync"), keep_last=1),
              "async": Checkpointer(os.path.join(directory, "async"), keep_last=1, async_save=True)}
    blocking: dict[str, list[float]] = {k: [] for k in makers}
    published = []
    for i in range(repeats):
        for kind in (list(makers) if i % 2 == 0 else list(reversed(makers))):  # who goes first alternates
            start = time.perf_counter()
            makers[kind].save(i + 1, model, opt)
            blocking[kind].append(_slowest(time.perf_counter() - start))
            if kind == "async":
                makers[kind].wait()
                published.append(_slowest(time.perf_counter() - start))
    for c in makers.values():
        c.close()
    return {"sync_seconds": statistics.median(blocking["sync"]), "async_seconds": statistics.median(blocking["async"]),
            "async_published_seconds": statistics.median(published)}


def checkpoint_blocking(mib: float = 16.0, repeats: int = 3, world_size: int = 2) -> dict[str, Any]:
    """Median time a save blocks the slowest rank, synchronous (``dcp.save``) vs asynchronous
    (``dcp.async_save``), for ``mib`` MiB of parameters and AdamW state per rank."""
    with tempfile.TemporaryDirectory() as d:
        return launch(_blocking, world_size, args=(mib, repeats, d), timeout=600)[0]


def _hang(rank: int, world_size: int, timeout: float, outdir: str) -> None:
    def report(message: str) -> None:
        if rank == 1:  # the hung rank: its main thread is stuck, only its watchdog can report
            with open(os.path.join(outdir, "detected"), "w") as f:
                f.write(f"{time.time()}\n{message}")
        os._exit(EXIT_CODE)
    hb = Heartbeat(timeout=timeout, interval=0.1, on_hang=report).start()
    for step in range(100):
        hb.beat(step, "data")
        if rank == 1 and step == 2:
            with open(os.path.join(outdir, "hang"), "w") as f:
                f.write(str(time.time()))
            while True:
                time.sleep(0.01)
        hb.beat(step, "all_reduce")
        dist.all_reduce(torch.ones(1))


def hang_detection(timeout: float = 2.0, world_size: int = 2, collective_timeout: float = 60.0) -> dict[str, Any]:
    """Rank 1 hangs in its data phase at step 2: seconds until the heartbeat names it, and its message."""
    with tempfile.TemporaryDirectory() as d:
        try:
            launch(_hang, world_size, args=(timeout, d), timeout=collective_timeout)
        except RankFailedError:
            pass  # the abort is the expected outcome
        detected, message = open(os.path.join(d, "detected")).read().split("\n", 1)
        hung = float(open(os.path.join(d, "hang")).read())
    return {"seconds": float(detected) - hung, "message": message, "collective_timeout": collective_timeout}


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dtlib.experiments.resilience")
    p.add_argument("outdir")
    p.add_argument("steps", type=int)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-agent", action="store_true", help="kill the torchrun agent (a whole node) too")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--heartbeat", type=float, default=0.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = options(argv)
    run_from_env(train_drill, a.outdir, a.steps, a.kill_rank, a.kill_step, a.hang_rank, a.hang_step,
                 a.heartbeat, a.kill_agent, backend="gloo", timeout=30)


if __name__ == "__main__":
    main()
