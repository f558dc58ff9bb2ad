"""Checkpoints of a run: what each rank saves, the resume (on any layout of the same model) and the
check before any rank starts.

:class:`CheckpointHook` is the per-step hook (:mod:`dtlib.trainer.hooks`) that saves every
``checkpoint_every`` steps with a :class:`~dtlib.resilience.checkpoint.Checkpointer` (DCP, any
layout resumes it) or, with ``incremental``, a
:class:`~dtlib.resilience.incremental.TrainerCheckpointer` (deltas against a full save).

What changed since the checkpoint. Every checkpoint records the run (:func:`run_record`: the
model's shape, the optimizer and its hyper-parameters) in ``extra["config"]`` (the DCP manifest,
the incremental records), and :func:`check_resume` compares it with the new configuration before
any rank starts (the ranks compare again, for :func:`~dtlib.trainer.train` launched directly):

* another model (``--layers``, ``--heads``, ..., ``--tied-embeddings``: a changed ``--heads``
  keeps every shape, a changed ``--tied-embeddings`` every name, so loading would "work" -- and
  untied into tied silently drops the trained LM head) or another ``--optimizer`` (its state
  does not exist in the checkpoint) is refused, naming the flag and the saved value;
* another ``--lr`` would be silently ignored -- the checkpoint restores the optimizer's param
  groups, so the run trains at the saved learning rate -- and is refused unless
  ``--override-optimizer-params`` says to take this command's value, which then takes effect.
  Megatron-LM's precedent: ``--override-opt_param-scheduler`` (megatron-core's
  ``OptimizerParamScheduler._check_and_set``, ``megatron/core/optimizer_param_scheduler.py``,
  asserts "class input value ... and checkpoint value ... do not match" unless told to override
  or to use the checkpoint's). ``dtlib train`` has no learning-rate schedule; the pipeline
  ``--schedule``, the layout and the batch hold no state and may change (resharding).
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

__all__ = ["CheckpointHook", "check_resume", "run_record", "compare_run", "MODEL_FIELDS", "OPTIMIZER_PARAMS"]

# the model's shape as TransformerConfig resolves it (kv_heads and ffn filled in)
MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "moe_experts", "moe_top_k",
                "tied_embeddings")
OPTIMIZER_PARAMS = ("lr",)  # the optimizer's hyper-parameters dtlib train sets (the rest: PyTorch's defaults)


def run_record(config: TrainConfig) -> dict[str, Any]:
    """What a checkpoint records of the run: the model's shape, the optimizer, its hyper-parameters."""
    model = config.model_config()
    return {**{k: getattr(model, k) for k in MODEL_FIELDS}, "optimizer": config.optimizer,
            **{k: getattr(config, k) for k in OPTIMIZER_PARAMS}}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def compare_run(saved: dict[str, Any] | None, config: TrainConfig, where: str) -> list[str]:
    """A one-line ValueError for a change a resume from ``where`` would silently ignore or lose
    (see the module doc); the notes of the overridden values otherwise. ``saved`` None (a
    checkpoint from before dtlib recorded its run): nothing to compare."""
    if saved is None:
        return []
    mine = run_record(config)
    for k in MODEL_FIELDS:
        if k in saved and saved[k] != mine[k]:
            if k == "tied_embeddings":  # the same names either way: nothing else would notice
                how = "with" if saved[k] else "without"
                held = ("one matrix for the embedding and the LM head" if saved[k]
                        else "an LM head of its own, which a tied model would discard")
                raise ValueError(f"{where} was trained {how} --tied-embeddings ({held}); resume {how} it")
            raise ValueError(f"{_flag(k)} {mine[k]} differs from the checkpoint's {saved[k]} ({where}): another "
                             f"model; resume with {_flag(k)} {saved[k]}")
    if "optimizer" in saved and saved["optimizer"] != mine["optimizer"]:
        raise ValueError(f"--optimizer {mine['optimizer']} differs from the checkpoint's {saved['optimizer']} "
                         f"({where}): its state holds no {mine['optimizer']} state; resume with "
                         f"--optimizer {saved['optimizer']}")
    notes = []
    for k in OPTIMIZER_PARAMS:
        if k in saved and saved[k] != mine[k]:
            if not config.override_optimizer_params:
                raise ValueError(f"{_flag(k)} {mine[k]:g} differs from the checkpoint's {saved[k]:g} ({where}), which "
                                 f"a resume restores: pass --override-optimizer-params to train at {mine[k]:g}, "
                                 f"or {_flag(k)} {saved[k]:g}")
            notes.append(f"{k} {saved[k]:g} -> {mine[k]:g} (--override-optimizer-params)")
    return notes


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
                 "num_microbatches": c.num_microbatches, "config": run_record(c)}
        if run.stream is not None:  # lesson 12: the streaming position, global so any world resumes it
            extra["data_state"] = run.stream.state_dict()
        self.checkpointer.save(run.step_count, model, run.optimizer, data_position=run.step_count,
                               layout=saved_layout(run), extra=extra, owned=owned)

    def resume(self, run: Any) -> str:
        """Load the newest checkpoint, whatever layout wrote it; returns the line to log."""
        c = run.config
        model, owned = checkpointed(run)
        notes: list[str] = []
        info = self.checkpointer.load(model, run.optimizer, owned=owned,
                                      check=lambda extra, path: notes.extend(compare_run(extra.get("config"), c, path)))
        if info is None:
            return f"no checkpoint in {self.checkpointer.directory} yet: starting at step 0"
        if info["data_position"] > c.steps:
            raise ValueError(f"the checkpoint {info['path']} is at step {info['data_position']}, past "
                             f"--steps {c.steps}: ask for more steps")
        if c.override_optimizer_params:  # the checkpoint restored the saved values: this run's instead
            for group in run.optimizer.param_groups:
                for k in OPTIMIZER_PARAMS:
                    group[k] = getattr(c, k)
        run.step_count = info["data_position"]
        if run.stream is not None:  # lesson 12: samples consumed, whatever world size saved them
            run.stream.load_state_dict(info["extra"].get("data_state", {**run.stream.state_dict(),
                                                                        "consumed": run.step_count * c.global_batch}))
        line = f"resumed at step {run.step_count} from {info['path']}"
        if info.get("skipped"):  # incremental: newer steps whose files did not verify
            line += f", the last good checkpoint ({'; '.join(info['skipped'])})"
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
        if notes:
            line += f"; {', '.join(notes)}"
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
    """Before any process starts: the checkpoint ``resume`` would load is complete and intact
    (every file with its size and sha256), holds this model (every tensor's full shape) and was
    trained with the same model and optimizer settings (:func:`compare_run`); a one-line
    ValueError naming the file or the flag otherwise. Incremental checkpoints: the newest step
    whose every rank file verifies (a newer corrupt one is skipped, and the ranks say so); none
    verifying is an error. Nothing to resume is fine (the run starts at step 0)."""
    if not (config.resume and config.checkpoint_dir):
        return
    try:
        if config.incremental:
            _check_incremental(config)
            return
        path = latest_checkpoint(config.checkpoint_dir)
        if path is None:
            return
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            model = TinyGPT(config.model_config())
        shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
        manifest = read_manifest(path)
        verify_files(path, manifest)
        check_model(path, manifest, shapes, shapes)  # another shape: the manifest names the tensors
        compare_run(manifest["extra"].get("config"), config, path)
    except CheckpointError as e:  # names the file: a one-line error before any rank starts
        raise ValueError(str(e)) from None


def _check_incremental(config: TrainConfig) -> None:
    """:func:`check_resume` for ``--incremental`` checkpoints (every rank's files read here)."""
    directory, world = config.checkpoint_dir, config.world_size
    saved = _incremental.complete_steps(directory, 1)  # steps rank 0 wrote: how many ranks did?
    if saved:
        ranks = _incremental.read_record(directory, saved[-1], 0)["info"].get("world_size", world)
        if ranks != world:
            raise ValueError(f"--incremental checkpoints resume on the layout that saved them: {ranks} ranks "
                             f"saved {directory}, this run has {world}")
    errors = []
    for step in reversed(_incremental.complete_steps(directory, world)):
        try:
            records = [_incremental.verify_step(directory, step, r) for r in range(world)]
        except CheckpointError as e:  # the ranks fall back to an older step, and say so
            errors.append(str(e))
            continue
        where = _incremental.step_dir(directory, step)
        compare_run(records[0]["info"].get("extra", {}).get("config"), config, where)
        return
    if errors:
        raise CheckpointError(errors[0])
