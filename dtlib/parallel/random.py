"""Dropout under tensor parallelism: Megatron-LM's RNG tracker (``core/tensor_parallel/random.py``).

A dropout mask must be *the same* on every TP rank where the activation is replicated (the
residual stream without sequence parallelism: otherwise the replicas of the next layer's input
differ and the ranks drift apart), and *different* where each rank holds another part of the
activation (attention probabilities split by heads; the residual stream's ``s/t`` positions under
sequence parallelism: one seed would drop the same pattern in every part). Megatron-LM keeps two
random streams: the default generator, seeded alike on every TP rank, and a "model-parallel"
generator seeded ``seed + 2718 + tp_rank`` (``model_parallel_cuda_manual_seed``), entered with
``get_cuda_rng_tracker().fork()`` around dropout in the TP regions. This is that tracker for the
CPU generator (and the current CUDA device's when CUDA is initialised).

The masks are not the single process's (each rank draws its own), so a TP run with dropout equals
one process in distribution, not bit for bit; with ``dropout=0`` nothing here draws anything.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from dtlib.analytic import validate

__all__ = ["RNGStatesTracker", "MODEL_PARALLEL_RNG", "MODEL_PARALLEL_SEED_OFFSET", "model_parallel_manual_seed"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron-LM's model_parallel_cuda_manual_seed


def _get_state() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_state(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


class RNGStatesTracker:
    """Named random streams to switch into: ``with tracker.fork(): F.dropout(...)`` draws from the
    named stream and leaves the default stream exactly where it was."""

    def __init__(self) -> None:
        self.states: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` starting at ``seed`` (the default stream is left untouched)."""
        validate.integer("seed", seed, minimum=0)
        if name in self.states:
            raise ValueError(f"random stream {name!r} already exists")
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; its state advances, the default's does not."""
        if name not in self.states:
            raise ValueError(f"no random stream {name!r}; add it first (model_parallel_manual_seed)")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


def model_parallel_manual_seed(seed: int, tp_rank: int) -> RNGStatesTracker:
    """Megatron-LM's seeding: the default stream ``seed`` (the same on every TP rank: replicated
    activations get the same masks) and a tracker whose model-parallel stream starts at
    ``seed + 2718 + tp_rank`` (a different mask on each rank's part of a split activation)."""
    validate.integer("seed", seed, minimum=0)
    validate.integer("tp_rank", tp_rank, minimum=0)
    torch.manual_seed(seed)
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker
