"""Worker for tests/test_resume.py: dp training with dropout and AdamW that checkpoints every
step, resumes from the last checkpoint, and can kill itself or hang on request.

Under torchrun: argv OUTDIR STEPS [--kill-rank R --kill-step S [--kill-agent]] [--hang-rank R --hang-step S
--heartbeat T]; the kill happens on the first attempt (TORCHELASTIC_RESTART_COUNT=0), the hang on
the second. From dtlib.launch: ``train(rank, world_size, options)``. Rank 0 writes
OUTDIR/result.json: the sha256 of the final parameters, the batches the last attempt used, the world.
"""
import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

from dtlib.launcher import run_from_env
from dtlib.resilience.checkpoint import Checkpointer
from dtlib.resilience.elastic import describe_restart, num_microbatches_for, restart_count

GLOBAL_BATCH, MICRO = 8, 2


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("steps", type=int)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--heartbeat", type=float, default=0.0)
    p.add_argument("--kill-agent", action="store_true", help="kill the torchrun agent (a whole node) too")
    return p.parse_args(argv)


def train(rank: int, world_size: int, a: argparse.Namespace) -> None:
    attempt = restart_count()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # each rank's own dropout stream: restored from the checkpoint
    ck = Checkpointer(os.path.join(a.outdir, "ck"), keep_last=2)
    info = ck.load(model, opt)
    step = info["step"] if info else 0
    if info:
        print(describe_restart(info["layout"]["world_size"], world_size, GLOBAL_BATCH, MICRO, step), flush=True)
    monitor = None
    if a.heartbeat:
        from dtlib.resilience.heartbeat import Heartbeat
        monitor = Heartbeat(timeout=a.heartbeat, interval=0.1).start()
    seen = []
    accumulate = num_microbatches_for(GLOBAL_BATCH, MICRO, world_size)
    while step < a.steps:
        if attempt == 0 and rank == a.kill_rank and step == a.kill_step:
            if a.kill_agent:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if monitor:
            monitor.beat(step, "data")
        if attempt == 1 and rank == a.hang_rank and step == a.hang_step:
            while True:  # a stuck data loader: no collective, no progress
                time.sleep(0.01)
        x, y = batch(step)
        seen.append(step)
        rows = GLOBAL_BATCH // world_size
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        if monitor:
            monitor.beat(step, "forward-backward")
        for mx, my in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (nn.functional.cross_entropy(model(mx), my) / accumulate).backward()
        if monitor:
            monitor.beat(step, "all_reduce")
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world_size
        opt.step()
        opt.zero_grad()
        step += 1
        if monitor:
            monitor.beat(step, "checkpoint")
        ck.save(step, model, opt, data_position=step)
    ck.close()
    if monitor:
        monitor.stop()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    if rank == 0:
        with open(os.path.join(a.outdir, "result.json"), "w") as f:
            json.dump({"params_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                       "steps_seen_last_attempt": seen, "world_size": world_size,
                       "restart_count": attempt}, f)


if __name__ == "__main__":
    run_from_env(train, options(), backend="gloo", timeout=30)
