"""A small CNN from the user's own module on a dataset of synthetic 1x8x8 images:
a bright horizontal bar (class 0) or vertical bar (class 1) on noise."""

import torch
from torch import nn
from torch.utils.data import Dataset


class Bars(Dataset):
    """Seeded images ``(1, 8, 8)`` float32 with int64 labels, as ``(image, label)``."""

    def __init__(self, size: int = 200, noise: float = 0.3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (size,), generator=g)
        self.images = noise * torch.randn(size, 1, 8, 8, generator=g)
        where = torch.randint(0, 8, (size,), generator=g)
        for i in range(size):
            if self.labels[i] == 0:
                self.images[i, 0, where[i], :] += 1.0
            else:
                self.images[i, 0, :, where[i]] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 2):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1))
        self.out = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x).flatten(1))
