"""Checkpoints of a run: what each rank saves, the resume (on any layout of the same model) and the
check before any rank starts.

:class:`CheckpointHook` is the per-step hook (:mod:`dtlib.trainer.hooks`) that saves every
``checkpoint_every`` steps with a :class:`~dtlib.resilience.checkpoint.Checkpointer` (DCP, any
layout resumes it) or, with ``incremental``, a
:class:`~dtlib.resilience.incremental.TrainerCheckpointer` (deltas against a full save).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from dtlib.models.gpt import TinyGPT
from dtlib.resilience.checkpoint import (Checkpointer, CheckpointError, check_model, latest_checkpoint,
                                         read_manifest, verify_files)
from dtlib.resilience import incremental as _incremental  # lesson 12
from dtlib.trainer.config import TrainConfig
from dtlib.trainer.hooks import Hook
from dtlib.trainer.rank import in_stage

__all__ = ["CheckpointHook", "check_resume"]


def checkpointed(run: Any) -> tuple[nn.Module, Any]:
    """What this rank saves: the (wrapped) model, and with a pipeline only its stages' names.
    A tied embedding is in the state dict twice (``wte.weight``, ``lm_head.weight``): the
    first stage saves and loads the one, the last stage its copy as the other."""
    if run.config.pp == 1:
        return (run.fsdps[0] if run.fsdps else run.model), None
    # a stage's FSDP leaves the model's own parameters sharded, which the checkpoint sees
    return run.model, lambda name: any(in_stage(name, s) for s in run.chunks)


def saved_layout(run: Any) -> dict[str, Any]:
    """The layout a checkpoint records (and a resume compares with)."""
    c = run.config
    return {**asdict(run.layout), "zero": c.zero, "sequence_parallel": c.sequence_parallel,
            "world_size": run.layout.world_size}


def _layout_text(layout: dict[str, Any]) -> str:
    """``dp2 x tp2 x pp2, zero1`` for a saved layout (sizes of 1 left out)."""
    sizes = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) > 1] or ["1 process"]
    text = " x ".join(sizes)
    if layout.get("zero"):
        text += f", zero{layout['zero']}"
    return text + (", sp" if layout.get("sequence_parallel") else "")


class CheckpointHook(Hook):
    """Save every ``checkpoint_every`` steps; :meth:`resume` loads the newest checkpoint."""

    def __init__(self, config: TrainConfig):
        c = config
        self.config = c
        if c.incremental:  # lesson 12: deltas against a full checkpoint
            self.checkpointer: Any = _incremental.TrainerCheckpointer(c.checkpoint_dir, c.full_every)
        else:
            self.checkpointer = Checkpointer(c.checkpoint_dir, keep_last=c.keep_last,
                                             milestone_every=c.milestone_every, async_save=c.async_checkpoint)

    def after_step(self, run: Any, loss: float, seconds: float) -> None:
        if self.config.checkpoint_every and run.step_count % self.config.checkpoint_every == 0:
            run.beat(run.step_count, "checkpoint")
            self.save(run)

    def save(self, run: Any) -> None:
        """Checkpoint after ``step_count`` steps (a collective): sharded as this layout holds the
        state; the data position is the next global batch (batches are a function of the step)."""
        c = run.config
        model, owned = checkpointed(run)
        extra = {"global_batch": c.global_batch, "seq": c.seq, "seed": c.seed,
                 "num_microbatches": c.num_microbatches}
        if run.stream is not None:  # lesson 12: the streaming position, global so any world resumes it
            extra["data_state"] = run.stream.state_dict()
        self.checkpointer.save(run.step_count, model, run.optimizer, data_position=run.step_count,
                               layout=saved_layout(run), extra=extra, owned=owned)

    def resume(self, run: Any) -> str:
        """Load the newest checkpoint, whatever layout wrote it; returns the line to log."""
        c = run.config
        model, owned = checkpointed(run)
        info = self.checkpointer.load(model, run.optimizer, owned=owned)
        if info is None:
            return f"no checkpoint in {self.checkpointer.directory} yet: starting at step 0"
        if info["data_position"] > c.steps:
            raise ValueError(f"the checkpoint {info['path']} is at step {info['data_position']}, past "
                             f"--steps {c.steps}: ask for more steps")
        run.step_count = info["data_position"]
        if run.stream is not None:  # lesson 12: samples consumed, whatever world size saved them
            run.stream.load_state_dict(info["extra"].get("data_state", {**run.stream.state_dict(),
                                                                        "consumed": run.step_count * c.global_batch}))
        line = f"resumed at step {run.step_count} from {info['path']}"
        saved, mine = info["layout"], saved_layout(run)
        if saved != mine:
            line += f" (resharded from {_layout_text(saved)} to {_layout_text(mine)})"
        extra = info["extra"]
        changed = [f"{k} {extra[k]} -> {getattr(c, k)}" for k in ("global_batch", "seq", "seed")
                   if getattr(c, k) != extra[k]]
        if changed:
            line += f"; changed since: {', '.join(changed)} (the data differs from the saved run's)"
        elif extra["num_microbatches"] != c.num_microbatches:
            line += (f"; num_microbatches {extra['num_microbatches']} -> {c.num_microbatches} keeps the "
                     f"global batch of {c.global_batch}")
        return line

    def close(self) -> None:
        self.checkpointer.close()  # the last asynchronous save is complete before the run reports

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.checkpointer.blocking_seconds:
            out["checkpoint_blocking_s"] = self.checkpointer.blocking_seconds
        if isinstance(self.checkpointer, _incremental.TrainerCheckpointer):
            out["checkpoint_bytes"] = [{"step": s, "kind": k, "bytes": b} for s, k, b in self.checkpointer.written]
            out["full_state_bytes"] = self.checkpointer.full_bytes
        return out


def check_resume(config: TrainConfig) -> None:
    """Before any process starts: the newest checkpoint ``resume`` would load is complete (every
    file there with its size and sha256) and holds this model (every tensor's full shape); a
    ValueError naming the file otherwise. Nothing to resume is fine (the run starts at step 0)."""
    if not (config.resume and config.checkpoint_dir):
        return
    path = latest_checkpoint(config.checkpoint_dir)
    if path is None:
        return
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = TinyGPT(config.model_config())
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    try:
        manifest = read_manifest(path)
        verify_files(path, manifest)
        check_model(path, manifest, shapes, shapes)
    except CheckpointError as e:  # names the file: a one-line error before any rank starts
        raise ValueError(str(e)) from None
