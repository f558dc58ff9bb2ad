"""What every framework run returns, and how two runs are compared.

A :class:`FrameworkRun` has the same fields whatever ran it (dtlib, one process, DeepSpeed,
Megatron-Core, JAX or Ray Train), so a test asserts ``compare(run, reference)`` and a lesson
draws the runs side by side.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FrameworkRun", "compare", "token_batches"]


@dataclass
class FrameworkRun:
    """One training run under one framework.

    ``losses``: the global mean loss of each step. ``params``: the final parameters, full
    (gathered from every shard), as NumPy arrays keyed by the *reference model's* names, so two
    runs compare name by name. ``memory``: per rank, bytes actually held by that rank, keyed by
    ``parameters``, ``gradients`` and ``optimizer`` (and anything else measured, e.g.
    ``offloaded``). ``collectives``: per rank, calls counted by operation, spelled as
    ``torch.distributed`` spells them (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``send``, ...). ``settings``: what the framework was told (its config, flags or mesh), and
    ``notes``: what it decided or needed (shims applied, defaults overridden), one line each.
    """
    framework: str
    layout: str
    losses: list[float]
    params: dict[str, np.ndarray]
    memory: list[dict[str, int]] = field(default_factory=list)
    collectives: list[dict[str, int]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def compare(run: FrameworkRun, reference: FrameworkRun) -> dict[str, float]:
    """The largest absolute difference in loss (any step) and in any parameter element between
    ``run`` and ``reference``; a missing or extra parameter name, a shape change or a different
    number of steps is an error naming it (never a silently small difference)."""
    if len(run.losses) != len(reference.losses):
        raise ValueError(f"{run.framework} ran {len(run.losses)} steps, {reference.framework} "
                         f"{len(reference.losses)}")
    missing = sorted(set(reference.params) - set(run.params))
    extra = sorted(set(run.params) - set(reference.params))
    if missing or extra:
        raise ValueError(f"{run.framework} parameters differ from {reference.framework}'s: "
                         f"missing {missing[:3]}, extra {extra[:3]}")
    loss_diff = max((abs(a - b) for a, b in zip(run.losses, reference.losses)), default=0.0)
    param_diff = 0.0
    for name, ref in reference.params.items():
        got = np.asarray(run.params[name])
        if got.shape != np.shape(ref):
            raise ValueError(f"{name}: {run.framework} has shape {got.shape}, "
                             f"{reference.framework} {np.shape(ref)}")
        param_diff = max(param_diff, float(np.max(np.abs(got - np.asarray(ref)), initial=0.0)))
    return {"max_loss_diff": float(loss_diff), "max_param_diff": param_diff}


def token_batches(steps: int, global_batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    """The same training data for every framework: ``steps`` global batches of ``global_batch``
    sequences of ``seq + 1`` token ids in ``[0, vocab)`` (inputs are ``[..., :-1]``, targets
    ``[..., 1:]``), drawn with NumPy's PCG64 from ``seed``, shape ``(steps, global_batch, seq + 1)``.
    A framework that splits the batch over ranks takes rank ``r``'s rows as ``r::dp`` or as
    contiguous blocks; either way the global mean loss is the same."""
    for name, value in (("steps", steps), ("global_batch", global_batch), ("seq", seq), ("vocab", vocab)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(steps, global_batch, seq + 1), dtype=np.int64)
