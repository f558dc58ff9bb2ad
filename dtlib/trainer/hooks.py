"""What runs around each step besides the step itself, behind one small interface (:class:`Hook`):
the fault drill that kills a rank, the monitor (metrics, alerts, checksums), the sample log, the
progress bar -- and the checkpoints (:class:`dtlib.trainer.checkpoints.CheckpointHook`).

The loop (:func:`dtlib.trainer.train`) calls every hook's :meth:`~Hook.before_step` and
:meth:`~Hook.after_step` in a fixed order on every rank (some are collectives), :meth:`~Hook.close`
once after the last step, and merges the hooks' :meth:`~Hook.summary` into rank 0's summary.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable

from tqdm.auto import tqdm

from dtlib.resilience.elastic import restart_count
from dtlib import monitor as _monitor, streaming as _streaming  # lesson 12

__all__ = ["Hook", "FaultDrill", "MonitorHook", "SampleLog", "Progress"]


class Hook:
    """A per-step hook; every method is optional (the defaults do nothing). ``run`` is the rank's
    :class:`~dtlib.trainer.rank._Run` (``step_count`` counts the steps done)."""

    def before_step(self, run: Any) -> None:
        """At the start of step ``run.step_count``."""

    def after_step(self, run: Any, loss: float, seconds: float) -> None:
        """After the update of step ``run.step_count - 1``: its global loss and wall time."""

    def close(self) -> None:
        """After the last step, before the final parameters are gathered."""

    def summary(self) -> dict[str, Any]:
        """What this hook adds to rank 0's summary."""
        return {}


class FaultDrill(Hook):
    """``kill_step``: rank ``kill_rank`` SIGKILLs itself (and its torchrun agent with
    ``kill_agent``: a lost node) at the start of that step, on torchrun's first attempt only."""

    def __init__(self, config: Any, rank: int):
        self.config, self.rank = config, rank

    def before_step(self, run: Any) -> None:
        c = self.config
        if c.kill_step == run.step_count and self.rank == run.kill_rank and restart_count() == 0:
            what = "its torchrun agent and itself" if c.kill_agent else "itself"
            print(f"fault drill: rank {self.rank} SIGKILLs {what} at step {run.step_count}", file=sys.stderr, flush=True)
            if c.kill_agent:  # the whole node is lost: torchrun --nnodes=MIN:MAX goes on without it
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class MonitorHook(Hook):
    """Lesson 12's :class:`dtlib.monitor.Monitor`: metrics, alerts, checksums, the bit-flip drill
    (its gradient-norm hook runs inside the step, between gradient sync and update)."""

    def __init__(self, watch: _monitor.Monitor):
        self.watch = watch

    def after_step(self, run: Any, loss: float, seconds: float) -> None:
        self.watch.after_step(run.step_count - 1, loss, seconds, run.params, run.grad_norm)

    def close(self) -> None:
        self.watch.close()

    def summary(self) -> dict[str, Any]:
        return self.watch.summary()


class SampleLog(Hook):
    """A data-parallel replica's first rank (tp, cp and pp rank 0) appends the sample ids the
    replica trained on to ``sample_log`` (lesson 12's exactly-once audit,
    :func:`dtlib.streaming.log_samples`): its other ranks see the same rows, logged once."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank

    def after_step(self, run: Any, loss: float, seconds: float) -> None:
        _streaming.log_samples(self.directory, self.rank, run.step_count - 1, run.sample_ids)


class Progress(Hook):
    """A tqdm bar on stderr (rank 0): loss, tokens/s and MFU (``mfu(seconds)``) of each step."""

    def __init__(self, steps: int, tokens_per_step: int, mfu: Callable[[float], float]):
        self.bar = tqdm(total=steps, desc="dtlib train", file=sys.stderr)
        self.tokens, self.mfu = tokens_per_step, mfu

    def after_step(self, run: Any, loss: float, seconds: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{self.tokens / seconds:,.0f}",
                             mfu=f"{100 * self.mfu(seconds):.2f}%")
        self.bar.update()

    def close(self) -> None:
        self.bar.close()
