"""The seed's regression data, generated in memory from a seed (no files)."""
import torch
from torch.utils.data import Dataset


class SyntheticRegression(Dataset):
    """The seed's random regression data, embedded: x ~ N(0, 1), y = x @ W + noise, all seeded."""

    def __init__(self, num_samples: int = 1536, in_dim: int = 12, out_dim: int = 12,
                 noise: float = 0.1, seed: int = 1234):
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(num_samples, in_dim, generator=gen)
        weight = torch.randn(in_dim, out_dim, generator=gen) / in_dim**0.5
        self.targets = self.inputs @ weight + noise * torch.randn(num_samples, out_dim, generator=gen)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index]
