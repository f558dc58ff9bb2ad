"""Text that ships with dtlib, so the trainer never downloads anything.

``coriolanus.txt``: the first 3,921 lines (about 100 kB) of William Shakespeare's *Coriolanus* (public
domain), as collected in Andrej Karpathy's "tiny shakespeare" (karpathy/char-rnn,
``data/tinyshakespeare/input.txt``).
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

from functools import lru_cache
from importlib.resources import files

import torch

__all__ = ["load_tokens", "token_batch", "VOCAB"]

VOCAB = 256  # byte-level tokens: every byte is a token, no tokenizer to ship


@lru_cache(maxsize=1)
def load_tokens(name: str = "coriolanus.txt") -> torch.Tensor:
    """The corpus as byte-level tokens (int64, values 0..255)."""
    data = files(__name__).joinpath(name).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def token_batch(step: int, batch_size: int, seq: int, seed: int = 0,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``batch_size`` windows of ``seq + 1`` tokens at offsets drawn
    from a generator seeded by (seed, step), as inputs ``[b, seq]`` and next-token targets. The same
    on every rank and in every run, so a parallel run sees exactly the single-process batches."""
    tokens = load_tokens() if tokens is None else tokens
    if seq + 1 > len(tokens):
        raise ValueError(f"seq={seq} is longer than the corpus ({len(tokens)} tokens)")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq, (batch_size,), generator=g)
    windows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
