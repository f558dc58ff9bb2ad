"""Memory: the measurements a lesson runs on one process (CPU or GPU).

* :func:`recompute_tradeoff` - one TinyGPT with and without gradient checkpointing: the bytes
  autograd saves for backward (:func:`dtlib.measure.saved_activation_bytes`), the time of a
  training step (``torch.utils.benchmark``) and what :func:`dtlib.analytic.memory.memory_per_gpu` predicts
  (Korthikanti et al. 2022, Sec. 4, via :mod:`dtlib.analytic.activations`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from dtlib.analytic import validate
from dtlib.measure import saved_activation_bytes
from dtlib.analytic.memory import memory_per_gpu
from dtlib.models import TinyGPT
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.precision import precision

__all__ = ["RECOMPUTE_RUNS", "recompute_tradeoff"]

# run name -> whether every block is wrapped in torch.utils.checkpoint (dtlib.analytic.memory's "full")
RECOMPUTE_RUNS: dict[str, bool] = {"store everything": False, "checkpoint each block": True}


def recompute_tradeoff(cfg: TransformerConfig, batch: int = 8, *, min_run_time: float = 0.5,
                       seed: int = 0) -> dict[str, dict[str, float]]:
    """Measure what gradient checkpointing saves and costs on ``TinyGPT(cfg)`` in fp32.

    Two runs on the same random batch of ``batch`` sequences of ``cfg.seq`` tokens:
    ``"store everything"`` (``TinyGPT(cfg)``) and ``"checkpoint each block"``
    (``TinyGPT(cfg, checkpoint=True)``: each block wrapped in ``torch.utils.checkpoint``,
    non-reentrant). Per run:

    * ``saved_bytes``: bytes of the distinct storages autograd saves for backward during the
      forward pass and the loss (:func:`dtlib.measure.saved_activation_bytes`; the model's own
      parameters and buffers excluded);
    * ``predicted_bytes``: :func:`dtlib.analytic.memory.memory_per_gpu`'s activations for
      ``Parallelism(micro_batch_size=batch, recompute="none" | "full")``, fp32 activations, no dropout
      masks - the tensor-by-tensor count of Korthikanti et al. 2022, "Reducing Activation
      Recomputation in Large Transformer Models", Sec. 4 (:mod:`dtlib.analytic.activations`); with full
      recompute only each layer's input is kept (their Sec. 4.3). The formula's
      ``recompute_buffer`` (one layer rebuilt during backward) is subtracted: it lives only in
      backward, so it is never among the tensors saved by the forward pass;
    * ``step_seconds``: median time of one forward + backward
      (``torch.utils.benchmark.Timer(...).blocked_autorange(min_run_time)``, its default of one
      thread).

    ``seed`` fixes the batch and the initial weights without touching the caller's global random
    state. Raises ``ValueError`` for a ``cfg`` that is not a :class:`TransformerConfig`, a
    ``batch`` that is not a positive integer or a ``min_run_time`` that is not positive.
    """
    if not isinstance(cfg, TransformerConfig):
        raise ValueError(f"cfg must be a TransformerConfig (e.g. tiny_gpt_config(...)), got {cfg!r}")
    validate.integer("batch", batch)  # sequences per step
    validate.number("min_run_time", min_run_time)  # seconds
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=torch.Generator().manual_seed(seed))
    runs: dict[str, dict[str, float]] = {}
    for name, ck in RECOMPUTE_RUNS.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = TinyGPT(cfg, checkpoint=ck).train()

        def loss_fn(model: TinyGPT = model) -> torch.Tensor:
            return F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())

        saved = saved_activation_bytes(model, loss_fn)["bytes"]
        step = Timer("loss_fn().backward()", globals={"loss_fn": loss_fn}).blocked_autorange(
            min_run_time=min_run_time)
        pred = memory_per_gpu(cfg, Parallelism(micro_batch_size=batch, recompute="full" if ck else "none"),
                              precision=precision("fp32"), dropout=False,
                              flash_attention=False)  # TinyGPT writes attention out: scores stored
        kept = pred.activations - pred.activation_detail["recompute_buffer"]
        runs[name] = {"saved_bytes": saved, "predicted_bytes": float(kept),
                      "step_seconds": float(step.median)}
    return runs
