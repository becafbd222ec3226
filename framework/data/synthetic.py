"""Data generated from a seed (no files): the seed's regression data, and random tokens."""
import numpy as np
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


class RandomTokens(Dataset):
    """Windows of uniformly random token ids, each made from its own seed when asked for: any
    number of windows of any length at no cost, for measuring (the planner's dry runs at scale,
    benchmarks) where the text does not matter."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 128, num_samples: int = 1 << 20, seed: int = 1234,
                 split: str = "train"):
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.seed = [seed, 0 if split == "train" else 1]  # val: other windows

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        rng = np.random.default_rng([*self.seed, index])  # (torch's CPU generator keeps 32 bits of a seed)
        window = torch.from_numpy(rng.integers(self.vocab_size, size=self.seq_len + 1))
        return window[:-1], window[1:]
