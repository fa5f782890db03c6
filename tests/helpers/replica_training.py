"""A few SGD steps of a small classifier through a strategy, shared by the tests that
compare execution modes: the trained parameters as bytes, equal only bit for bit."""

import torch
import torch.nn.functional as F


def train_bits(strategy, dropout: bool = False, seed: int = 0, steps: int = 6) -> bytes:
    torch.manual_seed(seed)
    with strategy.scope():
        layers = [torch.nn.Linear(64, 256), torch.nn.ReLU()]
        if dropout:
            layers.append(torch.nn.Dropout(0.5))
        model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(256, 64, generator=g), torch.randint(0, 4, (256,), generator=g))
            for _ in range(steps)]

    def step(x, y):
        F.cross_entropy(model(x), y, reduction="sum").div(256).backward()
    for x, y in strategy.experimental_distribute_dataset(data):
        opt.zero_grad()
        strategy.run(step, args=(x, y))
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())
