"""The vocabulary-parallel loss and embedding behave as PyTorch's on what PyTorch users pass them:
padded targets (ignore_index=-100), targets outside the vocabulary, an embedding's padding_idx;
options they cannot honour are refused by name."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.launcher import launch
from dtlib.parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

TIMEOUT = 60
VOCAB = 16
# float32 softmax over a vocabulary split in two vs whole: rounding of ~1e-7
TOL = 1e-6


def _padded_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, VOCAB, generator=g)
    targets = torch.randint(0, VOCAB, (3, 5), generator=g)
    targets[0, 3:] = -100  # padding, PyTorch's ignore_index
    targets[2, 1:] = -100
    return logits, targets


def _probe():
    """A fixed output gradient (the pad row starts at zero, so a loss like sum(out ** 2) would give
    it a zero gradient anyway and test nothing)."""
    return torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))


def _with_target(targets, value):
    bad = targets.clone()
    bad[1, 2] = value
    return bad


def _error(fn):
    try:
        fn()
    except (ValueError, IndexError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _on_rank(rank, world):
    out = {}
    logits, targets = _padded_batch()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets)
    loss.backward()
    out["loss"], out["grad"] = loss.item(), local.grad
    out["too_big"] = _error(lambda: vocab_parallel_cross_entropy(local, _with_target(targets, VOCAB)))
    out["negative"] = _error(lambda: vocab_parallel_cross_entropy(local, _with_target(targets, -1)))
    # the embedding: a pad row on each rank's half in turn
    for pad in (3, 12):
        torch.manual_seed(0)
        ref = nn.Embedding(VOCAB, 4, padding_idx=pad)
        emb = VocabParallelEmbedding(ref, None)
        idx = torch.tensor([[pad, 1, 12, pad], [3, 9, 0, 15]])
        (emb(idx) * _probe()).sum().backward()
        out[f"pad{pad}"] = (emb(idx).detach(), emb.weight.grad, emb.vocab_start)
    out["max_norm"] = _error(lambda: VocabParallelEmbedding(nn.Embedding(VOCAB, 4, max_norm=1.0)))
    out["freq"] = _error(lambda: VocabParallelEmbedding(nn.Embedding(VOCAB, 4, scale_grad_by_freq=True)))
    dist.barrier()  # every rank refused before any collective: nobody is stuck in one
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_on_rank, 2, timeout=TIMEOUT)


def test_cross_entropy_ignores_padded_targets_like_pytorch(ranks):
    logits, targets = _padded_batch()
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten())  # ignore_index=-100 by default
    ref.backward()
    for rank, got in enumerate(ranks):
        assert got["loss"] == pytest.approx(ref.item(), abs=TOL)
        assert (got["grad"] - full.grad.chunk(2, -1)[rank]).abs().max() < TOL
    assert (full.grad[0, 3:] == 0).all()  # what "ignored" means: no gradient


def test_cross_entropy_refuses_targets_outside_the_vocabulary(ranks):
    logits, targets = _padded_batch()
    with pytest.raises(IndexError):  # what PyTorch does with the same targets
        F.cross_entropy(logits.flatten(0, 1), _with_target(targets, VOCAB).flatten())
    for got in ranks:
        assert "IndexError" in got["too_big"] and f"outside the vocabulary [0, {VOCAB})" in got["too_big"]
        assert "targets hold -1" in got["negative"]


def test_embedding_keeps_padding_idx_like_nn_embedding(ranks):
    for pad in (3, 12):
        torch.manual_seed(0)
        ref = nn.Embedding(VOCAB, 4, padding_idx=pad)
        idx = torch.tensor([[pad, 1, 12, pad], [3, 9, 0, 15]])
        (ref(idx) * _probe()).sum().backward()
        for got in ranks:
            out, grad, start = got[f"pad{pad}"]
            assert torch.allclose(out, ref(idx), atol=TOL)
            assert torch.allclose(grad, ref.weight.grad[start:start + VOCAB // 2], atol=TOL)
        assert (ref.weight.grad[pad] == 0).all() and ref.weight.grad.abs().sum() > 0


def test_embedding_refuses_what_it_cannot_honour(ranks):
    for got in ranks:
        assert "max_norm" in got["max_norm"] and "scale_grad_by_freq" in got["freq"]
