"""How long a checkpoint stops training: synchronous vs asynchronous saves, and how fast the
heartbeat names a hung rank against the collective timeout.

    python benchmarks/bench_checkpoint.py [--quick] [--ranks 2] [--mib 64] [--repeats 5]

Each rank holds ``--mib`` MiB of parameters and AdamW state (a replicated model: DCP writes each
tensor once). Saves alternate between the two checkpointers (who goes first alternates), so
a noisy machine's drift hits both; the figure is the slowest rank's blocking time per save
(median) and the async/sync ratio. For the async saves, the time to the checkpoint being
published (written in the background) is shown too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dtlib.launcher import launch  # noqa: E402
from dtlib.resilience.checkpoint import Checkpointer  # noqa: E402
from dtlib.resilience.heartbeat import Heartbeat  # noqa: E402


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _saves(rank: int, world_size: int, mib: float, repeats: int, directory: str) -> dict:
    torch.manual_seed(0)
    width = int((mib * 2 ** 20 / 4 / 3) ** 0.5)  # params + exp_avg + exp_avg_sq = mib
    model = nn.Linear(width, width, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    makers = {"sync": Checkpointer(os.path.join(directory, "sync"), keep_last=1),
              "async": Checkpointer(os.path.join(directory, "async"), keep_last=1, async_save=True)}
    blocking = {k: [] for k in makers}
    published = []
    for i in range(repeats):
        order = list(makers) if i % 2 == 0 else list(reversed(makers))
        for kind in order:
            start = time.perf_counter()
            makers[kind].save(i + 1, model, opt)
            blocking[kind].append(_slowest(time.perf_counter() - start))
            if kind == "async":
                makers[kind].wait()  # the next save would wait for it anyway
                published.append(_slowest(time.perf_counter() - start))
    for c in makers.values():
        c.close()
    return {"blocking": {k: statistics.median(v) for k, v in blocking.items()},
            "async_published": statistics.median(published)}


def _hang(rank: int, world_size: int, timeout: float, outdir: str) -> None:
    def report(message: str) -> None:
        if rank == 1:
            with open(os.path.join(outdir, "detected"), "w") as f:
                f.write(f"{time.time()}\n{message}")
        os._exit(75)
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="16 MiB, 3 repeats")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat timeout (s)")
    p.add_argument("--collective-timeout", type=float, default=60.0)
    a = p.parse_args()
    mib, repeats = (16.0, 3) if a.quick else (a.mib, a.repeats)
    with tempfile.TemporaryDirectory() as d:
        r = launch(_saves, a.ranks, args=(mib, repeats, d), timeout=600)[0]
    sync, asyn = r["blocking"]["sync"], r["blocking"]["async"]
    print(f"checkpoint of {mib:.0f} MiB per rank on {a.ranks} ranks, median of {repeats} saves (slowest rank):")
    print(f"  synchronous  dcp.save          blocks {sync * 1e3:8.1f} ms")
    print(f"  asynchronous dcp.async_save    blocks {asyn * 1e3:8.1f} ms  ({asyn / sync:.2f} x sync), "
          f"published after {r['async_published'] * 1e3:.1f} ms")
    with tempfile.TemporaryDirectory() as d:
        try:
            launch(_hang, a.ranks, args=(a.heartbeat, d), timeout=a.collective_timeout)
        except Exception:
            pass  # the abort is the expected outcome
        detected = float(open(os.path.join(d, "detected")).read().split("\n")[0])
        hung = float(open(os.path.join(d, "hang")).read())
    print(f"heartbeat (timeout {a.heartbeat:.1f} s, interval 0.1 s): hung rank named after "
          f"{detected - hung:.2f} s; the collective timeout would have fired after {a.collective_timeout:.0f} s "
          f"({a.collective_timeout / (detected - hung):.0f} x later), without naming the rank")


if __name__ == "__main__":
    main()
