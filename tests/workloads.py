"""Small seeded workloads shared by the parallelism tests: CNN images or GPT token batches."""
import torch
import torch.nn.functional as F


def make_batches(kind: str, steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (inputs, targets) pairs for the MNIST CNN (``"cnn"``) or a 64-token GPT (``"gpt"``)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
                for _ in range(steps)]
    tokens = [torch.randint(0, 64, (batch, 17), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_fn(model, x, y):
    """Cross-entropy over every position (logits upcast, so low-precision compute works too)."""
    out = model(x).float()
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
