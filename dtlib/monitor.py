"""Monitoring a training run: metrics to JSON lines and TensorBoard, loss-spike and gradient-norm
alerts, cross-replica checksums (:mod:`dtlib.resilience.integrity`) and a bit-flip drill.

What a large run watches (the OPT-175B logbook, Zhang et al. 2022, and the Llama 3 paper, Sec. 3.3.4,
restarted from checkpoints after loss spikes and gradient-norm explosions; PaLM, Chowdhery et al.
2022, Sec. 5.1, skipped the batches around a spike): the loss and the global gradient norm each step,
compared with their recent past. An alert here is a line on stderr and a record in the summary;
what to do about it (skip batches, roll back, lower the learning rate) stays the operator's call.

:class:`Monitor` is what :func:`dtlib.trainer.train` drives: every rank calls :meth:`gradients`
between the gradient synchronisation and the optimizer step (the drill), the run measures the
global gradient norm there with :func:`dtlib.parallel.clip.grad_norm` (a collective; the same
function ``--clip-grad`` clips with), and every rank calls :meth:`after_step` after the update (a
collective on checksum steps); rank 0 writes the files.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

import json
import math
import os
import sys
from statistics import median
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dtlib.analytic import validate
from dtlib.resilience.integrity import flip_bit, replica_report

__all__ = ["Alarm", "Monitor", "check_options", "read_metrics", "SPIKE"]

SPIKE = 1000.0  # what --spike-step multiplies the gradients by


class Alarm:
    """Flag a value above ``factor`` x the median of the previous ``window`` values (once at least
    ``warmup`` are known). The median, not the mean: one earlier spike does not raise the bar."""

    def __init__(self, name: str, factor: float, window: int = 10, warmup: int = 3):
        self.name = name
        self.factor = validate.number("factor", factor, minimum=1)
        self.window = validate.integer("window", window)
        self.warmup = validate.integer("warmup", warmup)
        self.history: list[float] = []

    def __call__(self, value: float) -> str | None:
        """The alert line for ``value``, or None; ``value`` joins the history either way."""
        past = self.history[-self.window:]
        self.history.append(value)
        if len(past) < self.warmup:
            return None
        base = median(past)
        if not math.isfinite(value) or value > self.factor * base:
            return f"{self.name} {value:.4g} > {self.factor:g} x the median {base:.4g} of the last {len(past)} steps"
        return None


def check_options(config: Any, world_size: int) -> None:
    """One-line ValueErrors for the monitoring options of a :class:`~dtlib.trainer.TrainConfig`."""
    c = config
    validate.integer("checksum_every", c.checksum_every, minimum=0)
    if c.checksum_every and c.zero == 3:
        raise ValueError("--checksum-every compares replicas that hold the same parameters; --zero 3 "
                         "(FSDP) shards them over the data-parallel ranks: use --zero 0-2")
    if c.flip_bit_step is not None:
        validate.integer("flip_bit_step", c.flip_bit_step, minimum=0, maximum=c.steps - 1)
    if c.flip_bit_rank is not None:
        validate.integer("flip_bit_rank", c.flip_bit_rank, minimum=0, maximum=world_size - 1)
        if c.flip_bit_step is None:
            raise ValueError("--flip-bit-rank needs --flip-bit-step (the step after which the bit flips)")
    if c.spike_step is not None:
        validate.integer("spike_step", c.spike_step, minimum=0, maximum=c.steps - 1)
        if c.zero == 2:
            raise ValueError("--spike-step scales the gradients before the optimizer step; --zero 2 has "
                             "already reduce-scattered them: use --zero 0, 1 or 3")
    validate.number("loss_spike_factor", c.loss_spike_factor, minimum=1)
    validate.number("grad_norm_factor", c.grad_norm_factor, minimum=1)


class Monitor:
    """One rank's monitoring of a :class:`~dtlib.trainer.TrainConfig` run (see the module doc).

    ``replica_key``: what ranks holding the same parameters share (their tp/pp/ep coordinates)."""

    def __init__(self, config: Any, rank: int, replica_key: Any, tokens_per_step: int):
        c = config
        self.config, self.rank, self.key = c, rank, replica_key
        self.tokens = tokens_per_step
        self.distributed = dist.is_available() and dist.is_initialized()
        self.loss_alarm = Alarm("loss", c.loss_spike_factor)
        self.grad_alarm = Alarm("grad_norm", c.grad_norm_factor)
        self.alerts: list[dict[str, Any]] = []
        self.integrity: list[dict[str, Any]] = []
        self.flip_rank = (dist.get_world_size() - 1 if self.distributed else 0) if c.flip_bit_rank is None \
            else c.flip_bit_rank
        self.file = self.writer = None
        if rank == 0 and c.metrics:
            os.makedirs(os.path.dirname(os.path.abspath(c.metrics)), exist_ok=True)
            self.file = open(c.metrics, "a")
        if rank == 0 and c.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self.writer = SummaryWriter(log_dir=c.tensorboard)

    @classmethod
    def for_run(cls, run: Any, rank: int, tokens_per_step: int) -> "Monitor | None":
        """The monitor of a trainer's ``_Run`` if any monitoring option is on (None otherwise): it
        asks the run for the gradient norm of every step and installs the gradient drill."""
        c = run.config
        if not (c.metrics or c.tensorboard or c.checksum_every or c.flip_bit_step is not None
                or c.spike_step is not None):
            return None
        key = (run.coords["tp"], run.coords["pp"], run.coords["ep"] if c.ep > 1 else 0)
        m = cls(c, rank, key, tokens_per_step)
        run.measure_grad_norm = True
        run.on_gradients = lambda r: m.gradients(r.params, r.step_count)
        return m

    def gradients(self, params: Sequence[torch.Tensor], step: int | None = None) -> None:
        """Between the gradient synchronisation and the norm: the ``spike_step`` drill. The norm
        itself is the run's (:func:`dtlib.parallel.clip.grad_norm`, the one the clipping uses: the
        whole model's gradient, each element counted once whatever the layout -- a tied embedding
        on two pipeline stages once, TP-replicated weights once, shards once each)."""
        if self.config.spike_step is not None and step == self.config.spike_step:
            # the drill, on every rank alike (replicas stay equal): a gradient explosion, as a bad
            # batch or a too-high learning rate makes one
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(SPIKE)
            if self.rank == 0:
                print(f"fault drill: gradients x {SPIKE:g} at step {step}", file=sys.stderr, flush=True)

    def after_step(self, step: int, loss: float, seconds: float, params: Sequence[torch.Tensor],
                   grad_norm: float | None = None) -> None:
        """After step ``step`` (0-based; the update is applied): the bit-flip drill, the checksum
        comparison every ``checksum_every`` steps, the alerts, and rank 0's records (``grad_norm``:
        the step's global gradient norm before clipping, the run's ``grad_norm``)."""
        c = self.config
        if c.flip_bit_step == step and self.rank == self.flip_rank:
            flip_bit(next(p for p in params if p.dtype == torch.float32 and p.numel()))
            print(f"fault drill: rank {self.rank} flips a bit of its parameters after step {step}",
                  file=sys.stderr, flush=True)
        record: dict[str, Any] = {"step": step, "loss": loss, "grad_norm": grad_norm,
                                  "step_seconds": seconds, "tokens_per_s": self.tokens / seconds if seconds else None}
        if c.checksum_every and (step + 1) % c.checksum_every == 0:
            report = replica_report(params, self.key)
            record["diverged"] = report["diverged"]
            if report["diverged"]:
                entry = {"step": step, "diverged": report["diverged"], "ambiguous": bool(report["ambiguous"])}
                self.integrity.append(entry)
                if self.rank == 0:
                    how = " (two replicas disagree: no majority says which)" if report["ambiguous"] else ""
                    print(f"integrity: after step {step} rank(s) {report['diverged']} hold parameters that differ "
                          f"from their replicas'{how}", file=sys.stderr, flush=True)
        alerts = [a for a in (self.loss_alarm(loss),
                              self.grad_alarm(grad_norm) if grad_norm is not None else None) if a]
        if alerts:
            record["alerts"] = alerts
            self.alerts += [{"step": step, "alert": a} for a in alerts]
            if self.rank == 0:
                for a in alerts:
                    print(f"alert after step {step}: {a}", file=sys.stderr, flush=True)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer is not None:
            for name in ("loss", "grad_norm", "tokens_per_s", "step_seconds"):
                if record[name] is not None:
                    self.writer.add_scalar(f"train/{name}", record[name], step)
            if "diverged" in record:
                self.writer.add_scalar("integrity/diverged_ranks", len(record["diverged"]), step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()

    def summary(self) -> dict[str, Any]:
        """What :func:`~dtlib.trainer.train` adds to rank 0's summary."""
        return {"alerts": self.alerts, "integrity": self.integrity}


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a ``--metrics`` JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
