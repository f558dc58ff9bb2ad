"""A small CNN for 28x28 greyscale digits (MNIST), in the spirit of PyTorch's MNIST example.

Reference: pytorch/examples ``mnist/main.py`` (two conv layers, max-pool, two linear layers),
shrunk so that a data-parallel lesson runs on 2 CPU cores in seconds.
"""
from __future__ import annotations

import torch
from torch import nn


class MnistCNN(nn.Module):
    """conv(1->c1) -> relu -> pool -> conv(c1->c2) -> relu -> pool -> linear(hidden) -> relu -> linear(10)."""

    def __init__(self, channels: tuple[int, int] = (8, 16), hidden: int = 64, num_classes: int = 10):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 28 -> 14
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 14 -> 7
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c2 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1:] != (1, 28, 28):
            raise ValueError(f"MnistCNN expects images of shape [batch, 1, 28, 28], got {tuple(x.shape)}")
        return self.classifier(self.features(x))
