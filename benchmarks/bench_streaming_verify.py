"""What verifying stream shards against index.json costs: one shard's first open with and without
its sha256 check, next to reading every sample of it (what training does with the shard).

    python benchmarks/bench_streaming_verify.py [--mb 64] [--seq 2048]

:class:`dtlib.streaming.ShardedTokens` hashes a shard once, when a rank first opens it (lazily);
the cost is one sequential read of the file at the hashing rate, paid once per shard per rank.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from dtlib.streaming import ShardedTokens, write_shards


def _seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="shard size in MB")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    samples = args.mb * 2 ** 20 // (args.seq + 1)
    tokens = np.random.default_rng(0).integers(0, 256, samples * args.seq + 1, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as d:
        write_shards(d, tokens, args.seq, samples_per_shard=samples)  # one shard
        ids = list(range(samples))

        def first_open(verify: bool) -> None:
            ShardedTokens(d, verify=verify).read([0])

        verified, plain = _seconds(lambda: first_open(True)), _seconds(lambda: first_open(False))
        read_all = _seconds(lambda: ShardedTokens(d, verify=False).read(ids))
        size = samples * (args.seq + 1) / 1e6
        print(f"shard of {size:.0f} MB ({samples} samples of {args.seq + 1} tokens), file in the page cache:")
        print(f"  first open, verified : {1e3 * verified:8.1f} ms  (sha256 at {size / (verified - plain) / 1e3:.2f} GB/s)")
        print(f"  first open, unchecked: {1e3 * plain:8.1f} ms")
        print(f"  reading every sample : {1e3 * read_all:8.1f} ms")


if __name__ == "__main__":
    main()
