"""Worker for tests/test_launcher.py: the same per-rank code that dtlib.launch runs, under torchrun."""
import json
import os
import sys

import torch
import torch.distributed as dist

from dtlib.launcher import run_from_env


def worker(rank: int, world_size: int, outdir: str) -> None:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "sum": t.item(),
                   "local_rank": int(os.environ["LOCAL_RANK"])}, f)


if __name__ == "__main__":
    run_from_env(worker, sys.argv[1], timeout=60)
