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
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dtlib.experiments.resilience import checkpoint_blocking, hang_detection  # noqa: E402


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
    r = checkpoint_blocking(mib, repeats, a.ranks)
    sync, asyn = r["sync_seconds"], r["async_seconds"]
    print(f"checkpoint of {mib:.0f} MiB per rank on {a.ranks} ranks, median of {repeats} saves (slowest rank):")
    print(f"  synchronous  dcp.save          blocks {sync * 1e3:8.1f} ms")
    print(f"  asynchronous dcp.async_save    blocks {asyn * 1e3:8.1f} ms  ({asyn / sync:.2f} x sync), "
          f"published after {r['async_published_seconds'] * 1e3:.1f} ms")
    h = hang_detection(a.heartbeat, a.ranks, a.collective_timeout)
    print(f"heartbeat (timeout {a.heartbeat:.1f} s, interval 0.1 s): hung rank named after "
          f"{h['seconds']:.2f} s; the collective timeout would have fired after {a.collective_timeout:.0f} s "
          f"({a.collective_timeout / h['seconds']:.0f} x later), without naming the rank")


if __name__ == "__main__":
    main()
