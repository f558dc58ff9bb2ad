"""Restarts under torchrun: the command, its environment, and what changes when the world shrinks.

``torchrun --max-restarts R`` (torchelastic) restarts the whole worker group when one worker dies;
``--nnodes=MIN:MAX`` lets the group come back with fewer agents (nodes) when one is gone. Each
attempt starts the script from the top: it must find the last checkpoint itself
(:class:`~dtlib.resilience.checkpoint.Checkpointer.load`), and, if the world shrank, keep the global
batch by accumulating more micro-batches per step (:func:`num_microbatches_for`).

Why :func:`torchrun_env` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default the workers
share the rendezvous' TCP store, and on gloo a restarted group can reach the previous attempt's
keys (``Gloo connectFullMesh failed ... Connection refused``, pytorch issue #135712); with a fresh
store per attempt every restart was clean (12 of 12 on this machine, see
``/work/shared/notes/pytorch-on-cpu.md``).
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from dtlib.analytic import validate

__all__ = ["torchrun_env", "torchrun_command", "restart_count", "num_microbatches_for", "describe_restart"]


def torchrun_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with what dtlib's torchrun jobs need: a fresh worker
    store per restart (see the module docstring) and one OpenMP thread per rank (ranks share cores)."""
    out = dict(os.environ if env is None else env)
    out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def torchrun_command(script: str, args: Sequence[str] = (), nproc_per_node: int = 2, max_restarts: int = 0,
                     nnodes: str = "1", rdzv_endpoint: str | None = None, rdzv_id: str = "dtlib",
                     monitor_interval: float = 0.5, module: bool = False) -> list[str]:
    """The argv of ``torchrun`` (as ``python -m torch.distributed.run``) for ``script args``
    (``module=True``: ``script`` is a module, e.g. ``dtlib`` with args ``train ...``, run as ``-m``).

    ``nnodes`` is ``"N"`` or ``"MIN:MAX"`` (elastic); with ``rdzv_endpoint`` ("host:port") the
    c10d rendezvous is used (needed for several agents), otherwise ``--standalone``."""
    validate.integer("nproc_per_node", nproc_per_node, minimum=1)
    validate.integer("max_restarts", max_restarts, minimum=0)
    validate.number("monitor_interval", monitor_interval)
    parts = str(nnodes).split(":")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
        raise ValueError(f"nnodes must be 'N' or 'MIN:MAX' with 1 <= MIN <= MAX, got {nnodes!r}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
           f"--monitor-interval={monitor_interval}"]
    if rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    if module:
        cmd.append("--module")
    return cmd + [script, *args]


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def num_microbatches_for(global_batch: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per step that keep ``global_batch`` on ``dp`` data-parallel ranks
    (global_batch = dp x micro_batch_size x num_microbatches, Megatron's names)."""
    validate.integer("global_batch", global_batch)
    validate.integer("micro_batch_size", micro_batch_size)
    validate.integer("dp", dp)
    if global_batch % (micro_batch_size * dp):
        raise ValueError(f"global_batch={global_batch} is not a multiple of micro_batch_size x dp = "
                         f"{micro_batch_size} x {dp}: choose a micro_batch_size that divides "
                         f"{global_batch // dp if global_batch % dp == 0 else 'global_batch / dp'}")
    return global_batch // (micro_batch_size * dp)


def describe_restart(saved_world: int, world: int, global_batch: int, micro_batch_size: int, step: int) -> str:
    """The log line of a restart: where it resumes and what changed."""
    before = num_microbatches_for(global_batch, micro_batch_size, saved_world)
    after = num_microbatches_for(global_batch, micro_batch_size, world)
    if saved_world == world:
        return f"resumed at step {step} on the same {world} ranks"
    return (f"resumed at step {step} on {world} ranks instead of {saved_world}: checkpoint resharded, "
            f"num_microbatches {before} -> {after} keeps the global batch of {global_batch}")
