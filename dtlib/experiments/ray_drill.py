"""Lesson 13's Ray Train failure drill: ``dtlib train`` as a Ray Train job whose rank 1 dies at step
3, restarted by ``FailureConfig(max_failures=1)`` from dtlib's checkpoint, next to the same run
without a failure under ``dtlib.launch``.

Ray's start, a restart and a report after every step take from tens of seconds to minutes on a
2-core machine, so the lesson reads a recorded drill (``notebooks/recorded/ray_failure_drill.json``,
written by ``python -m dtlib.experiments.ray_drill OUT.json``) unless asked to run it.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

__all__ = ["CONFIG", "ray_failure_drill"]

# the trainer tests' small TinyGPT with AdamW: a resume must restore the moments too
CONFIG = dict(layers=2, hidden=32, heads=4, seq=16, steps=5, micro_batch_size=2, optimizer="adamw", lr=1e-2, dp=2)
_DRILL = dict(checkpoint_every=2, resume=True, kill_step=3)
_KEEP = ("attempts", "restarts", "ray_resumed_from", "first_step", "losses", "params_sha256", "launcher")


def ray_failure_drill(work: str | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """Run the drill in ``work`` (default: a new temporary directory): the uninterrupted run under
    ``dtlib.launch`` first (it forks its ranks, which must happen before Ray starts threads in this
    process), then the Ray Train job. Returns ``ray`` (its summary: attempts, restarts, the step Ray
    resumed from, losses, ``params_sha256``), ``uninterrupted`` (losses, ``params_sha256``),
    ``seconds`` (the Ray job's wall time), ``versions`` and ``command``."""
    import ray
    import torch

    from dtlib.frameworks.ray_train import run_ray
    from dtlib.trainer import TrainConfig, run

    work = work or tempfile.mkdtemp(prefix="dtlib-ray-drill-")
    config = TrainConfig(**CONFIG)
    straight = run(config, timeout=timeout)
    start = time.perf_counter()
    drill = run_ray(config.with_(checkpoint_dir=os.path.join(work, "ckpt"), **_DRILL), max_failures=1,
                    timeout=timeout)
    seconds = time.perf_counter() - start
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in CONFIG.items())
    return {"command": f"dtlib train --launcher ray {flags} --checkpoint-dir ckpt --checkpoint-every 2 --resume "
                       "--kill-step 3, with FailureConfig(max_failures=1)",
            "ray": {k: drill.get(k) for k in _KEEP},
            "uninterrupted": {"launcher": "dtlib.launch", "losses": straight["losses"],
                              "params_sha256": straight["params_sha256"]},
            "seconds": round(seconds, 1), "versions": {"ray": ray.__version__, "torch": torch.__version__},
            "recorded": time.strftime("%Y-%m-%d", time.gmtime())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dtlib.experiments.ray_drill OUT.json")
    with open(sys.argv[1], "w") as f:
        json.dump(ray_failure_drill(), f, indent=1)
